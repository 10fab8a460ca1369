"""Fixtures of the text family's tests. The models themselves are session fixtures of the suite's
root conftest (``text_model``, ``exact_text_model``, ``text_tokenizer``), shared with the server tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def llm(text_model: Any) -> Any:
    """The default text model, checked to be what the exactness tests assume: int4 weights on the
    native layers with fp32 activations (one arithmetic for decode, prefill and lookahead)."""
    quantization = text_model.quantization
    assert quantization.mode == "int4" and quantization.activations == "fp32"
    assert quantization.native_layers == 30, "the default model runs on the native layers"
    return text_model
