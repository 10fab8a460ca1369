"""Fixtures of the video family's tests: the embedded text-to-video model, loaded once per module
(skipped with the command that trains it where it is not shipped). Random-weight pipelines of the
diffusers families are built by `multistream.testing._random_video` in each module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from multistream.video._loading import EMBEDDED_VIDEO_DIR


@pytest.fixture(scope="module")
def video_model() -> Iterator[Any]:
    """``ms.load_video_model()``: the embedded model, on the CPU; closed after the module."""
    if not EMBEDDED_VIDEO_DIR.exists():
        pytest.skip("model not trained yet: run scripts/train_shapes_video_model.py")
    import multistream as ms

    model = ms.load_video_model()
    yield model
    model.close()
