"""The scripted fakes in multistream.testing behave like the real models' streams."""

from __future__ import annotations

import time

import pytest

from multistream import InvalidArgumentError, PromptTooLongError
from multistream.testing import DEFAULT_TOKENS, ScriptedImageModel, ScriptedTextModel


def test_text_script_length_stop_and_chunks() -> None:
    llm = ScriptedTextModel(["a", "b", "c"])
    final = llm.generate("hi", max_new_tokens=2)
    assert (final.text, final.finish_reason, final.usage) == ("ab", "length", {"prompt_tokens": 1, "completion_tokens": 2})
    events = list(llm.stream("hi"))
    assert "".join(e.delta for e in events) == events[-1].text == "abc" and events[-1].finish_reason == "stop"
    assert [e.seq for e in events] == list(range(len(events)))
    assert set(events[-1].metrics) == {"ttft_ms", "itl_ms_p50", "itl_ms_p95", "duration_ms", "tokens_per_s"}
    chunked = [e.delta for e in ScriptedTextModel(["a", "b", "c", "d"], delay_s=0.01).stream("x", chunk_tokens=2)]
    assert chunked[:2] == ["ab", "cd"]
    assert ScriptedTextModel().generate("x").text == "".join(DEFAULT_TOKENS)


def test_text_stop_strings_never_leak() -> None:
    llm = ScriptedTextModel(["He", "llo", " wo", "rld", "!"])
    events = list(llm.stream("x", stop=" wor"))
    assert events[-1].finish_reason == "stop_sequence" and events[-1].text == "Hello"
    assert "".join(e.delta for e in events) == "Hello"


def test_text_cancel_within_one_step_and_counters() -> None:
    llm = ScriptedTextModel(delay_s=0.05)
    stream = llm.stream("x", max_new_tokens=100)
    it = iter(stream)
    next(it)
    stream.cancel()
    rest = list(it)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].is_final
    deadline = time.monotonic() + 10
    while llm.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.active == 0 and llm.finish_reasons == ["cancelled"]


def test_text_streams_share_one_thread_as_the_engines_rows_do() -> None:
    """Many scripted text streams run on one thread (a thread each put 200 waking threads against
    a server's event loop for the GIL: the SSE benchmark measured the fake), each to its end, and
    a cancel still ends one at once, even in the middle of a long wait."""
    import threading

    llm = ScriptedTextModel([f" t{i}" for i in range(8)], delay_s=0.01)
    before = threading.active_count()
    streams = [llm.stream("hi") for _ in range(50)]
    assert threading.active_count() <= before + 1  # the clock thread, started once per process
    finals = [s.wait() for s in streams]
    assert all(f.text == "".join(f" t{i}" for i in range(8)) and f.finish_reason == "stop" for f in finals)
    slow = ScriptedTextModel(["a"] * 5, delay_s=30.0).stream("hi")
    time.sleep(0.05)  # now inside its 30 s wait
    t0 = time.perf_counter()
    slow.cancel()
    assert slow.wait().finish_reason == "cancelled" and time.perf_counter() - t0 < 2


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"max_new_tokens": "3"}, {"temperature": -1},
                                    {"top_p": 0}, {"top_k": -1}, {"stop": [""]}, {"chunk_tokens": 0}, {"bogus": 1}])
