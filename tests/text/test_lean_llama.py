"""The embedded model without transformers' modeling code (`multistream.text._accel.lean_llama`).

``ms.load_text_model()`` holds the embedded SmolLM2 in `LeanLlamaForCausalLM`, which skips the
2 s import of ``modeling_llama``; transformers' ``LlamaForCausalLM`` on the same folder, quantized
the same way (``ms.load_text_model(folder)``) is the reference. Every path must give the same
logits bit for bit, the same streams, and the same tokenizer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import multistream as ms
from multistream.text._accel.lean_llama import LeanLlamaForCausalLM, lean_llama_problem
from multistream.text._accel.native_layers import native_layer
from multistream.text._loading import _embedded_model_folder

pytestmark = pytest.mark.model

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France?", "Name three colours."]


@pytest.fixture(scope="module")
def reference():
    """transformers' LlamaForCausalLM on the embedded model's folder, int4 on the native kernels."""
    llm = ms.load_text_model(str(_embedded_model_folder()))
    assert type(llm.model).__name__ == "LlamaForCausalLM" and llm.quantization.mode == "int4"
    yield llm
    llm.close()


def _ids(llm, prompt: str) -> list[int]:
    return llm.encode_prompt([{"role": "user", "content": prompt}])


def test_the_default_model_is_the_lean_llama_on_native_layers(text_model) -> None:
    model = text_model.model
    assert isinstance(model, LeanLlamaForCausalLM)
    assert all(native_layer(layer) is not None for layer in model.model.layers)
    assert text_model.quantization.mode == "int4" and text_model.quantization.native_layers == 30


def test_loading_the_default_imports_no_transformers_modeling_code() -> None:
    """What the start-up saves: transformers' modeling utilities (and torch._dynamo, torch's
    distributed tensors) are never imported by ``load_text_model()`` and a stream."""
    _embedded_model_folder()  # converted from the GGUF file beforehand: a first conversion reads it with transformers
    code = ("import sys, multistream as ms; llm = ms.load_text_model(); "
            "print(llm.generate('Hi', max_new_tokens=2).text is not None); "
            "print(sorted(m for m in ('transformers.modeling_utils', 'transformers.models.llama.modeling_llama', "
            "'torch._dynamo', 'torch.distributed.tensor', 'transformers.masking_utils') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["True", "[]"], out


def test_a_greedy_stream_of_the_default_imports_no_transformers_at_all(text_model) -> None:
    """``load_text_model()`` and a greedy stream (the CLI's default) never import transformers
    (0.6-0.7 s of every start): the engine encodes with `EmbeddedTokenizer`, keeps its keys and
    values in a `KVCache` and reads ``generation_config.json`` itself. ``llm.tokenizer`` is still
    transformers' tokenizer, built at its first read, and a sampled stream gets transformers'
    logits processors."""
    expected = text_model.generate("Hi", max_new_tokens=4).text  # the session's model: the caches exist
    code = ("import sys, multistream as ms; llm = ms.load_text_model(); "
            "print(llm.generate('Hi', max_new_tokens=4).text); print('transformers' in sys.modules); "
            "print(type(llm.tokenizer).__name__, 'transformers' in sys.modules); "
            "print(llm.generate('Hi', max_new_tokens=4, temperature=0.8, seed=1).finish_reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    lines = out.splitlines()
    assert lines[0] == expected, out
    assert lines[1:] == ["False", "TokenizersBackend True", "length"], out


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_a_first_json_schema_or_logprobs_stream_imports_no_transformers(text_model) -> None:
    """A first ``json_schema=`` stream and a first ``logprobs=`` stream (1.4 s of import each, before
    their first token, until 2026-12-07) build llguidance's tokenizer and the logprob table from
    `EmbeddedTokenizer`, and give what the session's model gives."""
    schema_kw = {"json_schema": SCHEMA, "max_new_tokens": 24}
    logprob_kw = {"logprobs": True, "top_logprobs": 2, "max_new_tokens": 6}
    expected_json = text_model.generate("Invent a person.", **schema_kw).text
    expected_logprobs = text_model.generate("Name a colour.", **logprob_kw).logprobs
    code = ("import json, sys, multistream as ms; llm = ms.load_text_model(); "
            f"print(json.dumps(llm.generate('Invent a person.', **{schema_kw!r}).text)); "
            f"print(json.dumps(llm.generate('Name a colour.', **{logprob_kw!r}).logprobs)); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    lines = out.splitlines()
    assert json.loads(lines[0]) == expected_json and json.loads(lines[1]) == expected_logprobs, out
    assert lines[2] == "False", out


def test_grammars_and_logprob_tables_read_the_engine_tokenizer_as_transformers(text_model) -> None:
    """llguidance's tokenizer and the logprob table built from `EmbeddedTokenizer` equal those
    built from transformers' tokenizer: every token's text and bytes, and a JSON grammar's masks
    along an answer."""
    import llguidance
    import llguidance.hf

    from multistream.text._constraints import _ll_tokenizer, grammar_of
    from multistream.text._logprobs import TokenTable

    codec, reference = text_model._codec, text_model.tokenizer
    assert codec.all_special_ids == sorted(reference.all_special_ids)
    ours, theirs = TokenTable(codec), TokenTable(reference)
    assert [ours.info(i) for i in range(len(reference))] == [theirs.info(i) for i in range(len(reference))]
    grammar = grammar_of(None, SCHEMA, None, None, None)
    answer = codec('{"name": "Ada Lovelace", "age": 36}', add_special_tokens=False)["input_ids"]
    matchers = [llguidance.LLMatcher(ll, grammar) for ll in (
        _ll_tokenizer(codec, text_model.vocab_size),
        llguidance.hf.from_tokenizer(reference, n_vocab=text_model.vocab_size))]
    for token in answer:
        masks = [bytes(m.compute_logit_bias()) for m in matchers]
        assert masks[0] == masks[1] and masks[0][token]
        assert all(m.consume_token(token) for m in matchers)


MESSAGES = [
    "Hi",
    [{"role": "user", "content": "Héllo 漢字 🙂\n\ttabs  and  spaces"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "<|im_end|> another?"}],
    [{"role": "user", "content": "What is the weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "18 C and sunny"}],
]
TOOLS = '[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]'


def test_the_engine_tokenizer_encodes_and_decodes_as_transformers(text_model, reference) -> None:
    """`EmbeddedTokenizer` (the engine's, without transformers) gives the ids, text and limits
    that transformers' tokenizer of the same folder gives: chat turns, tool turns and offered
    tools, raw completions, steering instructions, decoding."""
    from multistream.text._embedded_tokenizer import EmbeddedTokenizer

    assert isinstance(text_model._codec, EmbeddedTokenizer)
    assert type(text_model.tokenizer).__name__ == type(reference.tokenizer).__name__ == "TokenizersBackend"
    for prompt in MESSAGES:
        assert text_model.encode_prompt(prompt) == reference.encode_prompt(prompt)
        assert text_model.encode_prompt(prompt, tools=TOOLS) == reference.encode_prompt(prompt, tools=TOOLS)
    for raw in ("Once upon a time", " leading space", "<|im_start|>user", "漢字🙂"):
        assert text_model.encode_prompt(raw, chat=False) == reference.encode_prompt(raw, chat=False)
    for chat in (True, False):
        assert text_model._instruction_tokens("Make it shorter.", chat) == \
            reference._instruction_tokens("Make it shorter.", chat)
    ids = reference.encode_prompt(MESSAGES[2])
    assert text_model._codec.decode(ids) == reference.tokenizer.decode(ids)
    assert text_model._codec.decode(ids, skip_special_tokens=True) == reference.tokenizer.decode(
        ids, skip_special_tokens=True)
    assert (text_model.eos_token_ids, text_model.context_length, text_model.vocab_size) == \
        (reference.eos_token_ids, reference.context_length, reference.vocab_size)
    for name in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "min_p", "eos_token_id"):
        assert getattr(text_model.model.generation_settings, name) == getattr(reference.model.generation_config, name)


def test_a_kv_cache_given_to_the_twin_grows_in_place(text_model, reference) -> None:
    """A forward the native layers do not take (a padded batch without ``row_starts``) on the
    engine's `KVCache`: transformers' twin computes it on a ``DynamicCache`` of the same columns,
    and the `KVCache` holds the new columns after it, as the engine expects of a cache."""
    from transformers import DynamicCache

    rows = [_ids(text_model, p) for p in PROMPTS[:2]]
    width = max(map(len, rows))
    ids = torch.tensor([[r[0]] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = torch.tensor([[0] * (width - len(r)) + list(range(len(r))) for r in rows])
    with torch.no_grad():
        cache = text_model.model.new_cache()
        logits, returned = text_model.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                            cache=cache, use_cache=True, return_dict=False)
        ref_cache = DynamicCache()
        ref = reference.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=ref_cache,
                              use_cache=True)
    assert returned is cache and cache.get_seq_length(0) == width
    assert torch.equal(logits, ref.logits)
    for mine, theirs in zip(cache.layers, ref_cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_prefill_and_decode_logits_equal_transformers_model(text_model, reference) -> None:
    from transformers import DynamicCache

    ids = _ids(text_model, PROMPTS[0])
    with torch.no_grad():
        lean_cache, ref_cache = DynamicCache(), DynamicCache()
        lean = text_model.model(input_ids=torch.tensor([ids]), cache=lean_cache, use_cache=True)
        ref = reference.model(input_ids=torch.tensor([ids]), cache=ref_cache, use_cache=True)
        assert torch.equal(lean.logits, ref.logits)
        token = int(ref.logits[0, -1].argmax())
        for _ in range(6):
            lean = text_model.model(input_ids=torch.tensor([[token]]), cache=lean_cache, use_cache=True)
            ref = reference.model(input_ids=torch.tensor([[token]]), cache=ref_cache, use_cache=True)
            assert torch.equal(lean.logits, ref.logits)
            token = int(ref.logits[0, -1].argmax())


def test_padded_batches_equal_transformers_model_with_and_without_row_starts(text_model, reference) -> None:
    """The engine's padded prefill (``row_starts``) runs natively; a padded batch without them (a user's
    ``model(ids, attention_mask=...)``) goes to the transformers twin: both as transformers computes."""
    rows = [_ids(text_model, p) for p in PROMPTS[:2]]
    width = max(map(len, rows))
    ids = torch.tensor([[r[0]] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = torch.tensor([[0] * (width - len(r)) + list(range(len(r))) for r in rows])
    starts = [width - len(r) for r in rows]
    with torch.no_grad():
        lean = text_model.model(input_ids=ids, attention_mask=mask, position_ids=positions, row_starts=starts)
        ref = reference.model(input_ids=ids, attention_mask=mask, position_ids=positions, row_starts=starts)
        assert torch.equal(lean.logits[:, -1], ref.logits[:, -1])
        lean = text_model.model(input_ids=ids, attention_mask=mask, position_ids=positions)
        ref = reference.model(input_ids=ids, attention_mask=mask, position_ids=positions)
        assert torch.equal(lean.logits[:, -1], ref.logits[:, -1])


def test_generate_goes_to_a_transformers_twin_on_the_same_weights(text_model, reference) -> None:
    ids = torch.tensor([_ids(text_model, PROMPTS[1])])
    with torch.no_grad():
        lean = text_model.model.generate(ids, max_new_tokens=12, do_sample=False)
        ref = reference.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert lean.tolist() == ref.tolist()
    twin = text_model.model.as_transformers()
    assert twin.lm_head is text_model.model.lm_head
    assert twin.model.layers[3].self_attn.qkv_fused is text_model.model.model.layers[3].self_attn.qkv_fused
    assert twin.model.norm.weight is text_model.model.model.norm.weight


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streams_equal_transformers_model(text_model, reference, prompt: str) -> None:
    messages = [{"role": "user", "content": prompt}]
    lean = text_model.generate(messages, max_new_tokens=40, temperature=0.0, logprobs=True)
    ref = reference.generate(messages, max_new_tokens=40, temperature=0.0, logprobs=True)
    assert lean.text == ref.text and lean.token_ids == ref.token_ids


def test_the_tokenizer_is_the_one_auto_tokenizer_gives(text_model) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(_embedded_model_folder())
    assert type(auto) is type(text_model.tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 👋 <b>wörld</b>"}]
    mine = text_model.tokenizer
    assert mine.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    code = "def f(x):\n    return x ** 2  # ünïcode"
    assert mine.encode(code) == auto.encode(code)
    assert (mine.eos_token_id, mine.bos_token_id, mine.pad_token_id) == \
        (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)


def test_other_models_and_settings_keep_transformers_model(tmp_path) -> None:
    """The lean model holds the embedded Llama only where the native layers compute all of it: this
    checks which class loads, not its numbers (every exactness test above runs on the default, int4).
    ``quantize=None`` keeps fp32 weights, which only transformers' layers compute."""
    assert lean_llama_problem(tmp_path) == "no config.json"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_act": "silu"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert lean_llama_problem(tmp_path) == "not a Llama"
    assert lean_llama_problem(_embedded_model_folder()) is None
    exact = ms.load_text_model(quantize=None)
    try:
        assert type(exact.model).__name__ == "LlamaForCausalLM"  # fp32 weights: transformers' own layers
    finally:
        exact.close()


def test_without_the_native_kernels_the_default_is_transformers_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler (the kernels did not build): ATen's int4 layers on transformers' model, as before."""
    monkeypatch.setattr("multistream.text._accel.quantize.native_kernels", lambda: None)
    llm = ms.load_text_model()
    try:
        assert type(llm.model).__name__ == "LlamaForCausalLM" and llm.quantization.mode == "int4"
        assert llm.generate("Say hi", max_new_tokens=4).usage["completion_tokens"] >= 1
    finally:
        llm.close()


def test_a_lean_model_whose_layers_are_not_all_native_is_replaced_by_transformers_model(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    monkeypatch.setattr("multistream.text._accel.quantize.attach_native_layers", lambda model: 0)
    with caplog.at_level(logging.INFO, logger="multistream"):
        llm = ms.load_text_model()
    try:
        assert type(llm.model).__name__ == "LlamaForCausalLM"
        assert any("0 of 30 layers on the native kernels" in r.getMessage() for r in caplog.records)
        assert llm.generate("Say hi", max_new_tokens=4).usage["completion_tokens"] >= 1
    finally:
        llm.close()


def test_the_twin_is_not_a_submodule(text_model) -> None:
    """After ``generate`` built the twin, ``state_dict()`` and ``modules()`` are still the model's own."""
    keys = set(text_model.model.state_dict())
    text_model.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert set(text_model.model.state_dict()) == keys and not any(k.startswith("_twin") for k in keys)
    assert sum(isinstance(m, torch.nn.ModuleList) for m in text_model.model.modules()) == 1


def test_what_the_native_path_does_not_read_goes_to_transformers(text_model, reference) -> None:
    """A mask that lacks the cached columns, positions to keep as a 2-d tensor, ``return_dict=False``:
    transformers' answers, through the twin where the lean forward would read them otherwise."""
    from transformers import DynamicCache

    ids = torch.tensor([_ids(text_model, PROMPTS[2])])
    with torch.no_grad():
        caches = []
        for llm in (text_model, reference):
            cache = DynamicCache()
            llm.model(input_ids=ids[:, :-3], cache=cache)
            caches.append(llm.model(input_ids=ids[:, -3:], cache=cache, attention_mask=torch.ones(1, 3)).logits)
        assert torch.equal(*caches)
        keep = torch.tensor([[0, 5]])
        lean, ref = (llm.model(input_ids=ids, logits_to_keep=keep).logits for llm in (text_model, reference))
        assert lean.shape == ref.shape and torch.equal(lean, ref)
        out = text_model.model(input_ids=ids, return_dict=False)
        assert isinstance(out, tuple) and torch.equal(out[0], reference.model(input_ids=ids).logits)
        full = text_model.model(input_ids=ids)
    assert full.loss is None and full.hidden_states is None
    import pickle

    assert torch.equal(pickle.loads(pickle.dumps(full)).logits, full.logits)


def test_bad_engine_limits_fail_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_load():
        raise AssertionError("the model was read before its options were checked")

    monkeypatch.setattr("multistream.text._loading._embedded_model_folder", no_load)
    with pytest.raises(ms.InvalidArgumentError, match="max_batch must be an integer >= 1, got 0"):
        ms.load_text_model(max_batch=0)
    with pytest.raises(ms.InvalidArgumentError, match="prefill_budget must be an integer >= 1"):
        ms.load_text_model(prefill_budget="big")


def test_warm_up_caches_the_chat_templates_start_and_works_without_a_template(text_model) -> None:
    """`TextModel.warm_up` (the server calls it): the next chat starts from the cached system prompt."""
    text_model.prefix_cache.clear()
    text_model.warm_up()
    final = text_model.generate([{"role": "user", "content": "Name a fruit."}], max_new_tokens=2)
    assert final.metrics["cached_prompt_tokens"] >= 20
    import copy

    from multistream.text._model import TextModel

    raw = copy.copy(text_model.tokenizer)
    raw.chat_template = None  # a base model's tokenizer: the warm-up is a raw prompt
    base = TextModel(text_model.model, raw, name="no-template")
    try:
        base.warm_up()
    finally:
        base.close()
