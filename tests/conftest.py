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
def exact_text_model():
    """The embedded model with its exact fp32 weights (``quantize=None``), for tests that compare
    the engine with another computation of the same tokens (transformers prefilling a whole
    sequence at once, its beam search, a failover's re-prefill). In fp32 the two agree to the
    greedy token; the default quantized model rounds each layer's input to bf16, so a different
    order of the same arithmetic can change its text after some tokens (its own parity, batch
    against alone and against its own ``generate``, is tested in tests/text/test_quantize.py)."""
    import multistream as ms

    llm = ms.load_text_model(quantize=None)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def text_tokenizer(text_model):
    return text_model.tokenizer