def test_text_validation(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        ScriptedTextModel().stream("hi", **kwargs)


def test_text_prompt_checks_and_failure() -> None:
    with pytest.raises(InvalidArgumentError):
        ScriptedTextModel().stream(42)  # type: ignore[arg-type]
    with pytest.raises(PromptTooLongError):
        ScriptedTextModel(context_length=4).stream("one two three four five")
    final = ScriptedTextModel(fail_after=1).stream([{"role": "user", "content": "hi"}]).wait()
    assert final.type == "error" and "scripted failure" in final.error["message"]


def test_image_previews_then_final() -> None:
    sd = ScriptedImageModel(steps=4, size=32, delay_s=0.05)
    events = list(sd.stream("a red circle", seed=3))
    steps = [e.step for e in events[:-1]]
    assert steps == sorted(set(steps)) and steps[-1] == 4 and len(steps) >= 2  # a slow reader may skip some
    assert all(e.mime == "image/jpeg" and not e.is_final for e in events[:-1])
    final = events[-1]
    assert final.is_final and final.finish_reason == "stop" and final.mime == "image/png" and final.image.size == (32, 32)
    assert events[0].data != events[-2].data  # the preview changes with the steps


def test_image_options_batch_and_cancel() -> None:
    sd = ScriptedImageModel(steps=3, size=16)
    final = sd.generate("x", preview="none", final_format="jpeg", width=24)
    assert final.mime == "image/jpeg" and final.image.size == (24, 16)
    events = list(sd.stream("x", num_images=2, preview="none"))
    assert [(e.index, e.is_final, e.finish_reason) for e in events] == [(0, False, "stop"), (1, True, "stop")]
    small = list(ScriptedImageModel(steps=2, size=64, delay_s=0.01).stream("x", preview_max_side=32))
    assert small[0].image.size == (32, 32) and small[-1].image.size == (64, 64)
    slow = ScriptedImageModel(steps=100, size=16, delay_s=0.05)
    stream = slow.stream("x")
    it = iter(stream)
    next(it)
    stream.cancel()
    assert list(it)[-1].finish_reason == "cancelled"


@pytest.mark.parametrize("kwargs", [{"steps": 0}, {"height": 12}, {"preview": "sharp"}, {"num_images": 0},
                                    {"preview_quality": 0}, {"final_format": "gif"}, {"strength": 0.5}])
def test_image_validation(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        ScriptedImageModel().stream("p", **kwargs)


# -- edits: priority, finish_early, steer, rewind, revise -------------------------------------


def _apply(events) -> str:
    text = ""
    for e in events:
        text = text[: e.offset] + e.delta
    return text


def test_text_priority_is_checked_and_recorded() -> None:
    llm = ScriptedTextModel(["a"])
    assert llm.generate("x", priority=5).text == "a" and llm.calls[-1]["priority"] == 5
    with pytest.raises(InvalidArgumentError, match="priority"):
        llm.stream("x", priority="high")


def test_text_finish_early() -> None:
    llm = ScriptedTextModel(list("abcdefgh"), delay_s=0.02)
    s = llm.stream("x")
    seen = []
    for ev in s:
        seen.append(ev)
        if len(seen) == 2:
            s.finish_early()
    assert seen[-1].finish_reason == "finished_early" and len(seen[-1].text) < 8
    assert _apply(seen) == seen[-1].text


def test_text_rewind_cuts_and_continues() -> None:
    llm = ScriptedTextModel(["ab", "cd", "ef", "gh", "ij"], delay_s=0.02)
    s = llm.stream("x")
    events = []
    for ev in s:
        events.append(ev)
        if ev.delta == "cd":
            s.rewind(3, instruction="shorter")
    final = events[-1]
    assert final.text.startswith("abc") and "cd" not in final.text[3:]
    assert _apply(events) == final.text
    assert final.revisions == [{"kind": "rewind", "step": final.revisions[0]["step"], "offset": 3, "instruction": "shorter"}]
    assert max(e.revision for e in events) == 1
    cut = next(e for e in events if e.revision == 1)
    assert cut.offset == 3


def test_text_steer_bumps_the_revision() -> None:
    llm = ScriptedTextModel(["ab", "cd", "ef"], delay_s=0.02)
    s = llm.stream("x")
    s.steer("be brief")
    final = s.wait()
    assert final.text == "abcdef" and final.revision == 1
    assert final.revisions[0]["kind"] == "steer" and final.revisions[0]["instruction"] == "be brief"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.steer(""), "non-empty instruction"),
        (lambda s: s.steer("x", tone="y"), "unknown"),
        (lambda s: s.rewind(-1), "offset must be"),
        (lambda s: s.rewind(10_000), "offset must be"),
        (lambda s: s.rewind(0, color="red"), "unknown option"),
        (lambda s: s.rewind(0, temperature=-1), "temperature"),
    ],
)
def test_text_bad_edits_raise(call, match) -> None:
    s = ScriptedTextModel(["ab"] * 5, delay_s=0.05).stream("x")
    with pytest.raises(InvalidArgumentError, match=match):
        call(s)
    s.cancel()
    s.wait()


def test_text_revise_a_finished_answer() -> None:
    llm = ScriptedTextModel(["ab", "cd"])
    first = llm.generate("x")
    events = list(llm.revise(first, 3, instruction="again"))
    assert events[0].delta.startswith("abc") and events[0].offset == 0
    assert _apply(events) == events[-1].text == "abcabcd"
    assert events[-1].revisions[0]["kind"] == "revise"
    with pytest.raises(InvalidArgumentError, match="offset"):
        llm.revise(first, 99)


def test_image_cadence_matches_preview_throttle() -> None:
    sd = ScriptedImageModel(steps=7, size=16, delay_s=0.03)
    steps = [e.step for e in sd.stream("a red circle", preview_every=3) if not e.is_final]
    assert steps == [1, 4, 7]


def test_image_finish_early_and_priority() -> None:
    sd = ScriptedImageModel(steps=20, size=16, delay_s=0.01)
    s = sd.stream("a red circle", priority=3)
    for ev in s:
        if ev.step == 3 and not ev.is_final:
            s.finish_early()
    assert ev.is_final and ev.finish_reason == "finished_early" and ev.step < 20
    assert sd.calls[-1]["priority"] == 3


def test_image_steer_recolours_and_checks_input() -> None:
    sd = ScriptedImageModel(steps=6, size=16, delay_s=0.01)
    s = sd.stream("a red circle on a blue background")
    s.steer(prompt="a red circle on a yellow background")
    final = s.wait()
    r, g, b = final.image.convert("RGB").getpixel((0, 0))
    assert r > 200 and g > 200 and b < 80 and final.metrics["steers"] == 1
    s = sd.stream("a red circle on a blue background")
    for bad, match in [({"prompt": ""}, "must not be empty"), ({"seed": 1}, "unknown"),
                       ({"guidance_scale": float("nan")}, "finite")]:
        with pytest.raises(InvalidArgumentError, match=match):
            s.steer(**bad)
    with pytest.raises(InvalidArgumentError, match="cannot rewind"):
        s.rewind(0)
    s.wait()
    from multistream.errors import StreamFinishedError

    with pytest.raises(StreamFinishedError):
        s.steer(prompt="x")
