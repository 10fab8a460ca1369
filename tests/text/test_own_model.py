"""Your own model: ``ms.load_text_model(model, tokenizer=tok)`` with the transformers objects a
``TextIteratorStreamer`` user holds (the tokenizer found from the model's ``name_or_path`` when
omitted), and ``quantize="auto"`` on a Llama-architecture model: the native kernels where they
compute the model's own weights (GGUF block values: a local folder saved from the embedded model),
the weights as loaded elsewhere, with a hint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import multistream as ms
from multistream.text._accel.block_layers import Q4Linear, Q8Linear
from multistream.text._accel.kernels import native_kernels
from multistream.text._accel.quantize import exact_block_states

NATIVE = native_kernels() is not None
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from multistream.text._loading import _embedded_model_folder

    return AutoTokenizer.from_pretrained(_embedded_model_folder())


def _tiny_llama(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return LlamaForCausalLM(config).eval()


def _transformers_greedy(model, tokenizer, n: int) -> list[int]:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def _stream_tokens(llm, n: int) -> list[int]:
    events = list(llm.stream(MESSAGES, max_new_tokens=n, temperature=0.0))
    return [t for ev in events for t in ev.token_ids]


def test_a_model_object_with_its_tokenizer_streams_what_generate_gives(tokenizer) -> None:
    model = _tiny_llama(tokenizer)
    expected = _transformers_greedy(model, tokenizer, 12)
    llm = ms.load_text_model(model, tokenizer=tokenizer)
    try:
        assert llm.model is model and llm.tokenizer is tokenizer
        assert llm.quantization.mode is None  # random fp32 weights: "auto" keeps them as loaded
        assert _stream_tokens(llm, 12) == expected
    finally:
        llm.close()


def test_the_tokenizer_is_found_from_the_models_name_or_path(tokenizer, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _tiny_llama(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    llm = ms.load_text_model(model)
    try:
        assert llm.tokenizer.get_vocab() == tokenizer.get_vocab()
        assert llm.name == str(tmp_path)
        final = llm.generate(MESSAGES, max_new_tokens=4, temperature=0.0)
        assert final.usage["completion_tokens"] >= 1
    finally:
        llm.close()


def test_a_model_that_does_not_say_where_it_came_from_needs_its_tokenizer(tokenizer) -> None:
    with pytest.raises(ms.ModelLoadError, match=r"ms.load_text_model\(model, tokenizer=tokenizer\)"):
        ms.load_text_model(_tiny_llama(tokenizer))


def test_objects_that_are_not_causal_lms_are_refused(tokenizer) -> None:
    with pytest.raises(ms.InvalidArgumentError, match="transformers causal LM object"):
        ms.load_text_model(torch.nn.Linear(2, 2))
    with pytest.raises(ms.InvalidArgumentError, match="tokenizer= must be a transformers tokenizer"):
        ms.load_text_model(_tiny_llama(tokenizer), tokenizer="gpt2")
    with pytest.raises(ms.InvalidArgumentError, match="go to from_pretrained"):
        ms.load_text_model(_tiny_llama(tokenizer), tokenizer=tokenizer, revision="main")


def test_a_tokenizer_given_as_the_second_argument_says_to_name_it(tokenizer) -> None:
    """``load_text_model(model, tok)``, what a ``TextIteratorStreamer`` user writes first, put the
    tokenizer in ``device``'s place: 'unknown device' followed by the tokenizer's repr, pages long."""
    with pytest.raises(ms.InvalidArgumentError, match=r"second argument of load_text_model is device") as info:
        ms.load_text_model(_tiny_llama(tokenizer), tokenizer)
    assert "tokenizer=tokenizer" in str(info.value) and len(str(info.value)) < 300
    with pytest.raises(ms.InvalidArgumentError, match="got an object of type int$"):
        ms.load_text_model(device=3)


def _as_block_values(model) -> None:
    """Round each linear weight to the GGUF block grid (Q4_1; the LM head Q8_0) until it is a fixed
    point, as a model converted from a GGUF file holds its weights."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                cls = Q8Linear if module is head else Q4Linear
                for _ in range(4):
                    module.weight.copy_(cls.dequantize(*cls.quantize_weight(module.weight)))


@pytest.mark.skipif(not NATIVE, reason="the native block kernels did not build here (no C compiler)")
def test_auto_runs_the_native_kernels_on_a_llama_whose_weights_are_block_values(tokenizer) -> None:
    model = _tiny_llama(tokenizer, seed=1)
    _as_block_values(model)
    assert exact_block_states(model) is not None
    reference = _tiny_llama(tokenizer, seed=1)
    reference.load_state_dict(model.state_dict())
    expected = _transformers_greedy(reference, tokenizer, 12)  # fp32, transformers' forward
    llm = ms.load_text_model(model, tokenizer=tokenizer)
    try:
        report = llm.quantization
        assert report.mode == "int4" and report.native_layers == 2 and report.kernels == {"q4": 14, "q8": 1}
        assert _stream_tokens(llm, 12) == expected  # the same weights: fp32's greedy text
    finally:
        llm.close()


def test_auto_keeps_other_weights_and_says_what_int4_would_give(tokenizer, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="multistream"):
        llm = ms.load_text_model(_tiny_llama(tokenizer), tokenizer=tokenizer)
    llm.close()
    assert llm.quantization.mode is None
    assert "quantize='int4' decodes several times faster" in caplog.text


@pytest.mark.model
@pytest.mark.skipif(not NATIVE, reason="the native block kernels did not build here (no C compiler)")
def test_a_local_folder_saved_from_the_embedded_model_gets_the_native_kernels(text_model, tmp_path: Path) -> None:
    """The README's "local Llama folder": the default model saved with save_pretrained and loaded
    back by path computes what the default computes, on the same native layers."""
    from transformers import AutoModelForCausalLM

    from multistream.text._loading import _embedded_model_folder

    folder = _embedded_model_folder()
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path)
    text_model.tokenizer.save_pretrained(tmp_path)
    llm = ms.load_text_model(str(tmp_path))
    try:
        assert llm.quantization.mode == "int4" and llm.quantization.native_layers == 30
        assert llm.quantization.by_kind == text_model.quantization.by_kind
        got = llm.generate(MESSAGES, max_new_tokens=16, temperature=0.0)
        want = text_model.generate(MESSAGES, max_new_tokens=16, temperature=0.0)
        assert got.text == want.text
    finally:
        llm.close()
