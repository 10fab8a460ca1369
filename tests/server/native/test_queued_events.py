"""A request waiting in the admission queue is told where it stands: native SSE and the WebSocket
send ``queued`` {"position", "queued"} when it joins the queue and each time it moves, then the
stream's events; not protocol events (no id/seq, never replayed); OpenAI routes never send them."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import openai
import pytest
import websockets
from test_server import check_sequence, wait_until

from multistream.server.http.problems import Problem
from multistream.server.streams.admission import Admission

from server_fixtures import ScriptedTextModel, iter_sse, make_server

SLOW = [f" s{i}" for i in range(400)]


class SSEClient:
    """One ``POST`` SSE client in a thread, keeping every SSE message (queued ones included)."""

    def __init__(self, url: str, body: dict[str, Any], stop_after_events: int | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.headers: dict[str, str] = {}
        self.status: int | None = None
        self.leave = threading.Event()
        self._stop_after = stop_after_events
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            self.status, self.headers = r.status_code, dict(r.headers)
            for sse in iter_sse(r):
                if "comment" in sse:
                    continue
                self.messages.append(sse)
                if self.leave.is_set() or (self._stop_after is not None and len(self.events) >= self._stop_after):
                    return

    @property
    def queued(self) -> list[dict[str, Any]]:
        return [json.loads(m["data"]) for m in self.messages if m.get("event") == "queued"]

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(m["data"]) for m in self.messages if m.get("event") != "queued"]


def _first_running(srv: Any, model: ScriptedTextModel) -> SSEClient:
    first = SSEClient(srv.url + "/v1/text", {"prompt": "first", "max_new_tokens": 400})
    wait_until(lambda: model.active == 1 and first.events, what="the first stream running")
    return first


def _queued_client(srv: Any, prompt: str, max_new_tokens: int, **kw: Any) -> SSEClient:
    """A client whose request joined the queue (its first queued event has arrived)."""
    client = SSEClient(srv.url + "/v1/text", {"prompt": prompt, "max_new_tokens": max_new_tokens}, **kw)
    wait_until(lambda: client.queued, what=f"the {prompt} client's queued event")
    return client


def _cancel(srv: Any, client: SSEClient) -> None:
    sid = client.headers["x-stream-id"]
    r = httpx.delete(f"{srv.url}/v1/streams/{sid}", headers={"X-Resume-Token": client.headers["x-resume-token"]})
    assert r.status_code == 200


def test_sse_clients_are_told_their_place_then_get_their_events_and_resume_works() -> None:
    model = ScriptedTextModel(SLOW, delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_size=4) as srv:
        first = _first_running(srv, model)
        second = _queued_client(srv, "second", 3)
        third = _queued_client(srv, "third", 3, stop_after_events=1)
        # The response started before admission: with the stream's id and resume token already.
        assert second.status == third.status == 200
        assert {"x-stream-id", "x-resume-token"} <= set(third.headers)
        assert second.queued == [{"position": 1, "queued": 1}]
        assert third.queued == [{"position": 2, "queued": 2}]
        assert not second.events and not third.events and srv.state.gates["text"].queued == 2
        _cancel(srv, first)  # the slot frees: second runs, third moves up to next
        for client in (first, second):
            client.thread.join(30)
        third.thread.join(30)  # it leaves after its first protocol event
        assert third.queued == [{"position": 2, "queued": 2}, {"position": 1, "queued": 1}]
        # Queued messages have no id (an EventSource keeps its Last-Event-ID) and come first.
        for client in (second, third):
            kinds = [m.get("event") for m in client.messages]
            assert kinds[: len(client.queued)] == ["queued"] * len(client.queued)
            assert all("id" not in m for m in client.messages if m.get("event") == "queued")
            assert all(m["id"] == str(json.loads(m["data"])["seq"]) for m in client.messages
                       if m.get("event") != "queued")
        check_sequence(second.events)
        assert second.events[0]["stream_id"] == second.headers["x-stream-id"]
        assert "".join(e["delta"] for e in second.events) == "".join(SLOW[:3])
        assert [c["prompt"] for c in model.calls] == ["first", "second", "third"]
        # Resume the third after its first event: the rest, no queued event, no gap, no duplicate.
        sid, token = third.headers["x-stream-id"], third.headers["x-resume-token"]
        assert third.events[0]["stream_id"] == sid and third.events[0]["seq"] == 0
        with httpx.stream("GET", f"{srv.url}/v1/streams/{sid}/events", timeout=30,
                          headers={"X-Resume-Token": token, "Last-Event-ID": "0"}) as r:
            assert r.status_code == 200
            rest = [m for m in iter_sse(r) if "comment" not in m]
        assert all(m.get("event") != "queued" for m in rest)
        check_sequence(third.events + [json.loads(m["data"]) for m in rest])
        # The stream's info and a full replay know nothing of the queue either.
        with httpx.stream("GET", f"{srv.url}/v1/streams/{sid}/events?after=-1", timeout=30,
                          headers={"X-Resume-Token": token}) as r:
            replay = [m for m in iter_sse(r) if "comment" not in m]
        assert [m.get("event") for m in replay] == ["text"] * len(replay)


async def test_a_client_that_leaves_the_queue_lets_the_others_move_up() -> None:
    model = ScriptedTextModel(SLOW, delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_size=4) as srv:
        first = _first_running(srv, model)
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", srv.url + "/v1/text", json={"prompt": "second", "max_new_tokens": 2}) as r:
                lines = r.aiter_lines()
                assert await anext(lines) == "event: queued"
                assert json.loads((await anext(lines))[5:]) == {"position": 1, "queued": 1}
                third = SSEClient(srv.url + "/v1/text", {"prompt": "third", "max_new_tokens": 2})
                await asyncio.to_thread(wait_until, lambda: third.queued, what="the third client queued")
            # The second client hung up while waiting: its place is given up, the third moves up.
            await asyncio.to_thread(wait_until, lambda: len(third.queued) == 2, what="the third moving up")
        assert third.queued == [{"position": 2, "queued": 2}, {"position": 1, "queued": 1}]
        assert srv.state.gates["text"].queued == 1
        _cancel(srv, first)
        await asyncio.to_thread(third.thread.join, 30)
        check_sequence(third.events)
        assert [c["prompt"] for c in model.calls] == ["first", "third"]


def test_a_request_refused_while_queued_ends_with_one_error_event() -> None:
    model = ScriptedTextModel(SLOW, delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_timeout_s=0.5) as srv:
        first = _first_running(srv, model)
        late = SSEClient(srv.url + "/v1/text", {"prompt": "late", "max_new_tokens": 2})
        late.thread.join(30)
        assert late.status == 200 and late.queued == [{"position": 1, "queued": 1}]
        assert len(late.events) == 1
        error = late.events[0]
        assert error["type"] == "error" and error["seq"] == 0 and error["is_final"]
        assert error["stream_id"] == late.headers["x-stream-id"]
        assert error["error"]["type"] == "queue_timeout" and "queue" in error["error"]["message"]
        assert srv.state.gates["text"].queued == 0 and [c["prompt"] for c in model.calls] == ["first"]
        _cancel(srv, first)
        first.thread.join(30)


def test_a_queued_request_is_cancelled_by_its_id_and_gives_up_its_place() -> None:
    model = ScriptedTextModel(SLOW, delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_size=4) as srv:
        first = _first_running(srv, model)
        second = _queued_client(srv, "second", 2)
        third = _queued_client(srv, "third", 2)
        sid = second.headers["x-stream-id"]
        # Only with its resume token (no probing for queued ids), as for a running stream.
        assert httpx.delete(f"{srv.url}/v1/streams/{sid}", headers={"X-Resume-Token": "wrong"}).status_code == 404
        _cancel(srv, second)
        second.thread.join(30)
        assert len(second.events) == 1  # its response ends with one final event that says so
        error = second.events[0]
        assert error["type"] == "error" and error["is_final"] and error["stream_id"] == sid
        assert error["error"]["type"] == "cancelled" and "queue" in error["error"]["message"]
        # The one behind it moves up; the cancelled one never reaches the model.
        wait_until(lambda: third.queued[-1:] == [{"position": 1, "queued": 1}], what="the third client moving up")
        assert srv.state.gates["text"].queued == 1
        _cancel(srv, first)
        third.thread.join(30)
        assert [c["prompt"] for c in model.calls] == ["first", "third"] and third.events[-1]["is_final"]


async def test_websocket_streams_are_told_their_place() -> None:
    model = ScriptedTextModel(SLOW, delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_size=4) as srv:
        async with websockets.connect(srv.ws_url + "/v1/ws", open_timeout=30) as ws:
            await ws.send(json.dumps({"type": "text", "id": "c1", "prompt": "first", "max_new_tokens": 400}))
            messages: list[dict[str, Any]] = []

            async def until(predicate: Any) -> None:
                while not predicate():
                    messages.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))

            await until(lambda: any(m.get("stream_id") and m["type"] == "text" for m in messages))
            first_id = next(m["stream_id"] for m in messages if m["type"] == "accepted")
            await ws.send(json.dumps({"type": "text", "id": "c2", "prompt": "second", "max_new_tokens": 2}))
            await until(lambda: any(m["type"] == "queued" and m["id"] == "c2" for m in messages))
            await ws.send(json.dumps({"type": "text", "id": "c3", "prompt": "third", "max_new_tokens": 2}))
            await until(lambda: any(m["type"] == "queued" and m["id"] == "c3" for m in messages))
            await ws.send(json.dumps({"type": "cancel", "stream_id": first_id}))
            finals: set[str] = set()

            def all_final() -> bool:
                finals.update(m["stream_id"] for m in messages if m.get("is_final"))
                return len(finals) == 3

            await until(all_final)
        queued = {tag: [(m["position"], m["queued"]) for m in messages if m["type"] == "queued" and m["id"] == tag]
                  for tag in ("c1", "c2", "c3")}
        assert queued == {"c1": [], "c2": [(1, 1)], "c3": [(2, 2), (1, 1)]}
        # Each queued stream: its queued notices, then accepted, then its events in order.
        for tag in ("c2", "c3"):
            mine = [i for i, m in enumerate(messages) if m.get("id") == tag]
            accepted = next(i for i in mine if messages[i]["type"] == "accepted")
            assert all(messages[i]["type"] == "queued" for i in mine if i < accepted)
            sid = messages[accepted]["stream_id"]
            check_sequence([m for m in messages if m.get("stream_id") == sid and m["type"] == "text"])
        assert [c["prompt"] for c in model.calls] == ["first", "second", "third"]


def test_openai_routes_never_send_queued_events() -> None:
    model = ScriptedTextModel(SLOW, delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_size=4) as srv:
        first = _first_running(srv, model)
        raw: list[dict[str, Any]] = []

        def chat() -> None:
            body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
                raw.extend(m for m in iter_sse(r) if "comment" not in m)

        sdk_text: list[str] = []

        def sdk() -> None:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            for chunk in client.chat.completions.create(model="default", messages=[{"role": "user", "content": "yo"}],
                                                         max_tokens=2, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    sdk_text.append(chunk.choices[0].delta.content)

        threads = [threading.Thread(target=chat, daemon=True), threading.Thread(target=sdk, daemon=True)]
        threads[0].start()
        wait_until(lambda: srv.state.gates["text"].queued == 1, what="the raw chat client queued")
        threads[1].start()
        wait_until(lambda: srv.state.gates["text"].queued == 2, what="the SDK client queued")
        # A native client queued behind them gets its notices; the OpenAI ones wait silently.
        native = SSEClient(srv.url + "/v1/text", {"prompt": "native", "max_new_tokens": 1})
        wait_until(lambda: native.queued, what="the native client's queued event")
        assert native.queued == [{"position": 3, "queued": 3}]
        assert raw == []  # no byte before admission: the OpenAI route answers once admitted
        _cancel(srv, first)
        for t in threads:
            t.join(60)
        native.thread.join(60)
        assert raw and all("event" not in m for m in raw) and raw[-1]["data"] == "[DONE]"
        assert not any("position" in m["data"] for m in raw)
        assert "".join(sdk_text) == "".join(SLOW[:2])
        assert [q["position"] for q in native.queued] == [3, 2, 1]


@pytest.mark.parametrize("arrivals", [[0, 0, 0], [0, 5, 1]])
async def test_admission_tells_each_waiter_its_position(arrivals: list[int]) -> None:
    gate = Admission("text", concurrency=1, queue_size=8)
    await gate.acquire()
    told: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(arrivals))}
    waiters = []
    for i, priority in enumerate(arrivals):
        waiters.append(asyncio.ensure_future(gate.acquire(priority, on_move=lambda p, q, i=i: told[i].append((p, q)))))
        await asyncio.sleep(0)
    if arrivals == [0, 0, 0]:
        assert told == {0: [(1, 1)], 1: [(2, 2)], 2: [(3, 3)]}
    else:  # the priority-5 one jumps ahead of both; the priority-1 one lands between
        assert told == {0: [(1, 1), (2, 2), (3, 3)], 1: [(1, 2)], 2: [(2, 3)]}
    waiters[2].cancel()  # a waiter that gives up: those behind it move up
    await asyncio.sleep(0)
    gate.release()  # the best waiter runs, the rest move up
    await asyncio.sleep(0)
    winner = 0 if arrivals == [0, 0, 0] else 1
    await asyncio.wait_for(waiters[winner], 5)
    if arrivals == [0, 0, 0]:
        assert told[1][-1] == (1, 1) and told[0] == [(1, 1)]
    else:
        assert told[0][-1] == (1, 1) and told[1] == [(1, 2)]
    assert gate.queued == 1 and gate.running == 1
    waiters[1 - winner].cancel()


async def test_try_acquire_takes_a_free_slot_at_once_and_nothing_else() -> None:
    gate = Admission("text", concurrency=1, queue_size=8)
    assert gate.try_acquire() and gate.running == 1  # free: taken without a suspension
    assert not gate.try_acquire() and gate.running == 1  # full: the caller queues with acquire()
    waiter = asyncio.ensure_future(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # the slot goes to the waiter in the queue, not to a later fast path
    assert not gate.try_acquire()
    await waiter
    gate.release()
    gate.close(Problem(503, "shutting_down", "bye"))
    assert gate.running == 0 and not gate.try_acquire()  # closed: acquire() raises the refusal
