"""``multistream serve --speculate auto|0|N`` (issue 32, item 5): the server's lookahead for text
requests that do not say; a request's own ``speculate`` wins, on every text route."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import multistream as ms
from multistream.cli import build_parser
from multistream.server import ServerSettings
from multistream.testing import ScriptedTextModel

from server_fixtures import iter_events, make_server

ROUTES: dict[str, dict[str, Any]] = {
    "/v1/text": {"prompt": "hi", "max_new_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}


@pytest.mark.parametrize("setting", [0, 4, "auto"])
def test_the_server_default_applies_and_a_request_wins(setting: Any) -> None:
    text = ScriptedTextModel(["a", "b"])
    with make_server(text, speculate=setting) as live, httpx.Client(timeout=30) as client:
        for route, body in ROUTES.items():
            r = client.post(live.url + route, json=body)
            assert r.status_code == 200, (route, r.text)
            assert text.calls[-1]["speculate"] == setting, route
            r = client.post(live.url + route, json={**body, "speculate": 2})
            assert r.status_code == 200, (route, r.text)
            assert text.calls[-1]["speculate"] == 2, route  # the request's own value
            if route == "/v1/text":
                continue  # the native body takes the spec's values only; an OpenAI body's null means "not given"
            r = client.post(live.url + route, json={**body, "speculate": None})
            assert r.status_code == 200, (route, r.text)
            assert text.calls[-1]["speculate"] == setting, route  # null: not given


def test_the_setting_is_checked_as_the_option_is() -> None:
    assert ServerSettings(speculate="3").speculate == 3
    assert ServerSettings.from_env(speculate="0").speculate == 0
    with pytest.raises(ms.InvalidArgumentError) as info:
        ServerSettings(speculate="fast")
    assert info.value.param == "speculate" and '"auto", 0 (off) or an integer' in str(info.value)
    with pytest.raises(ms.InvalidArgumentError):
        ServerSettings(speculate=33)


def test_the_flag_reaches_the_settings() -> None:
    args = build_parser().parse_args(["serve", "--speculate", "0"])
    assert args.speculate == "0"
    assert ServerSettings(speculate=args.speculate).speculate == 0
    assert build_parser().parse_args(["serve"]).speculate is None  # not given: the settings' default


@pytest.mark.model
def test_the_real_model_drafts_or_not_as_the_server_says() -> None:
    """A copying prompt: the default drafts; ``--speculate 0`` does not, unless the request asks."""
    llm = ms.load_text_model()
    article = "The quick brown fox jumps over the lazy dog. " * 6
    body = {"prompt": [{"role": "user", "content": f"Repeat exactly: {article}"}], "max_new_tokens": 48,
            "temperature": 0}

    def final(live: Any, extra: dict[str, Any]) -> dict[str, Any]:
        with httpx.Client(timeout=300) as client, client.stream("POST", live.url + "/v1/text",
                                                                 json={**body, **extra}) as r:
            assert r.status_code == 200
            return [ev for ev in iter_events(r) if ev.get("is_final")][-1]

    try:
        with make_server(llm) as live:
            drafting = final(live, {})
        with make_server(llm, speculate=0) as live:
            off = final(live, {})
            asked = final(live, {"speculate": "auto"})
    finally:
        llm.close()
    assert drafting["metrics"]["drafted_tokens"] > 0
    assert off["metrics"].get("drafted_tokens", 0) == 0
    assert asked["metrics"]["drafted_tokens"] > 0
    assert off["text"] == drafting["text"] == asked["text"]  # exact: the same text either way
