"""Fixtures of the user interfaces' tests (the notebook view, the Gradio demo, the web client).

Browser tests launch Chromium themselves with `browser_fixtures`' path and flags; the notebook
tests share ``fake_jupyter`` below.
"""

from __future__ import annotations

import pytest

import multistream.ui.notebook as nb


class _FakeHandle:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def update(self, obj: object) -> None:
        self.log.append(obj.data)  # type: ignore[attr-defined]


@pytest.fixture
def fake_jupyter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Pretend to be in a kernel: record what show() displays and every update of it."""
    import IPython.display

    log: list[str] = []

    def display(obj: object, display_id: bool = False) -> _FakeHandle:
        assert display_id is True
        log.append(obj.data)  # type: ignore[attr-defined]
        return _FakeHandle(log)

    monkeypatch.setattr(nb, "_in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    return log
