"""demos/notebook.ipynb runs headless on the default models and updates its displays live."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.model

NOTEBOOK = Path(__file__).resolve().parents[1] / "demos" / "notebook.ipynb"


def _image_model_available() -> bool:
    try:
        import multistream as ms

        ms.load_image_model  # type: ignore[attr-defined]  # noqa: B018
        from multistream._models import shapes  # type: ignore[import-not-found]  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def test_notebook_runs_and_streams_display_updates() -> None:
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    if not _image_model_available():
        pytest.skip("the embedded image model has not landed yet (multistream/_models/shapes/)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook with outputs cleared"
    updates: list[dict] = []

    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(NOTEBOOK.parent)}})

    original = client.process_message

    def record(msg: dict, cell: object, cell_index: int) -> object:
        if msg["header"]["msg_type"] == "update_display_data":
            updates.append({"cell": cell_index, "html": msg["content"]["data"].get("text/html", "")})
        return original(msg, cell, cell_index)

    client.process_message = record  # type: ignore[method-assign]
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    cells_with_updates = {u["cell"] for u in updates}
    assert len(cells_with_updates) >= 4  # text, image, chain, merge each updated in place
    assert any("data:image/jpeg;base64," in u["html"] for u in updates)  # live previews
    assert any("data:image/png;base64," in u["html"] for u in updates)  # final images
    assert any("tokens/s" in u["html"] for u in updates)
