"""Streaming beam search (``num_beams``): the final text is ``generate(num_beams=k)``'s, events show
the best hypothesis with a ``committed`` prefix that never changes, batch mates stay exact, and the
SSE and OpenAI routes give the same final text (OpenAI: committed text only, so it only appends)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
import websockets

import multistream as ms
from multistream.server import decode_message
from multistream.stream import Stream, StreamWriter
from multistream.text._beams import BeamSearch

from server_fixtures import iter_sse, make_server

PROMPTS = ["Write a haiku about rivers", "What is the capital of France?", "List three fruits."]
MAX_NEW = 32


def reference(llm: Any, prompt: str, k: int, max_new: int = MAX_NEW, **kw: Any) -> str:
    ids = llm.encode_prompt(prompt)
    with torch.no_grad():
        out = llm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 num_beams=k, do_sample=False, max_new_tokens=max_new, **kw)
    return llm.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def check_committed(events: list[Any]) -> str:
    """The protocol's promises for a beam stream; returns the text the events build."""
    text, committed, seen = "", 0, []
    for ev in events:
        assert ev.offset >= committed, f"event {ev.seq} rewrites committed text ({ev.offset} < {committed})"
        assert ev.committed >= committed, "committed decreased"
        settled = text[:committed]
        text = text[: ev.offset] + ev.delta
        assert text.startswith(settled), "committed text changed"
        assert ev.committed <= len(text)
        committed = ev.committed
        seen.append(text[:committed])
    final = events[-1]
    assert final.is_final and final.committed == len(final.text) and text == final.text
    assert all(final.text.startswith(s) for s in seen)
    return text


# -- without a model --------------------------------------------------------------------------------


def test_committed_is_on_the_wire_and_in_the_schema() -> None:
    ev = ms.TextEvent(stream_id="s", seq=1, t=0.1, delta="ab", offset=3, committed=2)
    wire = ev.to_dict()
    assert wire["committed"] == 2
    assert ms.event_from_dict(wire) == ev
    jsonschema.validate(wire, ms.event_json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**wire, "committed": -1}, ms.event_json_schema())


def test_plain_streams_commit_everything_they_send() -> None:
    def producer(writer: StreamWriter) -> None:
        writer.text("Hel", [1], 0)
        writer.text("lo", [2], 1)
        writer.finish_text("", [], 2, finish_reason="stop", text="Hello", usage={"prompt_tokens": 1,
                           "completion_tokens": 2}, metrics={})

    events = list(Stream(producer))
    assert all(e.committed == e.offset + len(e.delta) for e in events)  # merged or not
    assert events[-1].committed == 5


def test_merged_events_keep_the_largest_committed() -> None:
    release = threading.Event()

    def producer(writer: StreamWriter) -> None:
        writer.text("The cat", [1, 2], 0, offset=0, committed=3)   # "The" settled
        release.wait(10)
        # A slow consumer: these three merge into one event.
        writer.text(" dog", [3], 1, offset=3, committed=3)       # better hypothesis: "The dog"
        writer.text(" runs", [4], 2, offset=7, committed=7)      # "The dog" settled
        writer.text(" sat", [5], 2, offset=7, committed=7)       # "The dog sat"
        writer.finish_text("", [], 3, finish_reason="stop", text="The dog sat",
                           usage={"prompt_tokens": 1, "completion_tokens": 3}, metrics={})

    s = Stream(producer)
    first = next(s)
    release.set()
    s._channel.final_queued.wait(10)
    rest = list(s)
    events = [first, *rest]
    assert len(rest) == 2  # the three deltas merged into one, then the final
    assert rest[0].committed == 7 and rest[0].offset == 3
    assert check_committed(events) == "The dog sat"


