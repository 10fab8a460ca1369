"""Composed streams: chain() and merge() keep the protocol (own id, gap-free seq, one final last)."""

from __future__ import annotations

import time

import pytest

import multistream as ms
from multistream.events import ErrorEvent, ImageEvent, TextEvent
from multistream.testing import ScriptedImageModel, ScriptedTextModel


def _check_protocol(events: list, stream: ms.Stream) -> None:
    assert [e.seq for e in events] == list(range(len(events)))
    assert all(e.stream_id == stream.stream_id for e in events)
    assert [e.is_final for e in events].count(True) == 1 and events[-1].is_final
    assert stream.final is events[-1]


def test_chain_text_then_image_is_one_stream() -> None:
    llm, sd = ScriptedTextModel(["a red", " circle"]), ScriptedImageModel(steps=4, size=16)
    seen_prompts = []

    def draw(final: TextEvent) -> ms.Stream:
        seen_prompts.append(final.text)
        return sd.stream(final.text, steps=4)

    first = llm.stream("x")
    s = ms.chain(first, draw)
    events = list(s)
    assert s.stream_id != first.stream_id
    _check_protocol(events, s)
    assert s.kind == "mixed"
    assert seen_prompts == ["a red circle"]
    texts = [e for e in events if isinstance(e, TextEvent)]
    # The LLM's final became an ordinary event that still carries text, usage and metrics.
    assert texts[-1].finish_reason == "stop" and not texts[-1].is_final and texts[-1].text == "a red circle"
    assert "".join(e.delta for e in texts) == "a red circle"
    images = [e for e in events if isinstance(e, ImageEvent)]
    steps = [e.step for e in images[:-1]]  # previews may be coalesced, never reordered
    assert steps and steps == sorted(set(steps)) and set(steps) <= {1, 2, 3, 4} and images[-1].is_final
    assert events.index(texts[-1]) < events.index(images[0])  # parts stay in order


def test_chain_accepts_factories_and_none_ends_early() -> None:
    llm = ScriptedTextModel(["hi"])
    s = ms.chain(lambda: llm.stream("x"), lambda final: None)
    events = list(s)
    _check_protocol(events, s)
    assert events[-1].text == "hi" and events[-1].finish_reason == "stop"


def test_chain_cancel_reaches_the_running_part() -> None:
    llm, sd = ScriptedTextModel(["go"]), ScriptedImageModel(steps=500, delay_s=0.01)
    s = ms.chain(llm.stream("x"), lambda final: sd.stream("a red circle", steps=500))
    for ev in s:
        if isinstance(ev, ImageEvent):
            s.cancel()
    assert s.final.finish_reason == "cancelled" and s.final.is_final
    deadline = time.monotonic() + 10
    while sd.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sd.active == 0 and sd.finish_reasons == ["cancelled"]


def test_chain_breaking_out_cancels_sub_streams() -> None:
    llm = ScriptedTextModel(delay_s=0.01)
    for _ in ms.chain(llm.stream("x", max_new_tokens=10_000), lambda f: None):
        break  # nothing else holds the chain: leaving the loop drops it, which cancels it
    deadline = time.monotonic() + 10
    while llm.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.finish_reasons == ["cancelled"]


def test_chain_error_in_a_part_ends_with_error() -> None:
    llm = ScriptedTextModel(["a", "b", "c"], fail_after=1)
    sd = ScriptedImageModel(steps=2)
    s = ms.chain(llm.stream("x"), lambda f: sd.stream("never"))
    events = list(s)
    _check_protocol(events, s)
    assert isinstance(events[-1], ErrorEvent) and "scripted failure" in events[-1].error["message"]
    assert sd.calls == []


def test_chain_error_in_step_function_ends_with_error() -> None:
    llm = ScriptedTextModel(["a"])
    sd = ScriptedImageModel(steps=2)
    s = ms.chain(llm.stream("x"), lambda f: sd.stream("p", steps=0))
    events = list(s)
    _check_protocol(events, s)
    assert isinstance(events[-1], ErrorEvent) and events[-1].error["type"] == "InvalidArgumentError"


def test_chain_bad_arguments_raise_at_call_time() -> None:
    with pytest.raises(ms.InvalidArgumentError, match="callable"):
        ms.chain(42)  # type: ignore[arg-type]
    with pytest.raises(ms.InvalidArgumentError, match="argument 2"):
        ms.chain(ScriptedTextModel().stream("x"), "not callable")  # type: ignore[arg-type]


async def test_chain_async_iteration() -> None:
    llm, sd = ScriptedTextModel(["x"]), ScriptedImageModel(steps=2, size=16)
    s = ms.chain(llm.stream("x"), lambda f: sd.stream("p", steps=2))
    events = [ev async for ev in s]
    _check_protocol(events, s)


