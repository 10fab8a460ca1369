"""The WebSocket route: JSON events, binary image frames, several streams per socket, cancel."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets

from multistream import ImageEvent, TextEvent
from multistream.server import decode_message

from server_fixtures import ScriptedImageModel, ScriptedTextModel, make_server


@pytest.fixture(scope="module")
def srv():  # type: ignore[no-untyped-def]
    text = ScriptedTextModel([f" t{i}" for i in range(200)], delay_s=0.03)
    with make_server(text, ScriptedImageModel(steps=4, size=32, delay_s=0.03), api_key="k") as s:
        yield s


def connect(srv: Any, key: str = "k") -> Any:
    return websockets.connect(srv.ws_url + "/v1/ws", additional_headers={"Authorization": f"Bearer {key}"},
                              open_timeout=30)


async def test_text_and_image_on_one_socket_then_cancel(srv: Any) -> None:
    async with connect(srv) as ws:
        await ws.send(json.dumps({"type": "text", "id": "a", "prompt": "hi", "max_new_tokens": 200}))
        await ws.send(json.dumps({"type": "image", "id": "b", "prompt": "a red circle"}))
        accepted: dict[str, str] = {}
        by_stream: dict[str, list[Any]] = {}
        cancelled = False
        while True:
            raw = await asyncio.wait_for(ws.recv(), 60)
            msg = decode_message(raw)
            if isinstance(msg, dict):
                assert msg["type"] == "accepted", msg
                accepted[msg["id"]] = msg["stream_id"]
                continue
            by_stream.setdefault(msg.stream_id, []).append(msg)
            if isinstance(msg, ImageEvent):
                assert isinstance(raw, bytes)  # frames travel as binary, not base64
            if isinstance(msg, TextEvent) and msg.seq == 3 and not cancelled:
                await ws.send(json.dumps({"type": "cancel", "stream_id": msg.stream_id}))
                cancelled = True
            finals = [evs[-1] for evs in by_stream.values() if evs[-1].is_final]
            if len(finals) == 2:
                break
        text_events, image_events = by_stream[accepted["a"]], by_stream[accepted["b"]]
        for evs in (text_events, image_events):
            assert [e.seq for e in evs] == list(range(len(evs)))
        assert text_events[-1].finish_reason == "cancelled" and len(text_events) < 50
        assert "".join(e.delta for e in text_events) == text_events[-1].text
        assert image_events[-1].finish_reason == "stop" and image_events[-1].image.size == (32, 32)
        assert image_events[0].mime == "image/jpeg" and image_events[0].image.size == (32, 32)


async def test_bad_requests_are_rejected_and_socket_survives(srv: Any) -> None:
    async with connect(srv) as ws:
        for bad in ["{oops", json.dumps({"type": "video", "id": 1}), json.dumps({"type": "text", "id": 2}),
                    json.dumps({"type": "text", "id": 3, "prompt": "hi", "max_new_tokens": 0}),
                    json.dumps({"type": "cancel", "stream_id": "none"})]:
            await ws.send(bad)
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert msg["type"] == "rejected" and msg["status"] in (400, 404) and msg["error"]["message"], msg
        await ws.send(b"\x00binary")
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["status"] == 400
        await ws.send(json.dumps({"type": "text", "id": "ok", "prompt": "hi", "max_new_tokens": 2}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "accepted"
        events = []
        while not events or not events[-1].is_final:
            events.append(decode_message(await asyncio.wait_for(ws.recv(), 30)))
        assert events[-1].finish_reason == "length"


async def test_websocket_requires_key(srv: Any) -> None:
    with pytest.raises(websockets.exceptions.InvalidStatus) as info:
        async with connect(srv, key="wrong"):
            pass
    assert info.value.response.status_code == 401
    # ?api_key= is not taken on the WebSocket (it would land in access logs): the first message must
    # then authenticate, and anything else is refused.
    async with websockets.connect(srv.ws_url + "/v1/ws?api_key=k", open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "text", "prompt": "hi", "max_new_tokens": 1}))
        msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert msg["type"] == "rejected" and msg["status"] == 401
    # Browsers cannot set headers on a WebSocket: the key comes as a subprotocol or a first message.
    async with websockets.connect(srv.ws_url + "/v1/ws", subprotocols=["multistream", "bearer.k"],  # type: ignore[list-item]
                                  open_timeout=30) as ws:
        assert ws.subprotocol == "multistream"
        await ws.send(json.dumps({"type": "text", "prompt": "hi", "max_new_tokens": 1}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "accepted"
    async with websockets.connect(srv.ws_url + "/v1/ws", open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": "k"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "authenticated"
        await ws.send(json.dumps({"type": "text", "prompt": "hi", "max_new_tokens": 1}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "accepted"
