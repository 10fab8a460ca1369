"""`InvalidArgumentError.param` (issue 35, item 3): the option at fault is named where the error is
raised (an option's own check gets it from its declaration; a check spanning options names the one
to change), and the server's 400s carry it as OpenAI's ``param`` without reading the message."""

from __future__ import annotations

import pickle
from typing import Any

import httpx
import pytest
from test_options_surfaces import IMAGE_VALUES, TEXT_VALUES

import multistream as ms
from multistream.image import parse_image_options
from multistream.server import create_app
from multistream.speech import parse_speech_options
from multistream.testing import ScriptedSpeechModel
from multistream.text import parse_text_options

from server_fixtures import ScriptedTextModel, live_server


@pytest.mark.parametrize("name", sorted(TEXT_VALUES))
def test_a_text_options_check_names_it(name: str) -> None:
    with pytest.raises(ms.InvalidArgumentError) as info:
        parse_text_options(**{name: TEXT_VALUES[name][1]})
    assert info.value.param == name


@pytest.mark.parametrize("name", sorted(IMAGE_VALUES))
def test_an_image_options_check_names_it(name: str) -> None:
    with pytest.raises(ms.InvalidArgumentError) as info:
        parse_image_options("a red circle", **{name: IMAGE_VALUES[name][1]})
    assert info.value.param == name


@pytest.mark.parametrize(("options", "param"), [
    ({"allowed": "yes|no", "json_schema": {"type": "object"}}, "allowed"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"num_beams": 2, "temperature": 0.7}, "num_beams"),
    ({"num_beams": 2, "stop": ["x"]}, "num_beams"),
    ({"temprature": 0.5}, "temprature"),  # an unknown name is the one at fault
])
def test_a_check_spanning_options_names_the_one_to_change(options: dict[str, Any], param: str) -> None:
    with pytest.raises(ms.InvalidArgumentError) as info:
        parse_text_options(**options)
    assert info.value.param == param


def test_speech_and_the_text_itself() -> None:
    with pytest.raises(ms.InvalidArgumentError) as info:
        parse_speech_options("Hello.", speed=9)
    assert info.value.param == "speed"
    with pytest.raises(ms.InvalidArgumentError) as info:
        parse_speech_options("   ")
    assert info.value.param is None  # the text is no option: the route names its own field for it


def test_param_survives_pickling() -> None:
    """A Ray replica's error reaches the ingress pickled."""
    err = pickle.loads(pickle.dumps(ms.InvalidArgumentError("top_p must be in (0, 1]", param="top_p")))
    assert err.param == "top_p" and str(err) == "top_p must be in (0, 1]"


@pytest.fixture(scope="module")
def url() -> Any:
    app = create_app(text_model=ScriptedTextModel(["yes"]), speech_model=ScriptedSpeechModel())
    with live_server(app) as live:
        yield live.url


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "num_beams": 2, "temperature": 0.7}, "num_beams"),
    ("/v1/chat/completions", {**CHAT, "speculate": "fast"}, "speculate"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/responses", {"input": "hi", "min_p": 2}, "min_p"),
    ("/v1/audio/speech", {"model": "tts-1", "input": "Hello.", "speed": 9}, "speed"),
    ("/v1/audio/speech", {"model": "tts-1", "input": "   "}, "input"),
])
def test_the_openai_400_names_the_param(url: str, route: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
