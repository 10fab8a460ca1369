"""Fixtures of the image family's tests: the embedded model, loaded once per module.

The random-weight diffusers pipelines these tests build are each module's own (their families
differ); ``one_thread`` and ``Lockstep`` live in test_image.py, which the modules that need them import.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import multistream as ms


@pytest.fixture(scope="module")
def shapes() -> Iterator[ms.ImageModel]:
    """The embedded shapes model (offline, no argument), on the CPU; closed after the module."""
    model = ms.load_image_model(device="cpu")
    yield model
    model.close()