def test_beam_search_scores_as_transformers_on_random_logits() -> None:
    """A tiny LM with fixed random logits per (prefix length, last token): BeamSearch's answer equals
    a brute-force run of transformers' algorithm through `generate` on the same logits."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=0, pad_token_id=0, bos_token_id=1)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=0, bos_token_id=1)
    prompt = [1, 5, 7]
    for k, lp, es in ((2, 1.0, False), (3, 0.5, True), (4, 2.0, "never")):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 3, dtype=torch.long), num_beams=k,
                             do_sample=False, max_new_tokens=10, length_penalty=lp, early_stopping=es)
        expected = [t for t in out[0, 3:].tolist()]
        beams = BeamSearch(num_beams=k, length_penalty=lp, early_stopping=es, max_new_tokens=10,
                           eos_token_ids=frozenset({0}))
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1:]
            while True:
                source = beams.step(logits)
                assert len(source) == k and all(0 <= s < k for s in source)
                if beams.done:
                    break
                rows = torch.tensor([prompt + b for b in beams.running])
                logits = model(rows).logits[:, -1]
        got = beams.best_with_eos()
        assert got == expected[: len(got)] and all(t == 0 for t in expected[len(got):]), (k, got, expected)


def test_sampling_and_unsupported_options_are_refused_with_beams() -> None:
    from multistream.text import parse_text_options

    with pytest.raises(ms.InvalidArgumentError, match="greedy beam search.*temperature=0.7"):
        parse_text_options(num_beams=4, temperature=0.7)
    with pytest.raises(ms.InvalidArgumentError, match="does not combine with stop"):
        parse_text_options(num_beams=2, stop=["\n"])
    with pytest.raises(ms.InvalidArgumentError, match="num_beams must be an integer from 1"):
        parse_text_options(num_beams=9)
    assert parse_text_options(num_beams=4, temperature=0).num_beams == 4


# -- the real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def beam_runs(text_model: Any) -> dict[tuple[int, str], tuple[str, list[Any]]]:
    runs = {}
    for k in (2, 4):
        for prompt in PROMPTS:
            events = list(text_model.stream(prompt, num_beams=k, max_new_tokens=MAX_NEW))
            runs[(k, prompt)] = (reference(text_model, prompt, k), events)
    return runs


@pytest.mark.model
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_final_text_equals_generate_num_beams(beam_runs: Any, k: int, prompt: str) -> None:
    expected, events = beam_runs[(k, prompt)]
    assert events[-1].text == expected
    assert events[-1].finish_reason in ("stop", "length")


@pytest.mark.model
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_committed_never_decreases_and_committed_text_is_never_rewritten(beam_runs: Any, k: int, prompt: str) -> None:
    _, events = beam_runs[(k, prompt)]
    assert check_committed(events) == events[-1].text
    assert [e.seq for e in events] == list(range(len(events)))
    for ev in events:
        jsonschema.validate(ev.to_dict(), ms.event_json_schema())
        assert ms.event_from_dict(ev.to_dict()) == ev


@pytest.mark.model
def test_some_text_is_committed_before_the_end(beam_runs: Any) -> None:
    early = [max((e.committed for e in events[:-1]), default=0) for _, events in beam_runs.values()]
    assert any(c > 0 for c in early)


@pytest.mark.model
def test_length_penalty_and_early_stopping_as_generate(text_model: Any) -> None:
    prompt = PROMPTS[0]
    for lp, es in ((0.5, True), (2.0, "never")):
        final = text_model.generate(prompt, num_beams=3, max_new_tokens=24, length_penalty=lp, early_stopping=es)
        assert final.text == reference(text_model, prompt, 3, 24, length_penalty=lp, early_stopping=es)


@pytest.mark.model
def test_batch_mates_stay_exact_beside_a_beam_search(text_model: Any) -> None:
    alone = [text_model.generate(p, max_new_tokens=MAX_NEW).text for p in PROMPTS[1:]]
    steps_before = text_model._batcher.steps
    beam = text_model.stream(PROMPTS[0], num_beams=4, max_new_tokens=MAX_NEW)
    mates = [text_model.stream(p, max_new_tokens=MAX_NEW) for p in PROMPTS[1:]]
    beam_events = list(beam)
    finals = [m.wait() for m in mates]
    assert [f.text for f in finals] == alone
    expected, _ = reference(text_model, PROMPTS[0], 4), None
    assert beam_events[-1].text == expected
    check_committed(beam_events)
    # They shared steps: far fewer batched forwards than the streams' tokens one by one.
    tokens = sum(f.usage["completion_tokens"] for f in finals) + beam_events[-1].usage["completion_tokens"]
    assert text_model._batcher.steps - steps_before < tokens


@pytest.mark.model
def test_a_beam_stream_cannot_be_steered_and_can_be_cancelled(text_model: Any) -> None:
    s = text_model.stream(PROMPTS[0], num_beams=2, max_new_tokens=MAX_NEW)
    with pytest.raises(ms.InvalidArgumentError, match="cannot be steered"):
        s.steer("shorter")
    first = next(s)
    s.cancel()
    events = [first, *s]
    assert events[-1].finish_reason in ("cancelled", "stop", "length")
    check_committed(events)


@pytest.mark.model
def test_sse_and_openai_routes_give_the_same_final_text(text_model: Any) -> None:
    prompt = [{"role": "user", "content": PROMPTS[1]}]
    with make_server(text_model) as srv:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", srv.url + "/v1/text",
                               json={"prompt": prompt, "num_beams": 4, "max_new_tokens": MAX_NEW}) as r:
                assert r.status_code == 200
                stream_id, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
                events = [ms.event_from_dict(json.loads(e["data"])) for e in iter_sse(r) if "comment" not in e]
            # Resuming replays the same events, `committed` included.
            with client.stream("GET", f"{srv.url}/v1/streams/{stream_id}/events?after=-1",
                               headers={"X-Resume-Token": token}) as r:
                replay = [ms.event_from_dict(json.loads(e["data"])) for e in iter_sse(r) if "comment" not in e]
            assert replay == events
        sse_text = check_committed(events)
        assert any(e.committed < e.offset + len(e.delta) for e in events[:-1])  # some text was provisional

        async def over_websocket() -> list[Any]:
            async with websockets.connect(srv.ws_url + "/v1/ws", open_timeout=30) as ws:
                await ws.send(json.dumps({"type": "text", "id": "b", "prompt": prompt, "num_beams": 4,
                                          "max_new_tokens": MAX_NEW}))
                got: list[Any] = []
                while not (got and got[-1].is_final):
                    msg = decode_message(await asyncio.wait_for(ws.recv(), 120))
                    if not isinstance(msg, dict):
                        got.append(msg)
                return got

        ws_events = asyncio.run(over_websocket())
        assert check_committed(ws_events) == sse_text
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = list(sdk.chat.completions.create(model="default", messages=prompt, stream=True, max_tokens=MAX_NEW,
                                                  extra_body={"num_beams": 4}))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        whole = sdk.chat.completions.create(model="default", messages=prompt, max_tokens=MAX_NEW,
                                            extra_body={"num_beams": 4})
        with pytest.raises(openai.BadRequestError, match="temperature"):
            sdk.chat.completions.create(model="default", messages=prompt, max_tokens=4, temperature=0.9,
                                        extra_body={"num_beams": 4})
    assert sse_text == "".join(pieces) == whole.choices[0].message.content == reference(text_model, PROMPTS[1], 4)


@pytest.mark.model
def test_more_beams_than_rows_is_refused(text_model: Any) -> None:
    from multistream.text import TextModel

    small = TextModel(text_model.model, text_model.tokenizer, max_batch=2)
    try:
        with pytest.raises(ms.InvalidArgumentError, match="max_batch=2"):
            small.stream("hi", num_beams=4)
        assert small.generate("hi", num_beams=2, max_new_tokens=6).text == reference(text_model, "hi", 2, 6)
    finally:
        small.close()