def test_merge_interleaves_text_and_image() -> None:
    llm = ScriptedTextModel(delay_s=0.005)
    sd = ScriptedImageModel(steps=6, size=16, delay_s=0.005)
    s = ms.merge(llm.stream("x"), sd.stream("p", steps=6))
    events = list(s)
    _check_protocol(events, s)
    texts = [e for e in events if isinstance(e, TextEvent)]
    assert "".join(e.delta for e in texts) == texts[-1].text and texts[-1].finish_reason == "stop"
    assert sum(1 for e in events if getattr(e, "finish_reason", None)) == 2


def test_merge_keeps_images_apart() -> None:
    a, b = ScriptedImageModel(steps=3, size=16), ScriptedImageModel(steps=3, size=16)
    s = ms.merge(a.stream("p"), b.stream("q"))
    events = list(s)
    _check_protocol(events, s)
    finals = [e for e in events if e.finish_reason]
    assert sorted(e.index for e in finals) == [0, 1]


def test_merge_cancel_and_error() -> None:
    llm = ScriptedTextModel(delay_s=0.01)
    sd = ScriptedImageModel(steps=1000, delay_s=0.01)
    s = ms.merge(llm.stream("x", max_new_tokens=10_000), sd.stream("p", steps=1000))
    it = iter(s)
    next(it)
    s.cancel()
    events = list(it)
    assert events[-1].is_final and events[-1].finish_reason == "cancelled"
    deadline = time.monotonic() + 10
    while (llm.active or sd.active) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.active == 0 and sd.active == 0

    bad = ScriptedTextModel(["a", "b"], fail_after=1)
    slow = ScriptedImageModel(steps=1000, delay_s=0.01)
    s = ms.merge(bad.stream("x"), slow.stream("p", steps=1000))
    events = list(s)
    _check_protocol(events, s)
    assert isinstance(events[-1], ErrorEvent)
    deadline = time.monotonic() + 10
    while slow.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slow.finish_reasons == ["cancelled"]


def test_merge_rejects_two_text_streams_and_nothing() -> None:
    llm = ScriptedTextModel()
    with pytest.raises(ms.InvalidArgumentError, match="at most one text stream"):
        ms.merge(llm.stream("a"), llm.stream("b"))
    with pytest.raises(ms.InvalidArgumentError, match="at least one"):
        ms.merge()


def test_chained_text_parts_keep_deltas_equal_to_the_final_text():
    from multistream.testing import ScriptedTextModel

    a, b = ScriptedTextModel(["Hello", " world"]), ScriptedTextModel([" Bye"])
    events = list(ms.chain(a.stream("x"), lambda final: b.stream(final.text)))
    assert events[-1].is_final and events[-1].text == "Hello world Bye"
    assert "".join(e.delta for e in events) == events[-1].text


def test_chain_text_then_video_films_what_the_llm_wrote() -> None:
    from multistream.events import VideoEvent
    from multistream.testing import ScriptedVideoModel

    llm, vm = ScriptedTextModel(["a red circle", " moving left"]), ScriptedVideoModel(steps=3, num_frames=4, size=16)
    s = ms.chain(llm.stream("x"), lambda final: vm.stream(final.text))
    events = list(s)
    _check_protocol(events, s)
    assert vm.calls[0]["prompt"] == "a red circle moving left"
    kinds = [e.type for e in events]
    assert kinds.index("video") > max(i for i, k in enumerate(kinds) if k == "text")  # written, then filmed
    assert isinstance(events[-1], VideoEvent) and events[-1].mime == "video/webm" and len(events[-1].frames) == 4


def test_chain_cancelled_as_the_clip_starts_ends_cancelled() -> None:
    from multistream.testing import ScriptedVideoModel

    vm = ScriptedVideoModel(steps=200, num_frames=4, size=16, delay_s=0.01)
    s = ms.chain(ScriptedTextModel(["a red circle"]).stream("x"), lambda final: vm.stream(final.text))
    for ev in s:
        if ev.type == "video":
            s.cancel()
    assert s.final.finish_reason == "cancelled"  # type: ignore[union-attr]
    assert vm.finish_reasons == ["cancelled"]


def test_merge_keeps_clips_apart_from_each_other_and_from_images() -> None:
    from multistream.testing import ScriptedVideoModel

    vm, sd = ScriptedVideoModel(steps=2, num_frames=4, size=16), ScriptedImageModel(steps=2, size=16)
    s = ms.merge(vm.stream("a red circle"), vm.stream("a blue circle"), sd.stream("x"))
    events = list(s)
    _check_protocol(events, s)
    assert {e.index for e in events if e.type == "video"} == {0, 1}
    assert {e.index for e in events if e.type == "image"} == {0}
    assert sum(1 for e in events if e.type == "video" and e.finish_reason == "stop") == 2
