"""Every option of every family, from every surface: the Python call, ``POST /v1/text`` and
``/v1/image``, the WebSocket and the Ray ingress's own check. A good value reaches the model; a bad
one is refused everywhere with the very message ``stream()`` raises (over HTTP and the WebSocket in
JSON's words: ``null`` for ``None``). The bodies and the options are one definition, so
``/openapi.json`` lists exactly the Python options."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets

import multistream as ms
from multistream.image import IMAGE_STREAM_ARGS, ImageOptions, parse_image_options
from multistream.server.http.problems import json_spelling
from multistream.server.ray import RemoteModel
from multistream.text import TEXT_STREAM_ARGS, TextOptions, parse_text_options

from server_fixtures import ScriptedImageModel, ScriptedTextModel, make_server

# One good and one bad value per option (JSON values, as a client sends them).
TEXT_VALUES: dict[str, tuple[Any, Any]] = {
    "max_new_tokens": (7, 0),
    "temperature": (0.5, -1),
    "top_p": (0.9, 2),
    "top_k": (5, -3),
    "repetition_penalty": (1.2, 0),
    "seed": (11, -1),
    "stop": (["zz"], [""]),
    "chunk_tokens": (2, 0),
    "chunk_ms": (5.0, -5),
    "chat": (False, "yes"),
    "allowed": (["yes", "no"], "("),
    "priority": (3, 1.5),
    "logprobs": (True, "yes"),
    "top_logprobs": (3, 21),
    "presence_penalty": (0.5, 3),
    "frequency_penalty": (-0.5, -2.5),
    "logit_bias": ({"5": -100}, {"x": 1}),
    "min_p": (0.1, 1.5),
    "json_schema": ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "strin"}),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              [{"type": "function", "function": {"name": "bad name"}}]),
    "tool_choice": ("auto", "always"),
    "parallel_tool_calls": (False, "yes"),
    "num_beams": (2, 9),
    "length_penalty": (0.5, 1000),
    "early_stopping": (True, "soon"),
    "stop_on_repetition": (True, "yes"),
    "speculate": (3, "fast"),
    "cache_salt": ("tenant-1", ""),
}
IMAGE_VALUES: dict[str, tuple[Any, Any]] = {
    "negative_prompt": ("blurry", 3),
    "steps": (3, 0),
    "guidance_scale": (2.0, -1),
    "height": (32, 0),
    "width": (32, -8),
    "seed": (5, -1),
    "num_images": (1, 0),
    "preview": ("x0", "sparkles"),
    "preview_every": (2, 0),
    "preview_format": ("png", "gif"),
    "preview_quality": (50, 500),
    "preview_max_side": (16, 0),
    "final_format": ("jpeg", "tiff"),
    "final_quality": (90, 0),
    "priority": (2, "high"),
}


def test_the_tables_cover_every_option() -> None:
    assert set(TEXT_VALUES) == set(TEXT_STREAM_ARGS)
    assert set(IMAGE_VALUES) == set(IMAGE_STREAM_ARGS)


def python_message(kind: str, name: str, value: Any) -> str:
    with pytest.raises(ms.InvalidArgumentError) as info:
        if kind == "text":
            parse_text_options(**{name: value})
        else:
            parse_image_options("a red circle", **{name: value})
    return str(info.value)


@pytest.fixture(scope="module")
def srv():  # type: ignore[no-untyped-def]
    text = ScriptedTextModel(["yes"], context_length=4096)
    image = ScriptedImageModel(steps=2, size=32)
    with make_server(text, image, max_steps=50, max_priority=10) as s:  # priorities up to 10 pass uncapped
        s.text, s.image = text, image  # type: ignore[attr-defined]
        yield s


@pytest.mark.parametrize("name", sorted(TEXT_VALUES))
def test_text_option_good_reaches_the_model_and_bad_gets_the_python_message_everywhere(srv: Any, name: str) -> None:
    good, bad = TEXT_VALUES[name]
    message = python_message("text", name, bad)
    body = {"prompt": "Is fire hot?", "max_new_tokens": 4, name: good}
    with httpx.Client(timeout=30) as client:
        r = client.post(srv.url + "/v1/text", json=body)
        assert r.status_code == 200, r.text
        r.read()
        call = srv.text.calls[-1]
        expected = parse_text_options(**{name: good})
        assert getattr(parse_text_options(**{k: v for k, v in call.items() if k in TEXT_STREAM_ARGS}), name) == getattr(
            expected, name)
        r = client.post(srv.url + "/v1/text", json={"prompt": "hi", name: bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == json_spelling(message)
    assert ws_refusal(srv, {"type": "text", "id": "x", "prompt": "hi", name: bad}) == json_spelling(message)
    with pytest.raises(ms.InvalidArgumentError) as info:  # the Ray ingress checks before it calls a replica
        RemoteModel("text", handle=None).stream(prompt="hi", **{name: bad})
    assert str(info.value) == message
    with pytest.raises(ms.InvalidArgumentError) as info:  # the scripted fake, as the real model
        ScriptedTextModel().stream("hi", **{name: bad})
    assert str(info.value) == message


@pytest.mark.parametrize("name", sorted(IMAGE_VALUES))
def test_image_option_good_reaches_the_model_and_bad_gets_the_python_message_everywhere(srv: Any, name: str) -> None:
    good, bad = IMAGE_VALUES[name]
    message = python_message("image", name, bad)
    with httpx.Client(timeout=30) as client:
        r = client.post(srv.url + "/v1/image", json={"prompt": "a red circle", name: good})
        assert r.status_code == 200, r.text
        r.read()
        call = srv.image.calls[-1]
        expected = getattr(parse_image_options("a red circle", **{name: good}), name)
        got = call[name]
        assert (expected.mode if name == "preview" else expected) == got
        r = client.post(srv.url + "/v1/image", json={"prompt": "a red circle", name: bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == json_spelling(message)
    assert ws_refusal(srv, {"type": "image", "id": "x", "prompt": "a red circle", name: bad}) == json_spelling(message)
    with pytest.raises(ms.InvalidArgumentError) as info:
        RemoteModel("image", handle=None).stream(prompt="a red circle", **{name: bad})
    assert str(info.value) == message
    with pytest.raises(ms.InvalidArgumentError) as info:
        ScriptedImageModel().stream("a red circle", **{name: bad})
    assert str(info.value) == message


def ws_refusal(srv: Any, message: dict[str, Any]) -> str:
    async def run() -> str:
        async with websockets.connect(srv.ws_url + "/v1/ws", open_timeout=30) as ws:
            await ws.send(json.dumps(message))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert reply["type"] == "rejected" and reply["status"] == 400, reply
            return str(reply["error"]["message"])

    return asyncio.run(run())


def test_openapi_bodies_are_the_python_options(srv: Any) -> None:
    schema = httpx.get(srv.url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    import dataclasses

    for body, options in (("TextBody", TextOptions), ("ImageBody", ImageOptions)):
        props = schema[body]["properties"]
        fields = {f.name: f for f in dataclasses.fields(options) if "option" in f.metadata}
        assert set(props) == set(fields) | {"prompt"}
        for name, field in fields.items():
            assert props[name]["description"] == field.metadata["option"].doc
    # the Python default (the model's generation_config), not a server's own 0.0
    assert schema["TextBody"]["properties"]["temperature"].get("default") is None


@pytest.mark.model
def test_allowed_reaches_the_real_model_over_http() -> None:
    llm = ms.load_text_model()
    try:
        with make_server(llm) as live, httpx.Client(timeout=120) as client:
            r = client.post(live.url + "/v1/text", json={"prompt": "Is fire hot? Answer yes or no.",
                                                          "allowed": ["yes", "no"], "max_new_tokens": 8})
            assert r.status_code == 200, r.text
            finals = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
            assert finals[-1]["is_final"] and finals[-1]["text"] in ("yes", "no")
    finally:
        llm.close()
