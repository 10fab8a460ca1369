"""Helpers for driving the Gradio demo in headless Chromium (the browser tests)."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["set_number"]


def set_number(pg: Any, elem_id: str, value: float, timeout: float = 30.0) -> None:
    """Type ``value`` into the number box of the Gradio slider or number ``#elem_id`` and wait until
    the component holds it (a slider's range input follows its box once the value is committed).
    A box that Gradio re-rendered meanwhile (an accordion opening) lost the typing: type again."""
    box = pg.locator(f"#{elem_id} input[type=number]")
    committed = pg.locator(f"#{elem_id} input[type=range]")
    if committed.count() == 0:
        committed = box
    deadline = time.monotonic() + timeout
    while True:
        box.fill(str(value))
        box.press("Enter")
        box.blur()
        for _ in range(10):
            if float(committed.input_value()) == float(value):
                return
            time.sleep(0.1)
        if time.monotonic() > deadline:
            raise AssertionError(f"#{elem_id} still holds {committed.input_value()}, not {value}")
