"""The text adapter on the real embedded model (SmolLM2-135M-Instruct), plus its argument checks."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

import multistream as ms

pytestmark = pytest.mark.model

CJK = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
EMOJI = re.compile(r"[\U0001F300-\U0001FAFF]")


def check_stream(events, tokenizer=None):
    assert [e.seq for e in events] == list(range(len(events)))
    assert [e.is_final for e in events].count(True) == 1 and events[-1].is_final
    final = events[-1]
    assert final.type == "text", getattr(final, "error", None)
    assert "".join(e.delta for e in events) == final.text
    assert all(e.delta for e in events[:-1]), "empty non-final delta"
    assert all("\ufffd" not in e.delta for e in events[:-1]), "half-decoded character"
    ids = [t for e in events for t in e.token_ids]
    if tokenizer is not None and final.finish_reason in ("stop", "length"):
        assert tokenizer.decode(ids, skip_special_tokens=True) == final.text
    # usage counts every generated token, EOS included (as model.generate does); EOS is not text.
    assert final.usage["completion_tokens"] == len(ids) + (final.finish_reason == "stop")
    timing = {"ttft_ms", "itl_ms_p50", "itl_ms_p95", "duration_ms", "tokens_per_s"}
    # A detected repetition loop is flagged with three more (generation health).
    # Lookahead counts its steps and, when on, its drafted and accepted tokens.
    assert timing | {"decode_steps"} <= set(final.metrics) <= timing | {
        "repetition_loops", "repetition_period", "repetition_start", "decode_steps", "drafted_tokens", "accepted_tokens",
        "cached_prompt_tokens"}  # a prompt that began like an earlier one (the prefix cache)
    return final


@pytest.mark.parametrize(
    "prompt, kwargs, pattern",
    [
        ('Translate "good morning, my friend" into Chinese.', {}, CJK),
        ('How do you say "thank you" in Japanese?', {}, CJK),
        ("Emoji list: 🌊 🐟 🐙 🦀", {"chat": False}, EMOJI),
        ("List five animal emoji.", {}, EMOJI),
        ("Write a Python function that reverses a string.", {}, re.compile(r"def |return")),
    ],
)
def test_exact_streaming_for_scripts_emoji_and_code(text_model, prompt, kwargs, pattern):
    events = list(text_model.stream(prompt, max_new_tokens=40, **kwargs))
    final = check_stream(events, text_model.tokenizer)
    assert pattern.search(final.text), final.text


def test_chat_messages_and_usage(text_model):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    events = list(text_model.stream(messages, max_new_tokens=16))
    final = check_stream(events, text_model.tokenizer)
    assert final.finish_reason in ("stop", "length")
    assert final.usage["prompt_tokens"] == len(text_model.encode_prompt(messages))


def test_greedy_is_deterministic_and_matches_transformers_generate(text_model):
    import torch

    prompt = "Write a haiku about rivers"
    a = text_model.generate(prompt, max_new_tokens=24)
    b = text_model.generate(prompt, max_new_tokens=24)
    assert a.text == b.text
    ids = torch.tensor([text_model.encode_prompt(prompt)])
    out = text_model.model.generate(ids, max_new_tokens=24, do_sample=False)
    reference = text_model.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert a.text == reference


def test_seed_makes_sampling_reproducible(text_model):
    kw = dict(max_new_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    assert text_model.generate("Tell me a story", **kw).text == text_model.generate("Tell me a story", **kw).text
    texts = {text_model.generate("Tell me a story", **(kw | {"seed": s})).text for s in range(4)}
    assert len(texts) > 1


def test_kv_cache_is_used(text_model, monkeypatch):
    lengths = []
    forward = text_model.model.forward

    def spy(*args, **kwargs):
        lengths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    monkeypatch.setattr(text_model.model, "forward", spy)
    final = text_model.generate("Count from one to ten.", max_new_tokens=12)
    # The prompt's first forward runs what the prefix cache did not hold (the chat template's start
    # is cached after the suite's first prompt), and no token is run twice.
    prompt_len = final.usage["prompt_tokens"]
    assert lengths[0] == prompt_len - final.metrics.get("cached_prompt_tokens", 0)
    assert lengths[1:] == [1] * (len(lengths) - 1), "the prompt was run again"


def test_stop_string_split_across_tokens_is_never_emitted(text_model):
    prompt = "Write a haiku about rivers"
    free = text_model.generate(prompt, max_new_tokens=30).text
    # A stop string that starts mid-token and spans several tokens of the greedy output.
    start = free.index(" of ") + 2
    stop = free[start : start + 7]
    ids = text_model.tokenizer(stop, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2, stop
    events = list(text_model.stream(prompt, max_new_tokens=30, stop=[stop, "zzzz"]))
    final = check_stream(events)
    assert final.finish_reason == "stop_sequence"
    assert final.text == free[: free.index(stop)]
    assert stop[:2] not in "".join(e.delta for e in events)[len(final.text) - 1 :]


def test_chunk_tokens_groups_tokens(text_model):
    events = list(text_model.stream("Write a haiku about rivers", max_new_tokens=24, chunk_tokens=4))
    final = check_stream(events, text_model.tokenizer)
    assert all(len(e.token_ids) >= 4 for e in events[:-1])
    assert len(events) <= final.usage["completion_tokens"] // 4 + 2


def test_cancel_mid_stream(text_model):
    stream = text_model.stream("Write a long story about the sea.", max_new_tokens=200)
    events = []
    for ev in stream:
        events.append(ev)
        if len(events) == 3:
            stream.cancel()
    final = check_stream(events, text_model.tokenizer)
    assert final.finish_reason == "cancelled"
    assert final.usage["completion_tokens"] <= 6  # stopped within a step or two of the request


def test_exception_inside_the_model_becomes_an_error_event(text_model, monkeypatch):
    forward = text_model.model.forward
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("CUDA out of memory (simulated)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(text_model.model, "forward", failing)
    stream = text_model.stream("Hello", max_new_tokens=20)
    events = list(stream)
    assert events[-1].type == "error" and events[-1].is_final
    assert events[-1].error == {"type": "RuntimeError", "message": "CUDA out of memory (simulated)"}
    assert [e.seq for e in events] == list(range(len(events)))


async def test_async_iteration_on_the_real_model(text_model):
    events = [ev async for ev in text_model.stream("Say hello", max_new_tokens=10)]
    check_stream(events, text_model.tokenizer)


def test_slow_consumer_gets_merged_deltas(text_model):
    stream = text_model.stream("Write a haiku about rivers", max_new_tokens=32)
    events = []
    for ev in stream:
        events.append(ev)
        if len(events) == 1:
            stream.join(60)  # the model finishes while the consumer is busy: it never waits
    final = check_stream(events, text_model.tokenizer)
    assert len(events) <= 3 < final.usage["completion_tokens"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": -5}, "max_new_tokens must be an integer >= 1"),
        ({"temprature": 0.5}, "Did you mean 'temperature'"),
        ({"beams": 4}, "unknown argument 'beams'"),
        ({"temperature": -1}, "temperature must be"),
        ({"top_p": 0}, "top_p must be in"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"stop": 5}, "stop must be a string"),
        ({"seed": "x"}, "seed must be an integer"),
    ],
)
def test_bad_arguments_raise_at_call_time(text_model, kwargs, message):
    with pytest.raises(ms.InvalidArgumentError, match=re.escape(message)):
        text_model.stream("hi", **kwargs)


@pytest.mark.parametrize("prompt", [[], [{"role": "user"}], [{"content": "x"}], 42])
def test_bad_prompts_raise_at_call_time(text_model, prompt):
    with pytest.raises(ms.InvalidArgumentError):
        text_model.stream(prompt)


def test_prompt_longer_than_the_context(text_model):
    with pytest.raises(ms.PromptTooLongError, match="context of 8192 tokens"):
        text_model.stream("hello " * 9000)


def test_hub_id_without_network_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ms.ModelLoadError, match="pass the local folder"):
        ms.load_text_model("someone/not-a-cached-model")
    assert time.perf_counter() - started < 60


def test_embedded_model_is_cached_as_safetensors(text_model, tmp_path):
    from multistream.text._loading import _embedded_model_folder

    folder = _embedded_model_folder()
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert text_model.name == "SmolLM2-135M-Instruct"


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    from multistream._cache import cache_dir

    monkeypatch.setenv("MULTISTREAM_CACHE", str(tmp_path / "ms"))
    assert cache_dir() == tmp_path / "ms"
    monkeypatch.delenv("MULTISTREAM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "multistream"


def test_cli_streams_ndjson_and_summary():
    proc = subprocess.run(
        [sys.executable, "-m", "multistream", "text", "Say hello", "--max-new-tokens", "8", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    events = [ms.event_from_json(line) for line in proc.stdout.splitlines()]
    check_stream(events)
    plain = subprocess.run(
        [sys.executable, "-m", "multistream", "text", "Say hello", "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert plain.returncode == 0 and plain.stdout.strip()
    assert re.search(r"\[\d+ tokens, TTFT \d+ ms, [\d.]+ tokens/s, finish: \w+\]", plain.stderr)


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "multistream", "--help"], capture_output=True, text=True).stdout
    assert "text" in out
    bad = subprocess.run([sys.executable, "-m", "multistream", "text", "hi", "--max-new-tokens", "0"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "max_new_tokens must be" in bad.stderr
