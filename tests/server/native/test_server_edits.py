"""Edits over the wire: POST /v1/streams/{id}/finish|steer|rewind and the WebSocket messages."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets

from multistream import ImageEvent, TextEvent, event_from_dict
from multistream.server import decode_message

from server_fixtures import ScriptedImageModel, ScriptedTextModel, iter_events, make_server

TOKENS = [f" w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def srv():  # type: ignore[no-untyped-def]
    text = ScriptedTextModel(TOKENS, delay_s=0.03)
    with make_server(text, ScriptedImageModel(steps=30, size=32, delay_s=0.03)) as s:
        yield s


@pytest.fixture(scope="module")
def keyed():  # type: ignore[no-untyped-def]
    text = ScriptedTextModel(TOKENS, delay_s=0.03)
    with make_server(text, ScriptedImageModel(steps=30, size=32, delay_s=0.03), api_key="k") as s:
        yield s


def _apply(events: list[dict[str, Any]]) -> str:
    text = ""
    for e in events:
        text = text[: e["offset"]] + e["delta"]
    return text


def _run(srv: Any, path: str, body: dict[str, Any], edit: Any, *, at: int = 3) -> tuple[list[dict[str, Any]], Any]:
    """POST a stream, call ``edit(client, stream_id, token)`` after ``at`` events; all events."""
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
        events, result = [], None
        for ev in iter_events(r):
            events.append(ev)
            if len(events) == at:
                result = edit(c, sid, token)
        return events, (sid, token, result)


def test_text_steer_over_http(srv: Any) -> None:
    def steer(c: httpx.Client, sid: str, token: str) -> httpx.Response:
        return c.post(f"{srv.url}/v1/streams/{sid}/steer", json={"instruction": "be brief"},
                      headers={"X-Resume-Token": token})

    events, (sid, _, resp) = _run(srv, "/v1/text", {"prompt": "hi", "max_new_tokens": 12}, steer)
    assert resp.status_code == 200 and resp.json() == {"stream_id": sid, "command": "steer", "accepted": True}
    final = events[-1]
    assert final["revision"] == 1 and final["revisions"][0]["kind"] == "steer"
    assert final["revisions"][0]["instruction"] == "be brief"
    assert _apply(events) == final["text"]


def test_text_rewind_over_http_and_resume_replays_it(srv: Any) -> None:
    def rewind(c: httpx.Client, sid: str, token: str) -> httpx.Response:
        return c.post(f"{srv.url}/v1/streams/{sid}/rewind?token={token}", json={"offset": 4, "instruction": "again"})

    events, (sid, token, resp) = _run(srv, "/v1/text", {"prompt": "hi", "max_new_tokens": 15}, rewind, at=4)
    assert resp.status_code == 200, resp.text
    final = events[-1]
    cut = next(e for e in events if e["revision"] == 1)
    assert cut["offset"] == 4
    assert _apply(events) == final["text"] and final["text"].startswith(" w0 ")
    assert final["revisions"] == [{"kind": "rewind", "step": final["revisions"][0]["step"], "offset": 4,
                                   "instruction": "again"}]
    # Resume from the start replays the same events, offsets and revisions included.
    with httpx.Client(timeout=60) as c, c.stream("GET", f"{srv.url}/v1/streams/{sid}/events?token={token}&after=-1") as r:
        replay = list(iter_events(r))
    assert replay == events
    assert event_from_dict(replay[-1]).text == final["text"]


def test_finish_text_and_image(srv: Any) -> None:
    def finish(c: httpx.Client, sid: str, token: str) -> httpx.Response:
        return c.post(f"{srv.url}/v1/streams/{sid}/finish", headers={"X-Resume-Token": token})

    events, (sid, token, resp) = _run(srv, "/v1/text", {"prompt": "hi", "max_new_tokens": 50}, finish)
    assert resp.json()["accepted"] is True
    assert events[-1]["finish_reason"] == "finished_early" and len(events) < 20
    again = httpx.post(f"{srv.url}/v1/streams/{sid}/finish", headers={"X-Resume-Token": token}, timeout=30)
    assert again.status_code == 200 and again.json()["accepted"] is False

    events, (sid, token, resp) = _run(srv, "/v1/image", {"prompt": "a red circle on a blue background"}, finish)
    final = event_from_dict(events[-1])
    assert isinstance(final, ImageEvent) and final.finish_reason == "finished_early" and final.step < 30
    assert final.mime == "image/png"


def test_image_steer_over_http(srv: Any) -> None:
    def steer(c: httpx.Client, sid: str, token: str) -> httpx.Response:
        return c.post(f"{srv.url}/v1/streams/{sid}/steer", json={"prompt": "a red circle on a yellow background",
                                                                 "guidance_scale": 6},
                      headers={"X-Resume-Token": token})

    events, (_, _, resp) = _run(srv, "/v1/image", {"prompt": "a red circle on a blue background"}, steer, at=2)
    assert resp.status_code == 200, resp.text
    final = event_from_dict(events[-1])
    r, g, b = final.image.convert("RGB").getpixel((0, 0))
    assert r > 200 and g > 200 and b < 80 and final.metrics["steers"] == 1


@pytest.mark.parametrize(
    "path, kind, body, status, message",
    [
        ("steer", "text", {"instruction": ""}, 400, "non-empty instruction"),
        ("steer", "text", {"prompt": "a cat"}, 400, "unknown prompt"),
        ("steer", "text", {"colour": "red"}, 400, "colour"),
        ("steer", "text", [1, 2], 400, "JSON object"),
        ("steer", "image", {"prompt": ""}, 400, "must not be empty"),
        ("steer", "image", {"instruction": "x", "prompt": "y"}, 400, "one prompt"),
        ("steer", "image", {}, 400, "at least one"),
        ("steer", "image", {"guidance_scale": "high"}, 400, "guidance_scale"),
        ("rewind", "text", {"offset": -1}, 400, "offset"),
        ("rewind", "text", {"offset": 100000}, 400, "offset must be an integer from 0 to"),
        ("rewind", "text", {}, 400, "offset"),
        ("rewind", "text", {"offset": 1, "temperature": -2}, 400, "temperature"),
        ("rewind", "image", {"offset": 0}, 400, "cannot rewind"),
        ("finish", "text", {"now": True}, 400, "no arguments"),
    ],
)
def test_bad_edits_are_4xx_with_the_models_message(srv: Any, path: str, kind: str, body: Any, status: int,
                                                   message: str) -> None:
    url = srv.url + ("/v1/text" if kind == "text" else "/v1/image")
    with httpx.Client(timeout=60) as c, c.stream("POST", url, json={"prompt": "a red circle on a blue background"}) as r:
        sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
        reader = iter_events(r)
        next(reader)
        resp = c.post(f"{srv.url}/v1/streams/{sid}/{path}", json=body, headers={"X-Resume-Token": token})
        assert resp.status_code == status, resp.text
        assert message in resp.json()["error"]["message"]
        c.delete(f"{srv.url}/v1/streams/{sid}", headers={"X-Resume-Token": token})
        events = [next(reader), *reader]
    assert events[-1]["finish_reason"] == "cancelled"  # the stream itself was left alone


def test_edits_are_owner_only_and_409_after_the_end(srv: Any, keyed: Any) -> None:
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 40}) as r:
            sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
            reader = iter_events(r)
            next(reader)
            for path in ("finish", "steer", "rewind"):
                for headers in ({}, {"X-Resume-Token": "wrong"}):
                    resp = c.post(f"{srv.url}/v1/streams/{sid}/{path}", json={"instruction": "x"}, headers=headers)
                    assert resp.status_code == 404, resp.text
            list(reader)
        for path, body in (("steer", {"instruction": "x"}), ("rewind", {"offset": 0})):
            resp = c.post(f"{srv.url}/v1/streams/{sid}/{path}", json=body, headers={"X-Resume-Token": token})
            assert resp.status_code == 409 and "already ended" in resp.json()["error"]["message"]
        assert c.post(f"{srv.url}/v1/streams/nope/steer", json={"instruction": "x"}).status_code == 404
        a, b = {"Authorization": "Bearer k"}, {"Authorization": "Bearer other"}
        with c.stream("POST", keyed.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 10}, headers=a) as r:
            sid = r.headers["x-stream-id"]
            reader = iter_events(r)
            next(reader)
            assert c.post(f"{keyed.url}/v1/streams/{sid}/steer", json={"instruction": "x"}, headers=b).status_code == 401
            resp = c.post(f"{keyed.url}/v1/streams/{sid}/steer", json={"instruction": "x"}, headers=a)
            assert resp.status_code == 200, resp.text
            assert list(reader)[-1]["revision"] == 1


def test_openapi_lists_the_edit_routes(srv: Any) -> None:
    paths = httpx.get(srv.url + "/openapi.json", timeout=30).json()["paths"]
    for name in ("finish", "steer", "rewind"):
        assert "post" in paths[f"/v1/streams/{{stream_id}}/{name}"]


async def test_websocket_edits(srv: Any) -> None:
    async with websockets.connect(srv.ws_url + "/v1/ws", open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "text", "id": "t", "prompt": "hi", "max_new_tokens": 20}))
        await ws.send(json.dumps({"type": "image", "id": "i", "prompt": "a red circle on a blue background"}))
        ids: dict[str, str] = {}
        events: dict[str, list[Any]] = {}
        controls: list[dict[str, Any]] = []
        sent = False
        while True:
            msg = decode_message(await asyncio.wait_for(ws.recv(), 60))
            if isinstance(msg, dict):
                if msg["type"] == "accepted":
                    ids[msg["id"]] = msg["stream_id"]
                else:
                    controls.append(msg)
                continue
            events.setdefault(msg.stream_id, []).append(msg)
            if not sent and len(ids) == 2 and len(events.get(ids["t"], [])) >= 3:
                sent = True
                t, i = ids["t"], ids["i"]
                for body in (
                    {"type": "steer", "id": "bad1", "stream_id": t, "instruction": ""},     # rejected
                    {"type": "rewind", "id": "bad2", "stream_id": i, "offset": 0},          # rejected
                    {"type": "steer", "id": "bad3", "stream_id": "nope", "instruction": "x"},
                    {"type": "rewind", "id": "ok1", "stream_id": t, "offset": 2, "instruction": "again"},
                    {"type": "steer", "id": "ok2", "stream_id": i, "prompt": "a red circle on a yellow background"},
                    {"type": "finish", "id": "ok3", "stream_id": i},
                ):
                    await ws.send(json.dumps(body))
            finals = [e for evs in events.values() for e in evs if e.is_final]
            if len(finals) == 2:
                break
        by_id = {c["id"]: c for c in controls}
        assert by_id["bad1"]["type"] == "rejected" and by_id["bad1"]["status"] == 400
        assert "non-empty instruction" in by_id["bad1"]["error"]["message"]
        assert by_id["bad2"]["status"] == 400 and "cannot rewind" in by_id["bad2"]["error"]["message"]
        assert by_id["bad3"]["status"] == 404
        for tag in ("ok1", "ok2", "ok3"):
            assert by_id[tag]["type"] == "edited" and by_id[tag]["accepted"] is True, by_id[tag]
        text_events: list[TextEvent] = events[ids["t"]]
        text = ""
        for e in text_events:
            text = text[: e.offset] + e.delta
        assert text == text_events[-1].text and text_events[-1].revisions[0]["kind"] == "rewind"
        image_final = events[ids["i"]][-1]
        assert image_final.finish_reason == "finished_early"
        # The socket is still usable after the rejections; an edit of an ended stream is a 409.
        await ws.send(json.dumps({"type": "steer", "id": "late", "stream_id": ids["t"], "instruction": "x"}))
        late = decode_message(await asyncio.wait_for(ws.recv(), 30))
        assert late["id"] == "late" and late["status"] == 409


def test_openai_stream_after_a_rewind_is_as_documented(keyed: Any) -> None:
    """An OpenAI streaming client cannot see a cut: its concatenation keeps the cut text."""
    a = {"Authorization": "Bearer k"}
    body = {"model": "default", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=60) as c, c.stream("POST", keyed.url + "/v1/chat/completions", json=body,
                                                 headers=a) as r:
        sid = r.headers["x-stream-id"]
        content, finish, n = "", None, 0
        from server_fixtures import iter_sse

        for sse in iter_sse(r):
            if "comment" in sse or sse["data"] == "[DONE]":
                continue
            choice = json.loads(sse["data"])["choices"][0]
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
            n += 1
            if n == 4:
                resp = c.post(f"{keyed.url}/v1/streams/{sid}/rewind", json={"offset": 0}, headers=a)
                assert resp.status_code == 200, resp.text
    # The real final text starts after the cut (the scripted model goes on with its script), but
    # the OpenAI client's content still begins with the text that was cut away.
    assert finish == "length"
    assert content.startswith(" w0 w1") and content == "".join(TOKENS[:8])


def test_rewind_through_the_content_filter() -> None:
    """The filter holds text back; a rewind must cut the held text too, and offsets stay the client's."""
    from multistream.server.streams.filtering import Blocklist

    tokens = [" alpha", " secret", " beta", " gamma", " delta", " eps", " zeta", " eta", " theta", " iota"] * 3
    with make_server(ScriptedTextModel(tokens, delay_s=0.04), content_filter=Blocklist(["secret"])) as s:
        def rewind(c: httpx.Client, sid: str, token: str) -> httpx.Response:
            return c.post(f"{s.url}/v1/streams/{sid}/rewind", json={"offset": 6}, headers={"X-Resume-Token": token})

        events, (sid, token, resp) = _run(s, "/v1/text", {"prompt": "hi", "max_new_tokens": 20}, rewind, at=3)
        assert resp.status_code == 200, resp.text
        final = events[-1]
        assert _apply(events) == final["text"]
        assert final["text"].startswith(" alpha") and "secret" not in final["text"]
        assert all(e["offset"] <= len(_apply(events[:i])) for i, e in enumerate(events))
        with httpx.Client(timeout=60) as c, c.stream("GET", f"{s.url}/v1/streams/{sid}/events?token={token}") as r:
            assert list(iter_events(r)) == events


@pytest.mark.model
def test_image_steer_over_http_with_the_embedded_model() -> None:
    """The whole chain: HTTP steer -> Stream.steer -> the pipeline's next step re-encoded."""
    import multistream as ms

    sd = ms.load_image_model(device="cpu")
    try:
        with make_server(None, sd) as s:
            def steer(c: httpx.Client, sid: str, token: str) -> httpx.Response:
                return c.post(f"{s.url}/v1/streams/{sid}/steer", json={"prompt": "a red circle on a yellow background"},
                              headers={"X-Resume-Token": token})

            body = {"prompt": "a red circle on a blue background", "steps": 60, "seed": 0, "preview": "x0"}
            events, (_, _, resp) = _run(s, "/v1/image", body, steer, at=2)
            assert resp.status_code == 200, resp.text
            final = event_from_dict(events[-1])
            assert final.finish_reason == "stop" and final.metrics["steers"] == 1
            import numpy as np

            a = np.asarray(final.image.convert("RGB")).astype(int)
            r, g, b = np.concatenate([a[:6, :6].reshape(-1, 3), a[-6:, -6:].reshape(-1, 3)]).mean(0)
            assert r > 150 and g > 150 and b < 100, (r, g, b)  # yellow, not blue
    finally:
        sd.close()
