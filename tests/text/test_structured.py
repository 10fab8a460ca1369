"""Structured outputs and tools: json_schema= (dict or pydantic class), tools= with final.tool_calls,
their checks (the bad part named, compilation under a time limit), the tool-call parser, the wire
form, and batching (a constrained row leaves its batch mates exact)."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest
from pydantic import BaseModel

import multistream as ms
from multistream.server import ServerSettings
from multistream.server.http.problems import Problem
from multistream.server.openai.chat.protocol import chat_kwargs
from multistream.text import ToolCallParser, _schemas, parse_text_options, parse_tool_calls

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str
    species: str
    legs: int


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"],
                   "additionalProperties": False}}}


# -- checks (no model) ---------------------------------------------------------------------------


def test_json_schema_takes_a_dict_a_pydantic_class_or_json_text() -> None:
    from_dict = parse_text_options(json_schema=PERSON).json_schema
    assert json.loads(from_dict) == PERSON
    assert list(json.loads(from_dict)["properties"]) == ["name", "age", "city"]  # order kept: generation order
    # A class's objects are closed (its fields only), as the openai SDK's strict mode does.
    assert json.loads(parse_text_options(json_schema=Pet).json_schema) == {**Pet.model_json_schema(),
                                                                           "additionalProperties": False}
    assert parse_text_options(json_schema=from_dict).json_schema == from_dict  # the stored form parses again


@pytest.mark.parametrize("schema, part", [
    ({"type": "strin"}, "at /type"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}, "at /properties/a/minimum"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "at /properties/a/not"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/$defs/missing"),
    ({"type": "string", "pattern": "(a"}, "at /pattern"),
])
def test_a_bad_schema_is_a_clear_error_naming_the_part(schema: dict, part: str) -> None:
    with pytest.raises(ms.InvalidArgumentError) as info:
        parse_text_options(json_schema=schema)
    assert part in str(info.value) and "json_schema" in str(info.value)


def test_other_bad_values_are_clear_errors() -> None:
    cases = [
        (dict(json_schema=42), "JSON Schema (a dict) or a pydantic model class"),
        (dict(json_schema="{nope"), "not JSON"),
        (dict(allowed="a(", ), "not a valid regular expression"),
        (dict(allowed="yes", json_schema=PERSON), "give one"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
        (dict(tools=[WEATHER, WEATHER]), "used twice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]),
         "tools[0].function.parameters is not a valid JSON Schema at /type"),
        (dict(tool_choice="required"), "needs tools"),
        (dict(tools=[WEATHER], tool_choice="always"), "tool_choice must be"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools"),
        (dict(tools=[WEATHER], allowed="x"), "cannot constrain one answer together"),
        (dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ms.InvalidArgumentError, match=None) as info:
            parse_text_options(**kwargs)
        assert message in str(info.value), (kwargs, str(info.value))


def test_compilation_has_a_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ms.InvalidArgumentError, match="took more than 0.05 s to compile"):
        _schemas.limited(lambda: time.sleep(1), "the grammar", timeout_s=0.05)
    monkeypatch.setattr(_schemas, "COMPILE_TIMEOUT_S", 1e-9)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,40}@[a-z]{2,30}"}
                                            for i in range(200)}}
    with pytest.raises(ms.InvalidArgumentError, match="to compile; simplify it"):
        parse_text_options(json_schema=big)


def test_the_tool_call_parser_streams_calls_in_pieces() -> None:
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris {1}", "unit": "celsius"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_tool_calls(text, "s")
    assert content == "Let me check. "
    assert calls == [{"id": "call_s_0", "name": "get_weather", "arguments": '{"city": "Paris {1}", "unit": "celsius"}'},
                     {"id": "call_s_1", "name": "get_time", "arguments": '{"zone": "CET"}'}]
    parser = ToolCallParser("s")
    items = [item for ch in text for item in parser.feed(ch)] + parser.finish()
    assert "".join(i[1] for i in items if i[0] == "content") == content
    assert [i for i in items if i[0] == "call"] == [("call", 0, "call_s_0", "get_weather"), ("call", 1, "call_s_1", "get_time")]
    fragments = [i[2] for i in items if i[0] == "arguments" and i[1] == 0]
    assert len(fragments) > 10 and "".join(fragments) == calls[0]["arguments"]
    assert parser.calls == calls
    assert parse_tool_calls("no calls here <tool", "s") == ("no calls here <tool", [])
    cut = parse_tool_calls(text[:60], "s")  # cut inside the first call's arguments: no complete call
    assert cut == ("Let me check. ", [])


def test_tool_calls_on_the_final_event_round_trip_and_follow_the_schema() -> None:
    calls = [{"id": "call_s_0", "name": "f", "arguments": '{"a": 1}'}]
    final = ms.TextEvent(stream_id="s", seq=3, t=0.5, delta="", is_final=True, finish_reason="stop", text="x",
                         usage={"prompt_tokens": 1, "completion_tokens": 1}, metrics={}, tool_calls=calls)
    wire = final.to_dict()
    assert wire["tool_calls"] == calls and ms.event_from_dict(wire) == final
    jsonschema.validate(wire, ms.event_json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**wire, "tool_calls": [{"id": "x"}]}, ms.event_json_schema())
    assert "tool_calls" not in ms.TextEvent(stream_id="s", seq=0, t=0, delta="a").to_dict()


def test_openai_bodies_convert_response_format_and_tools() -> None:
    settings = ServerSettings()
    base = {"messages": [{"role": "user", "content": "hi"}]}
    kwargs, *_ = chat_kwargs({**base, "response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}}, settings)
    assert kwargs["json_schema"] == PERSON
    kwargs, *_ = chat_kwargs({**base, "response_format": {"type": "json_object"}}, settings)
    assert kwargs["json_schema"] == {"type": "object"}
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        with pytest.raises(Problem) as info:
            chat_kwargs({**base, "response_format": bad}, settings)
        assert info.value.status == 400 and info.value.param == "response_format"
    kwargs, *_ = chat_kwargs({**base, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
                             settings)
    assert (kwargs["tools"], kwargs["tool_choice"], kwargs["parallel_tool_calls"]) == ([WEATHER], "required", False)
    follow_up = [{"role": "user", "content": "weather?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    kwargs, *_ = chat_kwargs({"messages": follow_up, "tools": [WEATHER]}, settings)
    assert kwargs["prompt"][1]["tool_calls"][0]["id"] == "c1" and kwargs["prompt"][2]["tool_call_id"] == "c1"
    assert ms.text.check_messages(kwargs["prompt"])[1]["content"] == ""


def test_the_fake_accepts_what_the_model_accepts() -> None:
    from multistream.testing import ScriptedTextModel

    fake = ScriptedTextModel(["{}"])
    assert fake.generate("x", json_schema=Pet, tools=[WEATHER], tool_choice="auto").text == "{}"
    with pytest.raises(ms.InvalidArgumentError, match="at /type"):
        fake.stream("x", json_schema={"type": "strin"})


# -- the real embedded model ------------------------------------------------------------------------


@pytest.mark.model
def test_schema_dict_and_pydantic_class_validate(text_model) -> None:
    final = text_model.generate("Describe a person who lives in Europe, as JSON.", json_schema=PERSON,
                                max_new_tokens=64)
    assert final.finish_reason == "stop", final.text
    jsonschema.validate(json.loads(final.text), PERSON)
    pet = text_model.generate("Describe a pet as JSON.", json_schema=Pet, max_new_tokens=64, temperature=0.8, seed=2)
    assert pet.finish_reason == "stop", pet.text
    Pet.model_validate_json(pet.text)
    assert "".join(ev.delta for ev in text_model.stream("A pet as JSON", json_schema=Pet, max_new_tokens=64)) \
        == text_model.generate("A pet as JSON", json_schema=Pet, max_new_tokens=64).text


@pytest.mark.model
def test_tools_required_and_named_give_calls_on_the_final_event(text_model) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    final = text_model.generate(msgs, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                max_new_tokens=80)
    assert final.finish_reason == "stop" and len(final.tool_calls) == 1, final.text
    call = final.tool_calls[0]
    assert call["name"] in ("get_weather", "get_time") and call["id"] == f"call_{final.stream_id}_0"
    schema = (WEATHER if call["name"] == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(json.loads(call["arguments"]), schema)
    named = text_model.generate(msgs, tools=[WEATHER, TIME], parallel_tool_calls=False, max_new_tokens=80,
                                tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c["name"] for c in named.tool_calls] == ["get_time"], named.text
    jsonschema.validate(json.loads(named.tool_calls[0]["arguments"]), TIME["function"]["parameters"])
    plain = text_model.generate(msgs, tools=[WEATHER], tool_choice="none", max_new_tokens=8)
    assert plain.tool_calls is None and "<tool_call>" not in plain.text


@pytest.mark.model
def test_a_constrained_row_leaves_its_batch_mates_exact(text_model) -> None:
    prompt = "Write one sentence about the sea."
    alone = text_model.generate(prompt, max_new_tokens=24, temperature=0)
    results: dict[str, ms.TextEvent] = {}
    steps_before = text_model._batcher.steps

    def run(name: str, **kw: object) -> None:
        results[name] = text_model.generate(**kw)

    threads = [threading.Thread(target=run, args=("json",), kwargs=dict(
                   prompt="A person as JSON", json_schema=PERSON, max_new_tokens=48, temperature=0.7, seed=1)),
               threading.Thread(target=run, args=("plain",), kwargs=dict(prompt=prompt, max_new_tokens=24,
                                                                        temperature=0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["plain"].text == alone.text
    jsonschema.validate(json.loads(results["json"].text), PERSON)
    shared = text_model._batcher.steps - steps_before
    # They shared steps: fewer decode steps than the two streams' tokens one after the other.
    assert shared < results["plain"].usage["completion_tokens"] + results["json"].usage["completion_tokens"] - 2


@pytest.mark.model
def test_a_rewound_constrained_stream_stays_valid(text_model) -> None:
    with text_model.stream("A pet as JSON", json_schema=Pet, max_new_tokens=64, chunk_tokens=1) as s:
        text, rewound = "", False
        for ev in s:
            text = text[: ev.offset] + ev.delta
            if not rewound and len(text) > 12:
                s.rewind(5)
                rewound = True
        assert ev.is_final and ev.revision == 1
    Pet.model_validate_json(ev.text)
