"""Across processes (issue 13 leftovers): two single-process servers share a real redis-server;
a stream generates on A, and B takes the WebSocket ``resume``/``cancel`` and the edits
(finish, steer, rewind over HTTP and WebSocket), which reach A through the control channel.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from multistream.server import ServerSettings
from multistream.server.durable.event_log import RedisEventLog, RemoteRecord

from redis_fixtures import needs_redis, redis_server
from server_fixtures import LiveServer, ScriptedTextModel, iter_events, make_server

pytestmark = needs_redis

TOKENS = [f" w{i}" for i in range(80)]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LiveServer, LiveServer, str]]:
    with redis_server() as redis:
        with make_server(ScriptedTextModel(TOKENS, delay_s=0.03), event_log=redis.url) as a, \
                make_server(ScriptedTextModel(), event_log=redis.url) as b:
            yield a, b, redis.url


def _start(client: httpx.Client, url: str, n: int, **body: Any) -> tuple[str, str, list[dict[str, Any]], Any]:
    """POST /v1/text on ``url``; return after ``n`` events, with the response still open."""
    cm = client.stream("POST", f"{url}/v1/text", json={"prompt": "hi", **body})
    r = cm.__enter__()
    assert r.status_code == 200, r.read()
    it = iter_events(r)
    events = [next(it) for _ in range(n)]
    return r.headers["x-stream-id"], r.headers["x-resume-token"], events, (cm, it)


def _rest(handle: Any) -> list[dict[str, Any]]:
    cm, it = handle
    try:
        return list(it)
    finally:
        cm.__exit__(None, None, None)


def _until(handle: Any, pred: Any) -> list[dict[str, Any]]:
    got = []
    for ev in handle[1]:
        got.append(ev)
        if pred(ev) or ev["is_final"]:
            return got
    return got


def _apply(events: list[dict[str, Any]]) -> str:
    text = ""
    for e in events:
        text = text[: e["offset"]] + e["delta"]
    return text


async def _ws(url: str, messages: list[dict[str, Any]], until: Any) -> list[Any]:
    """Send ``messages`` on a WebSocket to ``url``; collect JSON messages until ``until(msg)``."""
    got: list[Any] = []
    async with websockets.connect(url + "/v1/ws", open_timeout=20) as ws:
        for m in messages:
            await ws.send(json.dumps(m))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 20))
            got.append(msg)
            if until(msg):
                return got


def test_websocket_resume_and_cancel_on_another_server(servers: Any) -> None:
    a, b, _ = servers
    with httpx.Client(timeout=30) as client:
        sid, token, first, handle = _start(client, a.url, 3, max_new_tokens=20)
        _rest(handle)  # let it finish on A; B replays it from the log
        got = asyncio.run(_ws(b.ws_url, [{"type": "resume", "id": "r", "stream_id": sid, "token": token,
                                          "after": first[-1]["seq"]}],
                              lambda m: m.get("is_final") or m.get("type") == "rejected"))
        assert got[0] == {"type": "accepted", "id": "r", "stream_id": sid, "resume_token": token}
        events = first + got[1:]
        assert [e["seq"] for e in events] == list(range(len(events)))
        assert events[-1]["text"] == "".join(TOKENS[:20])
        # Ownership still applies: a wrong token is a 404, as on A.
        got = asyncio.run(_ws(b.ws_url, [{"type": "resume", "id": "x", "stream_id": sid, "token": "nope"}],
                              lambda m: m.get("type") == "rejected"))
        assert got[-1]["status"] == 404

        # Cancel on B of a stream generating on A.
        sid, token, first, handle = _start(client, a.url, 3, max_new_tokens=80)
        asyncio.run(_ws(b.ws_url, [{"type": "cancel", "stream_id": sid, "token": token},
                                   {"type": "resume", "id": "r", "stream_id": sid, "token": token, "after": 2}],
                        lambda m: m.get("is_final") or m.get("type") == "rejected"))
        rest = _rest(handle)
        assert rest[-1]["finish_reason"] == "cancelled" and len(first + rest) < 40


def test_http_steer_rewind_finish_on_another_server(servers: Any) -> None:
    a, b, _ = servers
    with httpx.Client(timeout=30) as client:
        sid, token, first, handle = _start(client, a.url, 3, max_new_tokens=30)
        h = {"X-Resume-Token": token}
        r = client.post(f"{b.url}/v1/streams/{sid}/steer", json={"instruction": "be brief"}, headers=h)
        assert r.status_code == 200, r.text
        assert r.json() == {"stream_id": sid, "command": "steer", "accepted": True}
        # Bad input: checked on B at once (schema) or by A's model (offset past the text), a 400 either way.
        r = client.post(f"{b.url}/v1/streams/{sid}/steer", json={"instruction": 5}, headers=h)
        assert r.status_code == 400
        r = client.post(f"{b.url}/v1/streams/{sid}/rewind", json={"offset": 10_000}, headers=h)
        assert r.status_code == 400 and "offset" in r.json()["error"]["message"], r.text
        # Ownership: a wrong token is a 404 and reaches nobody.
        r = client.post(f"{b.url}/v1/streams/{sid}/finish", headers={"X-Resume-Token": "nope"})
        assert r.status_code == 404
        events = first + _until(handle, lambda e: e["revision"] == 1)
        r = client.post(f"{b.url}/v1/streams/{sid}/rewind", json={"offset": 3, "instruction": "again"}, headers=h)
        assert r.status_code == 200, r.text
        events += _until(handle, lambda e: e["revision"] == 2)
        r = client.post(f"{b.url}/v1/streams/{sid}/finish", headers=h)
        assert r.status_code == 200 and r.json()["accepted"] is True
        events += _rest(handle)
        final = events[-1]
        assert final["finish_reason"] == "finished_early"
        assert [rev["kind"] for rev in final["revisions"]] == ["steer", "rewind"]
        assert final["revisions"][0]["instruction"] == "be brief"
        assert _apply(events) == final["text"]
        # Ended: finish is accepted=false, steer a 409 (B knows from the log).
        r = client.post(f"{b.url}/v1/streams/{sid}/finish", headers=h)
        assert r.status_code == 200 and r.json()["accepted"] is False
        r = client.post(f"{b.url}/v1/streams/{sid}/steer", json={"instruction": "x"}, headers=h)
        assert r.status_code == 409


def test_websocket_steer_on_another_server(servers: Any) -> None:
    a, b, _ = servers
    with httpx.Client(timeout=30) as client:
        sid, token, first, handle = _start(client, a.url, 3, max_new_tokens=15)
        seen: set[Any] = set()

        def both(m: dict[str, Any]) -> bool:  # the two answers may come in either order
            seen.add(m.get("id"))
            return {"s", "bad"} <= seen

        got = asyncio.run(_ws(b.ws_url, [
            {"type": "steer", "id": "s", "stream_id": sid, "token": token, "instruction": "shorter"},
            {"type": "rewind", "id": "bad", "stream_id": sid, "token": token, "offset": 10_000}], both))
        by_id = {m.get("id"): m for m in got}
        assert by_id["s"] == {"type": "edited", "id": "s", "stream_id": sid, "command": "steer", "accepted": True}
        assert by_id["bad"]["type"] == "rejected" and by_id["bad"]["status"] == 400
        final = _rest(handle)[-1]
        assert final["revisions"][0] == {**final["revisions"][0], "kind": "steer", "instruction": "shorter"}


def test_owner_that_does_not_answer_gives_202_and_a_gone_one_409(servers: Any) -> None:
    """The verdict wait is bounded: a silent owner -> 202 pending with a note; no owner -> 409."""
    from multistream.server.streams.edits import apply_parsed_edit

    _, _, url = servers

    async def run() -> tuple[Any, Any]:
        log = RedisEventLog(url, ServerSettings())
        silent = log.redis.pubsub()
        await silent.subscribe("ms:ctl:silent")  # receives, never answers
        meta = {"token": "t", "proc": "silent", "kind": "text"}
        pending = await apply_parsed_edit(RemoteRecord(log, "s1", meta, []), "steer", ["x"], {}, log)
        try:
            await apply_parsed_edit(RemoteRecord(log, "s2", {**meta, "proc": "nobody"}, []), "steer", ["x"], {}, log)
            gone = None
        except Exception as exc:  # noqa: BLE001
            gone = exc
        await silent.aclose()
        await log.close()
        return pending, gone

    (status, body), gone = asyncio.run(run())
    assert status == 202 and body["pending"] is True and "did not confirm" in body["note"]
    assert getattr(gone, "status", None) == 409
