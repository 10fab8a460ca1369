"""The Stream machinery, driven by scripted producers (no model)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

import multistream as ms
from multistream.stream import Stream, StreamWriter

USAGE = {"prompt_tokens": 1, "completion_tokens": 1}


def scripted(pieces, step_s=0.0, started=None, steps_done=None, finished=None):
    """A fake model: one text delta per step, checking for cancel each step like an adapter."""

    def producer(writer: StreamWriter) -> None:
        if started is not None:
            started.set()
        text, reason = "", "stop"
        for i, piece in enumerate(pieces):
            if writer.cancelled:
                reason = "cancelled"
                break
            if step_s:
                time.sleep(step_s)
            writer.text(piece, [i], i)
            text += piece
            if steps_done is not None:
                steps_done.append(i)
        writer.finish_text("", [], len(text), finish_reason=reason, text=text, usage=USAGE, metrics={})
        if finished is not None:
            finished.set()

    return producer


def check_protocol(events):
    assert [e.seq for e in events] == list(range(len(events)))
    assert [e.is_final for e in events].count(True) == 1 and events[-1].is_final
    assert len({e.stream_id for e in events}) == 1


def test_events_have_gap_free_seq_and_one_final_last():
    events = list(Stream(scripted(["a", "b", "c"], step_s=0.01)))
    check_protocol(events)
    assert "".join(e.delta for e in events) == events[-1].text == "abc"
    assert all(b.t >= a.t for a, b in zip(events, events[1:]))


async def test_async_iteration():
    events = [ev async for ev in Stream(scripted(["x", "y"], step_s=0.01))]
    check_protocol(events)
    assert events[-1].text == "xy"


async def test_async_consumer_does_not_block_the_event_loop():
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    events = [ev async for ev in Stream(scripted(list("abcdefghij"), step_s=0.02))]
    task.cancel()
    assert events[-1].text == "abcdefghij"
    assert ticks >= 10  # the loop kept running while we waited for tokens


def test_cancel_stops_within_one_step():
    steps: list[int] = []
    stream = Stream(scripted(["t"] * 1000, step_s=0.005, steps_done=steps))
    events = []
    for ev in stream:
        events.append(ev)
        if len(events) == 3:
            stream.cancel()
            steps_at_cancel = len(steps)
    check_protocol(events)
    assert events[-1].finish_reason == "cancelled"
    assert len(steps) <= steps_at_cancel + 1
    assert stream.join(5)


def test_exception_in_model_becomes_error_event():
    def broken(writer):
        writer.text("partial", [0], 0)
        raise ZeroDivisionError("the model divided by zero")

    stream = Stream(broken)
    events = list(stream)
    check_protocol(events)
    assert events[-1].type == "error"
    assert events[-1].error == {"type": "ZeroDivisionError", "message": "the model divided by zero"}
    assert isinstance(stream.exception, ZeroDivisionError)
    assert stream.exception.__traceback__ is not None


def test_producer_that_forgets_the_final_event_still_ends_the_stream():
    events = list(Stream(lambda w: w.text("x", [0], 0)))
    check_protocol(events)
    assert events[-1].type == "error" and "without a final event" in events[-1].error["message"]


def test_iterating_a_consumed_stream_raises_a_clear_error():
    stream = Stream(scripted(["a"]))
    list(stream)
    with pytest.raises(ms.StreamConsumedError, match="already consumed"):
        list(stream)


def test_a_stream_is_its_own_iterator_and_next_then_for_reads_it_whole():
    stream = Stream(scripted(["a", "b", "c"], step_s=0.01))
    assert iter(stream) is stream
    first = next(iter(stream))
    rest = list(stream)
    events = [first, *rest]
    check_protocol(events)
    assert "".join(ev.delta for ev in events) == "abc" and events[-1].text == "abc"
    with pytest.raises(StopIteration):
        next(stream)


async def test_anext_then_async_for_reads_it_whole():
    stream = Stream(scripted(["a", "b", "c"], step_s=0.01))
    assert stream.__aiter__() is stream
    first = await stream.__anext__()
    events = [first] + [ev async for ev in stream]
    check_protocol(events)
    assert events[-1].text == "abc"


def test_second_concurrent_consumer_raises():
    stream = Stream(scripted(["a"] * 50, step_s=0.01))
    inside = threading.Event()
    errors: list[BaseException] = []

    def slow_reader() -> None:
        inside.set()
        try:
            list(stream)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    inside.wait(5)
    deadline = time.time() + 5
    raised = None
    while time.time() < deadline and raised is None and reader.is_alive():
        try:
            next(stream)
        except ms.StreamConsumedError as exc:
            raised = exc
        except StopIteration:
            break
    assert raised is not None and "already being iterated" in str(raised)
    stream.cancel()
    reader.join(5)


def test_breaking_out_of_a_loop_over_an_unheld_stream_cancels_the_model():
    steps: list[int] = []
    finished = threading.Event()
    for _ in Stream(scripted(["t"] * 1000, step_s=0.005, steps_done=steps, finished=finished)):
        break
    gc.collect()
    assert finished.wait(5), "the model kept running after the consumer left"
    assert len(steps) < 1000


def test_a_held_stream_continues_after_break_and_close_stops_it():
    steps: list[int] = []
    finished = threading.Event()
    stream = Stream(scripted(["t"] * 1000, step_s=0.005, steps_done=steps, finished=finished))
    for _ in stream:
        break
    assert next(stream).type == "text"  # still live: the next loop continues it
    stream.close()
    assert finished.wait(5), "close() did not stop the model"
    assert len(steps) < 1000
    with pytest.raises(ms.StreamConsumedError, match="closed"):
        list(stream)


def test_leaving_a_with_block_stops_the_model():
    steps: list[int] = []
    finished = threading.Event()
    with Stream(scripted(["t"] * 1000, step_s=0.005, steps_done=steps, finished=finished)) as stream:
        next(stream)
    assert finished.wait(5), "leaving the with block did not stop the model"
    assert len(steps) < 1000


def test_dropping_an_unconsumed_stream_cancels_the_model():
    steps: list[int] = []
    finished = threading.Event()
    started = threading.Event()
    stream = Stream(scripted(["t"] * 1000, step_s=0.005, started=started, steps_done=steps, finished=finished))
    started.wait(5)
    del stream
    gc.collect()
    assert finished.wait(5), "garbage collection did not cancel the model"
    assert len(steps) < 1000


def test_slow_consumer_gets_merged_deltas_and_nothing_is_lost():
    pieces = [f"<{i}>" for i in range(300)]
    finished = threading.Event()
    stream = Stream(scripted(pieces, finished=finished))
    events = []
    producer_done_while_consumer_slept = None
    for ev in stream:
        events.append(ev)
        if len(events) == 1:
            # A slow consumer (a browser, a terminal): the model must finish without it.
            producer_done_while_consumer_slept = finished.wait(30)
    check_protocol(events)
    assert producer_done_while_consumer_slept, "the model waited for the consumer"
    assert "".join(e.delta for e in events) == "".join(pieces) == events[-1].text
    assert len(events) < len(pieces)
    assert [t for e in events for t in e.token_ids] == list(range(300))
    # index is the position of each event's first token
    for ev in events[:-1]:
        assert ev.index == ev.token_ids[0]


def test_slow_consumer_gets_only_the_newest_preview_and_always_the_final():
    def producer(writer):
        for step in range(1, 51):
            writer.image(step=step, total_steps=50, width=1, height=1, mime="image/png", data=bytes([step]))
        writer.image(step=50, total_steps=50, width=4, height=4, mime="image/png", data=b"final",
                     is_final=True, finish_reason="stop")

    stream = Stream(producer, kind="image")
    assert stream.join(30)  # everything was produced before the consumer looked
    events = list(stream)
    check_protocol(events)
    assert [e.step for e in events] == [50, 50]
    assert events[0].data == bytes([50]) and events[-1].data == b"final"


def test_wait_calls_back_and_returns_the_final_event():
    seen = []
    final = Stream(scripted(["a", "b"])).wait(on_event=seen.append)
    assert final is seen[-1] and final.text == "ab"


def test_forward_rewrites_ids_and_can_demote_a_final():
    inner = list(Stream(scripted(["a"])))

    def producer(writer):
        for ev in inner:
            writer.forward(ev, is_final=False)
        writer.finish_text("", [], 0, finish_reason="stop", text="a", usage=USAGE, metrics={})

    outer = Stream(producer)
    events = list(outer)
    check_protocol(events)
    assert all(e.stream_id == outer.stream_id for e in events)


def test_text_and_previews_interleaved_keep_the_buffer_small():
    """A text+image stream read slowly: deltas still merge (looking past previews), nothing is lost."""
    done = threading.Event()

    def producer(writer):
        for i in range(2000):
            writer.text(f"{i},", [i], i)
            writer.image(step=i + 1, total_steps=2000, width=1, height=1, mime="image/png", data=bytes([i % 256]))
        writer.finish_text("", [], 2000, finish_reason="stop", text="", usage=USAGE, metrics={})
        done.set()

    stream = Stream(producer)
    assert done.wait(30)
    assert len(stream._channel._pending) <= 3  # one merged delta, one preview, the final
    events = list(stream)
    check_protocol(events)
    assert "".join(e.delta for e in events if e.type == "text") == "".join(f"{i}," for i in range(2000))


def test_a_finished_image_that_is_not_the_last_is_never_dropped():
    def producer(writer):
        writer.image(step=1, total_steps=1, width=1, height=1, mime="image/png", data=b"a", index=0,
                     finish_reason="stop")
        writer.image(step=1, total_steps=1, width=1, height=1, mime="image/png", data=b"p", index=0)
        writer.image(step=1, total_steps=1, width=1, height=1, mime="image/png", data=b"b", index=1,
                     is_final=True, finish_reason="stop")

    stream = Stream(producer, kind="image")
    stream.join(10)
    events = list(stream)
    check_protocol(events)
    assert [(e.data, e.finish_reason, e.is_final) for e in events] == [
        (b"a", "stop", False), (b"p", None, False), (b"b", "stop", True)]


async def test_one_producer_step_over_many_streams_wakes_their_loop_once() -> None:
    """An engine step emits an event on every row; the waiting async readers are woken with one
    cross-thread call per batch (a pipe write that also hands the GIL around), not one per row."""
    loop = asyncio.get_running_loop()
    writers: list[StreamWriter] = []
    streams = [Stream(submit=writers.append, kind="text") for _ in range(20)]
    readers = [asyncio.ensure_future(s.__anext__()) for s in streams]
    while not all(s._channel._async_waiters for s in streams):  # every reader waits on its channel
        await asyncio.sleep(0)
    calls = []
    real = loop.call_soon_threadsafe

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args[0])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        # One "engine step" on another thread while the loop is busy (as it is under load).
        step = threading.Thread(target=lambda: [w.text("x", [1], 0) for w in writers])
        step.start()
        step.join()
        firsts = await asyncio.gather(*readers)
    finally:
        del loop.call_soon_threadsafe
    assert [ev.delta for ev in firsts] == ["x"] * 20
    assert len(calls) == 1
    for s in streams:
        s.close()
