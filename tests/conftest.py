"""Shared fixtures. Each block is owned by one part of the suite; keep blocks independent."""

from __future__ import annotations

import os

import pytest

# Tests never reach a model hub: everything they load is embedded or built in the test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


# -- text model (real embedded default; loaded once per session) ------------------------------


@pytest.fixture(scope="session")
def text_model():
    import multistream as ms

    return ms.load_text_model()


@pytest.fixture(scope="session")
def text_tokenizer(text_model):
    return text_model.tokenizer
