"""demos/notebook.ipynb runs headless on the default models and updates its displays live."""

from __future__ import annotations

from pathlib import Path

import pytest

from repo_paths import ROOT

pytestmark = pytest.mark.model

NOTEBOOK = ROOT / "demos" / "notebook.ipynb"


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
    # No library warning in a newcomer's first cells: tqdm's "IProgress not found. Please update jupyter
    # and ipywidgets" came with every model load until the notebook extra brought ipywidgets.
    stderr = [o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "stream" and o.name == "stderr"]
    assert not any("IProgress" in text or "Warning" in text for text in stderr), stderr
    cells_with_updates = {u["cell"] for u in updates}
    assert len(cells_with_updates) >= 4  # text, image, chain, merge each updated in place
    assert any("data:image/jpeg;base64," in u["html"] for u in updates)  # live previews
    assert any("data:image/png;base64," in u["html"] for u in updates)  # final images
    assert any("tokens/s" in u["html"] for u in updates)


VIDEO_NOTEBOOK = NOTEBOOK.parent / "video.ipynb"


def test_video_notebook_runs_and_plays_every_frame_live(tmp_path: Path) -> None:
    """demos/video.ipynb in a kernel: each show() updates its output in place with animated previews,
    then the clip. Where the embedded video model is not installed yet, a tiny random Wan 2.1
    pipeline folder stands in for it (a first hidden cell points the loader there)."""
    import json
    import os

    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    from multistream.video import EMBEDDED_VIDEO_DIR

    nb = nbformat.read(VIDEO_NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook with outputs cleared"
    if not (EMBEDDED_VIDEO_DIR / "model_index.json").is_file():
        from multistream.testing._random_video import tiny_wan_pipeline

        folder = tmp_path / "stand-in"
        tiny_wan_pipeline().save_pretrained(folder)
        (folder / "video.json").write_text(json.dumps({"num_frames": 9, "height": 16, "width": 16, "steps": 8}))
        nb.cells.insert(0, nbformat.v4.new_code_cell(
            f"import pathlib, multistream.video._loading as _l; _l.EMBEDDED_VIDEO_DIR = pathlib.Path({str(folder)!r})"))
    updates: list[dict] = []
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=900,
                                     resources={"metadata": {"path": str(tmp_path)}})
    original = client.process_message

    def record(msg: dict, cell: object, cell_index: int) -> object:
        if msg["header"]["msg_type"] == "update_display_data":
            updates.append({"cell": cell_index, "html": msg["content"]["data"].get("text/html", "")})
        return original(msg, cell, cell_index)

    client.process_message = record  # type: ignore[method-assign]
    root = str(ROOT)
    client.execute(env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)})
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert len({u["cell"] for u in updates}) >= 2  # the clip and the prompt-to-video chain, each updated in place
    assert any("data:image/webp;base64," in u["html"] for u in updates)  # every frame's preview, live
    assert sum("<video" in u["html"] for u in updates) >= 2  # each ends on its clip
