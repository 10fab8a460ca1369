"""One contract, two models: the scripted fake in `multistream.testing` and the real default text
model (SmolLM2-135M) pass the same assertions, so a test written on the fake holds on the model.

What both promise: a stream's events (kinds, seq, the one final event last, its fields, deltas
that rebuild the text), options honoured (``max_new_tokens``, ``chunk_tokens``, ``stop``,
``top_logprobs``), ``revise`` keeping the original request's options unless told otherwise,
``rewind`` on a running stream, and the same refusals. Where they differ on purpose (the fake has
no tokenizer: it keeps exactly ``offset`` characters where the model snaps back to a token
boundary; the text itself) the assertions take the weaker common form.
"""

from __future__ import annotations

from typing import Any

import pytest

import multistream as ms
from multistream.testing import ScriptedTextModel

PROMPT = [{"role": "user", "content": "Write a long story about a river."}]
METRICS = {"ttft_ms", "itl_ms_p50", "itl_ms_p95", "duration_ms", "tokens_per_s"}


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.model)])
def llm(request: pytest.FixtureRequest) -> Any:
    if request.param == "fake":
        # A script longer than any budget below, so every run ends by length; a small delay lets a
        # consumer act (rewind) while the stream runs, as it can on the real model.
        return ScriptedTextModel([f" word{i}" for i in range(200)], delay_s=0.005)
    return request.getfixturevalue("text_model")  # the session's default model (tests/conftest.py)


def _apply(events: list[Any]) -> str:
    text = ""
    for ev in events:
        text = text[: ev.offset] + ev.delta
    return text


def _check_stream(events: list[Any]) -> Any:
    """The protocol every text stream keeps; returns the final event."""
    assert events and all(ev.type == "text" for ev in events)
    assert [ev.seq for ev in events] == list(range(len(events)))
    assert [ev.is_final for ev in events] == [False] * (len(events) - 1) + [True]
    assert len({ev.stream_id for ev in events}) == 1
    assert all(b.t >= a.t for a, b in zip(events, events[1:]))
    assert all(b.revision >= a.revision for a, b in zip(events, events[1:]))
    final = events[-1]
    assert final.finish_reason in ("stop", "length", "stop_sequence", "cancelled", "finished_early", "repetition")
    assert _apply(events) == final.text
    assert set(final.usage) >= {"prompt_tokens", "completion_tokens"} and final.usage["prompt_tokens"] >= 1
    assert set(final.metrics) >= METRICS
    return final


def test_stream_events_and_final_fields(llm: Any) -> None:
    events = list(llm.stream(PROMPT, max_new_tokens=8, seed=0))
    final = _check_stream(events)
    assert final.finish_reason == "length" and final.usage["completion_tokens"] == 8
    assert [ev.revision for ev in events] == [0] * len(events) and final.revisions is None
    # Without edits the deltas are the plain concatenation, token positions run on without gaps.
    assert "".join(ev.delta for ev in events) == final.text
    assert [ev.offset for ev in events] == [len("".join(e.delta for e in events[:i])) for i in range(len(events))]
    index = 0
    for ev in events:
        assert ev.index == index
        index += len(ev.token_ids)
    assert index == 8
    assert all(ev.logprobs is None for ev in events)
    # generate() is the same stream, run to its end.
    again = llm.generate(PROMPT, max_new_tokens=8, seed=0)
    assert again.is_final and again.finish_reason == "length" and again.usage["completion_tokens"] == 8


def test_chunk_tokens_and_logprobs(llm: Any) -> None:
    events = list(llm.stream(PROMPT, max_new_tokens=6, chunk_tokens=3, top_logprobs=2, seed=0))
    final = _check_stream(events)
    assert final.usage["completion_tokens"] == 6
    assert all(len(ev.token_ids) % 3 == 0 for ev in events)  # merged under backpressure, never split
    for ev in events:
        assert ev.logprobs is not None and len(ev.logprobs) == len(ev.token_ids)
        assert [e["token_id"] for e in ev.logprobs] == ev.token_ids
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in ev.logprobs)


def test_a_stop_string_ends_the_stream_and_never_shows(llm: Any) -> None:
    plain = llm.generate(PROMPT, max_new_tokens=12, seed=0).text
    stop = plain[len(plain) // 2:][:3]  # three characters from the middle of the answer
    assert stop.strip()
    events = list(llm.stream(PROMPT, max_new_tokens=12, seed=0, stop=[stop]))
    final = _check_stream(events)
    assert final.finish_reason == "stop_sequence" and stop not in final.text
    assert plain.startswith(final.text)


def test_revise_keeps_the_original_options(llm: Any) -> None:
    final = llm.generate(PROMPT, max_new_tokens=10, chunk_tokens=2, top_logprobs=1, seed=0)
    offset = len(final.text) // 2
    events = list(llm.revise(final, offset))
    revised = _check_stream(events)
    kept = events[0]
    assert kept.offset == 0 and kept.revision == 0 and final.text.startswith(kept.delta) and len(kept.delta) <= offset
    assert revised.text.startswith(kept.delta)
    # max_new_tokens (10) counts the kept tokens too; logprobs and chunking go on as first asked.
    assert revised.finish_reason == "length" and revised.usage["completion_tokens"] == 10
    assert revised.usage["prompt_tokens"] == final.usage["prompt_tokens"]
    assert all(ev.logprobs is not None and len(ev.logprobs) == len(ev.token_ids) for ev in events)
    assert all(len(ev.token_ids) % 2 == 0 for ev in events[1:-1])
    assert sum(len(ev.token_ids) for ev in events) == 10
    assert revised.revisions and revised.revisions[0]["offset"] <= offset


def test_revise_options_override_the_original_ones(llm: Any) -> None:
    final = llm.generate(PROMPT, max_new_tokens=10, top_logprobs=1, seed=0)
    events = list(llm.revise(final, len(final.text) // 2, max_new_tokens=14, top_logprobs=0))
    revised = _check_stream(events)
    assert revised.finish_reason == "length" and revised.usage["completion_tokens"] == 14
    assert all(ev.logprobs is None for ev in events)
    with pytest.raises(ms.InvalidArgumentError):
        llm.revise(final, len(final.text) + 1)
    with pytest.raises(ms.InvalidArgumentError):
        llm.revise(final, 1, max_new_tokens=0)
    with pytest.raises(ms.InvalidArgumentError):
        llm.revise(final, 1, no_such_option=1)


def test_rewind_a_running_stream(llm: Any) -> None:
    s = llm.stream(PROMPT, max_new_tokens=40, seed=0)
    events = []
    for ev in s:
        events.append(ev)
        if len(events) == 3:
            s.rewind(0)
    final = _check_stream(events)
    assert final.revisions and final.revisions[0]["kind"] == "rewind" and final.revisions[0]["offset"] == 0
    assert events[-1].revision == 1 and events[0].revision == 0
    assert final.finish_reason == "length"


def test_the_same_refusals(llm: Any) -> None:
    for bad in ({"max_new_tokens": 0}, {"temperature": -1}, {"top_logprobs": 21}, {"no_such_option": 1}):
        with pytest.raises(ms.InvalidArgumentError):
            llm.stream(PROMPT, **bad)
    s = llm.stream(PROMPT, max_new_tokens=40)
    s.cancel()
    assert s.wait().finish_reason == "cancelled"
