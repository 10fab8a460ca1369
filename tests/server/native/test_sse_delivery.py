"""SSE delivery: the frames on the wire are exactly sse-starlette's encoding, and a model's slow
``.stream()`` call (a real model tokenizes there) never holds up the other streams' events.
(Speed itself is measured in benchmarks/sse_anchor.py, not asserted here.)"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from fastapi import Request  # module level: the endpoints' string annotations resolve against it
from sse_starlette import ServerSentEvent
from test_server import check_sequence, wait_until

from multistream.server.runner import uvicorn_config

from server_fixtures import ScriptedTextModel, iter_events, iter_sse, make_server

TOKENS = [f" w{i}" for i in range(12)]


def test_frames_are_sse_starlettes_encoding_byte_for_byte() -> None:
    with make_server(ScriptedTextModel(TOKENS)) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 4}, timeout=30) as r:
            body = r.read()
        frames = [f for f in body.split(b"\r\n\r\n") if f and not f.startswith(b":")]
        events = [json.loads(f.split(b"\r\ndata: ", 1)[1]) for f in frames]
        check_sequence(events)
        # Each frame is what ServerSentEvent(data, event, id).encode() makes of the event.
        expected = b"".join(ServerSentEvent(data=json.dumps(ev, ensure_ascii=False, separators=(",", ":")),
                                            event=ev["type"], id=str(ev["seq"])).encode() for ev in events)
        assert b"".join(f + b"\r\n\r\n" for f in frames) == expected


class _HeldModel(ScriptedTextModel):
    """``.stream("hold")`` blocks (as a long prompt's tokenization would) until released; a model
    that does not say its start is quick (``quick_stream_start``) is always started on a worker."""

    quick_stream_start = False

    def __init__(self) -> None:
        super().__init__(TOKENS)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def stream(self, prompt: Any, **options: Any) -> Any:
        if prompt == "hold":
            self.entered.set()
            self.release.wait(60)
            self.returned.set()
        return super().stream(prompt, **options)


def test_a_slow_stream_call_does_not_hold_up_other_streams() -> None:
    model = _HeldModel()
    with make_server(model, text_concurrency=4) as srv:
        held: list[Any] = []

        def post_held() -> None:
            with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hold", "max_new_tokens": 2},
                              timeout=90) as r:
                held.extend(json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:"))

        thread = threading.Thread(target=post_held, daemon=True)
        thread.start()
        wait_until(lambda: model.entered.is_set(), what="the held .stream() call")
        # While that call blocks its thread, another stream runs start to end on the same server.
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "free", "max_new_tokens": 3},
                          timeout=90) as r:
            free = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert not model.returned.is_set(), "the other stream waited for the held .stream() call"
        check_sequence(free)
        model.release.set()
        thread.join(60)
        check_sequence(held)


class _ThreadNotingModel(ScriptedTextModel):
    """Notes the thread each ``.stream()`` call runs on."""

    def __init__(self) -> None:
        super().__init__(TOKENS)
        self.threads: list[str] = []

    def stream(self, prompt: Any, **options: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return super().stream(prompt, **options)


def test_a_quick_request_starts_on_the_event_loop_and_a_grammar_or_long_prompt_on_a_worker() -> None:
    model = _ThreadNotingModel()
    bodies = [{"prompt": "hi"},  # quick: started on the loop, no hand-off to a worker thread
              {"prompt": "hi", "json_schema": {"type": "object"}},  # a grammar to compile
              {"prompt": "x" * 1_001},  # a long prompt to tokenize
              {"prompt": [{"role": "user", "content": "hi"}]}]  # quick too
    with make_server(model) as srv:
        for body in bodies:
            with httpx.stream("POST", srv.url + "/v1/text", json={**body, "max_new_tokens": 2}, timeout=30) as r:
                check_sequence([json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")])
        loop_thread = model.threads[0]
    assert not loop_thread.startswith("multistream-start")
    assert [name.startswith("multistream-start") for name in model.threads] == [False, True, True, False]
    assert model.threads[3] == loop_thread


def test_the_stream_routes_skip_fastapis_dependency_solving(monkeypatch: Any) -> None:
    import fastapi.routing

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("solve_dependencies called")

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", refuse)
    with make_server(ScriptedTextModel(TOKENS)) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 2}, timeout=30) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
            stream_id = r.headers["x-stream-id"]
        check_sequence(events)  # a RequestOnlyRoute: its endpoint reads the state and the caller itself
        # A route with FastAPI dependencies meets the refusal: the patch was in effect.
        assert httpx.get(f"{srv.url}/v1/streams/{stream_id}", timeout=30).status_code == 500


def test_a_request_only_route_refuses_an_endpoint_with_dependencies() -> None:
    from fastapi import APIRouter, Depends

    from multistream.server.http.routes import RequestOnlyRoute

    async def guard() -> None: ...

    async def plain(request: Request) -> None: ...

    async def guarded(request: Request, _: None = Depends(guard)) -> None: ...

    async def by_id(request: Request, stream_id: str) -> None: ...

    APIRouter().add_api_route("/ok", plain, methods=["POST"], route_class_override=RequestOnlyRoute)
    for path, endpoint in [("/a", guarded), ("/b/{stream_id}", by_id)]:
        with pytest.raises(TypeError, match="takes the Request alone"):
            APIRouter().add_api_route(path, endpoint, methods=["POST"], route_class_override=RequestOnlyRoute)
    router = APIRouter(route_class=RequestOnlyRoute, dependencies=[Depends(guard)])
    with pytest.raises(TypeError, match="takes the Request alone"):  # a router's own dependencies too
        router.add_api_route("/c", plain, methods=["POST"])


def test_the_server_speaks_httptools_with_the_head_deadline() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    with make_server(ScriptedTextModel(TOKENS), header_timeout_s=3.0) as srv:
        protocol = uvicorn_config(srv.app).http
    assert isinstance(protocol, type) and issubclass(protocol, HttpToolsProtocol)
    assert protocol.header_timeout_s == 3.0  # type: ignore[attr-defined]


def _post_raw(url: str, body: dict[str, Any], receive_buffer: int) -> Any:
    """A client socket with a small receive buffer that sends a POST and then reads nothing."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((where.hostname, where.port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/text HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout() -> None:
    # Tokens of 20 kB, 2 MB a second for 20 s: far more than the socket buffers hold, so the
    # server's writes block while the model is still generating.
    model = ScriptedTextModel(["x" * 20_000] * 2000, delay_s=0.01)
    with make_server(model, send_timeout_s=0.5, grace_period_s=0.2, max_new_tokens=2000) as srv:
        sock = _post_raw(srv.url, {"prompt": "hi", "max_new_tokens": 2000}, receive_buffer=4096)
        try:
            # The writes stall, the connection is dropped, the grace period passes: the model stops.
            wait_until(lambda: model.finish_reasons, timeout=20, what="the stalled stream to end")
            assert model.finish_reasons == ["cancelled"]
            sock.settimeout(20)
            while sock.recv(1 << 20):  # what was buffered, then the server's close
                pass
        finally:
            sock.close()
        assert 'multistream:streams_interrupted_total{kind="text"} 1.0' in httpx.get(srv.url + "/metrics").text
        # The server goes on serving.
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 2}, timeout=30) as r:
            assert r.status_code == 200 and [e["is_final"] for e in iter_events(r)][-1]


def test_an_idle_stream_is_neither_timed_out_nor_pinged_when_heartbeats_are_off() -> None:
    # The send timeout watches writes in flight, not silence: a first token 1 s away on a 0.2 s
    # send timeout still arrives, with no heartbeat comment before it (heartbeat_s=0).
    model = ScriptedTextModel(TOKENS, first_delay_s=1.0)
    with make_server(model, send_timeout_s=0.2, heartbeat_s=0) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 3}, timeout=30) as r:
            items = list(iter_sse(r))
    assert all("comment" not in item for item in items)
    check_sequence([json.loads(item["data"]) for item in items])
    assert model.finish_reasons == ["length"]

