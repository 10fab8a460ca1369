"""`streams.starting.start_stream`: a model's ``.stream(...)`` starts on a worker thread, so a slow
start (the video model's motion prior, seconds) does not hold the event loop up; a model whose
``.stream()`` needs the loop (the Ray handle) starts on it; a caller cancelled during a start has
the stream closed. The durable continuation goes through it too (a restarted ingress continuing
on a Ray handle called its ``.stream()`` off the loop and failed)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from multistream.events import TextEvent
from multistream.server.durable.continuation import continuation_stream
from multistream.server.streams.starting import start_stream
from multistream.stream import Stream
from multistream.testing import ScriptedTextModel


class SlowStart(ScriptedTextModel):
    """A scripted model whose ``.stream()`` blocks its caller for ``start_s`` first; it records the
    thread and whether it ran on the event loop."""

    def __init__(self, start_s: float = 0.0, needs_loop: bool = False, delay_s: float = 0.0) -> None:
        super().__init__([" a", " b", " c"], delay_s=delay_s)
        self.start_s = start_s
        self.stream_needs_loop = needs_loop
        self.started_on_loop: list[bool] = []
        self.streams: list[Stream] = []

    def stream(self, prompt: Any, **options: Any) -> Stream:
        try:
            asyncio.get_running_loop()
            self.started_on_loop.append(True)
        except RuntimeError:
            self.started_on_loop.append(False)
        if self.stream_needs_loop:
            asyncio.get_running_loop()  # what the Ray handle does: its pump is a task on this loop
        time.sleep(self.start_s)
        stream = super().stream(prompt, **options)
        self.streams.append(stream)
        return stream


def test_a_slow_start_runs_off_the_loop_and_the_loop_keeps_serving() -> None:
    model = SlowStart(start_s=0.4)

    async def main() -> tuple[int, list[str]]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        stream = await start_stream(model, lambda m: m.stream("hi"))
        task.cancel()
        return ticks, [ev.delta async for ev in stream if isinstance(ev, TextEvent)]

    ticks, deltas = asyncio.run(main())
    assert model.started_on_loop == [False]
    assert ticks >= 10, f"the loop ran {ticks} ticks during a 0.4 s start: the start held it up"
    assert "".join(deltas) == " a b c"


def test_a_model_that_needs_the_loop_starts_on_it() -> None:
    model = SlowStart(needs_loop=True)

    async def main() -> str:
        stream = await start_stream(model, lambda m: m.stream("hi"))
        return "".join([ev.delta async for ev in stream if isinstance(ev, TextEvent)])

    assert asyncio.run(main()) == " a b c"
    assert model.started_on_loop == [True]


def test_a_caller_cancelled_during_the_start_has_the_stream_closed() -> None:
    model = SlowStart(start_s=0.3, delay_s=0.5)  # still running when the start returns
    started = threading.Event()

    async def main() -> None:
        task = asyncio.create_task(start_stream(model, lambda m: (started.set(), m.stream("hi"))[1]))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the start finishes on its thread, then the stream is closed
            if model.streams and model.streams[0].cancelled:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(model.streams) == 1 and model.streams[0].cancelled
    with pytest.raises(Exception, match="was closed"):
        list(model.streams[0])


@pytest.mark.parametrize("needs_loop", [False, True])
def test_a_continuation_starts_where_the_model_can(needs_loop: bool) -> None:
    """A restarted server's continuation (`continuation_stream`) of a logged answer, on a model that
    starts off the loop and on one (like the Ray handle) whose ``.stream()`` needs the loop."""
    model = SlowStart(needs_loop=needs_loop)
    logged = list(ScriptedTextModel([" a", " b", " c"]).stream("hi"))[:1]

    async def main() -> list[Any]:
        return [ev async for ev in await continuation_stream(model, {"prompt": "hi"}, logged, "s1")]

    rest = asyncio.run(main())
    assert model.started_on_loop == [needs_loop]
    assert "".join(ev.delta for ev in logged + rest if isinstance(ev, TextEvent)) == " a b c"
    assert rest[-1].is_final and rest[-1].text == " a b c"
