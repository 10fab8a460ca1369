"""`POST /v1/text` takes a whole tool conversation natively (issue 26, item 4): an assistant turn with
`tool_calls` (content null) and the `tool` turn answering it, as `check_messages` and OpenAI accept."""

from __future__ import annotations

import httpx

from multistream.testing import ScriptedTextModel

from server_fixtures import iter_events, make_server

CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature_c\": 21}"},
]


def test_a_tool_conversation_streams() -> None:
    model = ScriptedTextModel(["It is", " 21 C."])
    with make_server(model) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": CONVERSATION}, timeout=30) as r:
            assert r.status_code == 200, r.read()
            events = list(iter_events(r))
    assert events[-1]["is_final"] and events[-1]["text"] == "It is 21 C."
    prompt = model.calls[-1]["prompt"]
    assert prompt[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    assert prompt[1]["content"] == "" and prompt[2] == {"role": "tool", "content": "{\"temperature_c\": 21}",
                                                        "tool_call_id": "call_1"}


def test_bad_tool_turns_are_4xx_with_the_cause() -> None:
    with make_server(ScriptedTextModel(["x"])) as srv:
        bad_call = [CONVERSATION[0], {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]
        r = httpx.post(srv.url + "/v1/text", json={"prompt": bad_call}, timeout=30)
        assert r.status_code in (400, 422) and "prompt" in r.json()["error"]["message"], r.text
        no_content = [{"role": "user", "content": None}]
        r = httpx.post(srv.url + "/v1/text", json={"prompt": no_content}, timeout=30)
        assert r.status_code in (400, 422) and "content" in r.json()["error"]["message"], r.text


def test_an_unknown_role_is_a_400_naming_the_roles() -> None:
    with make_server(ScriptedTextModel(["x"])) as srv:
        r = httpx.post(srv.url + "/v1/text", json={"prompt": [{"role": "robot", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"] == {
        "type": "invalid_argument",
        "message": "messages[0]['role'] is 'robot'; a chat message's role is one of system, developer, user, assistant, tool"}


def test_openapi_describes_the_tool_turns() -> None:
    with make_server(ScriptedTextModel(["x"])) as srv:
        spec = httpx.get(srv.url + "/openapi.json").json()
    message = spec["components"]["schemas"]["ChatMessage"]["properties"]
    assert {"tool_calls", "tool_call_id", "content", "role", "name"} <= set(message)
