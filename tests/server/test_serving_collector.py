"""The cyclic collector while the server streams (`multistream.server.collector`): raised threshold
while streams are live, the due collection at the first moment without one, thresholds back at the end."""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from multistream.server import ServerSettings, create_app, uvicorn_config
from multistream.server.collector import BUSY_THRESHOLD, FULL_INTERVAL_S, ServingCollector
from multistream.server.runner import DrainingServer
from multistream.testing import ScriptedTextModel


class Collections(list):  # type: ignore[type-arg]
    """(generation, live streams then) of every collection that ends; ``live["now"]`` is the count."""

    live: dict[str, int]


@pytest.fixture
def collections() -> Iterator[Collections]:
    seen = Collections()
    seen.live = live = {"now": 0}

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "stop":
            seen.append((info["generation"], live["now"]))

    gc.callbacks.append(note)
    thresholds = gc.get_threshold()
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*thresholds)


def _allocate(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]  # n tracked objects that stay alive (net allocations)


def test_collections_wait_while_streams_are_live_and_run_once_none_is(collections: Collections) -> None:
    async def scenario() -> tuple[int, int, int]:
        live = collections.live
        live["now"] = 1
        collector = ServingCollector(lambda: live["now"] == 0, tick_s=0.01)
        collector.start(asyncio.get_running_loop())
        busy_threshold = gc.get_threshold()[0]
        gc.collect()
        collections.clear()
        kept = _allocate(5_000)  # seven times CPython's first threshold: collections were due
        await asyncio.sleep(0.05)
        during = len(collections)
        live["now"] = 0
        await asyncio.sleep(0.05)
        collector.stop()
        del kept
        return busy_threshold, during, collector.idle_collections

    thresholds = gc.get_threshold()
    busy_threshold, during, idle = asyncio.run(scenario())
    assert busy_threshold == BUSY_THRESHOLD
    assert during == 0  # none while the stream was live
    assert idle >= 1 and any(live == 0 for _, live in collections)  # the due one, once nothing was live
    assert gc.get_threshold() == thresholds  # stop puts CPython's thresholds back


def test_under_sustained_load_the_collector_still_runs_at_the_raised_threshold(collections: Collections) -> None:
    async def scenario() -> int:
        collector = ServingCollector(lambda: False, busy_threshold=2_000, tick_s=0.01)
        collector.start(asyncio.get_running_loop())
        gc.collect()
        collections.clear()
        kept = _allocate(1_500)  # past CPython's 700, short of the raised threshold: nothing yet
        during = len(collections)
        kept += _allocate(6_000)  # a stream is always live: memory must stay bounded all the same
        await asyncio.sleep(0.02)
        collector.stop()
        del kept
        return during

    assert asyncio.run(scenario()) == 0
    assert len(collections) >= 2  # about one per 2,000 objects, none of them at an idle moment


def test_a_model_loads_pause_is_not_ended_by_an_idle_moment(collections: Collections) -> None:
    async def scenario() -> int:
        collector = ServingCollector(lambda: True, tick_s=0.01)
        gc.disable()  # what `multistream._gc` does while a model loads
        try:
            kept = _allocate(5_000)
            collector.start(asyncio.get_running_loop())
            await asyncio.sleep(0.05)
            collector.stop()
            del kept
            return collector.idle_collections
        finally:
            gc.enable()

    assert asyncio.run(scenario()) == 0


def test_collectors_side_by_side_put_the_thresholds_back_when_the_last_stops() -> None:
    thresholds = gc.get_threshold()
    loop = asyncio.new_event_loop()
    try:
        a, b = ServingCollector(lambda: False), ServingCollector(lambda: False)
        a.start(loop)
        b.start(loop)  # a second server in the process
        assert gc.get_threshold()[0] == BUSY_THRESHOLD
        a.stop()
        assert gc.get_threshold()[0] == BUSY_THRESHOLD  # b still serves
        b.stop()
        b.stop()  # idempotent
        assert gc.get_threshold() == thresholds
        gc.set_threshold(0)  # a process that switched automatic collection off: it stays off
        c = ServingCollector(lambda: True)
        c.start(loop)
        assert gc.get_threshold()[0] == 0 and c.idle_collections == 0
        c.stop()
    finally:
        gc.set_threshold(*thresholds)
        loop.close()


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14's incremental collector: a due collection is gen 1")
def test_full_collections_at_quiet_moments_are_spaced_out(collections: Collections) -> None:
    loop = asyncio.new_event_loop()
    collector = ServingCollector(lambda: True, tick_s=60)
    try:
        collector.start(loop)  # its first check: whatever is due now
        for _ in range(10):
            gc.collect(1)  # ten collections of generation 1: a full one is due by CPython's counts
        kept = _allocate(1_000)
        collections.clear()
        collector._tick()
        assert [g for g, _ in collections] == [1]  # the last full one (start-up's) is under 10 s old
        for _ in range(10):
            gc.collect(1)
        kept += _allocate(1_000)
        collections.clear()
        collector._last_full -= FULL_INTERVAL_S
        collector._tick()
        assert [g for g, _ in collections] == [2]
        del kept
    finally:
        collector.stop()
        loop.close()


def test_the_servers_runner_raises_the_threshold_collects_after_a_stream_and_restores_it_at_exit() -> None:
    model = ScriptedTextModel([f" t{i}" for i in range(30)], delay_s=0.01)
    app = create_app(text_model=model, settings=ServerSettings())
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn_config(app, log_level="warning", lifespan="on"))
    thresholds = gc.get_threshold()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while server.collector is None:  # started once the model has settled and start-up is frozen
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not settle"
            time.sleep(0.02)
        assert gc.get_threshold()[0] == BUSY_THRESHOLD
        before = server.collector.idle_collections
        with httpx.stream("POST", url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 30}, timeout=30) as r:
            text = "".join(line for line in r.iter_lines() if line.startswith("data:"))
        assert '"is_final":true' in text
        # Kept alive: a dropped list gives its objects back and the young count with them (a stream's
        # own net allocations made the collection due only some of the time).
        kept = _allocate(2_000)  # enough for a young collection to be due
        deadline = time.monotonic() + 5
        while server.collector.idle_collections == before:  # run at the first check without a live stream
            assert time.monotonic() < deadline, f"no collection once the stream had ended (counts {gc.get_count()})"
            time.sleep(0.02)
        del kept
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        gc.unfreeze()  # this test process goes on: start-up's objects are collectable again
    assert gc.get_threshold() == thresholds
