"""Structured outputs and tool calls through real clients against a real uvicorn serving the embedded
model: the openai SDK (streamed tool_calls deltas, ``parse()`` and ``stream()`` helpers, a follow-up
with a tool message) and LangChain (``with_structured_output(method="json_schema")``, ``bind_tools``
streaming)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from server_fixtures import make_server

pytestmark = pytest.mark.model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def srv(text_model):  # type: ignore[no-untyped-def]
    with make_server(text_model) as s:
        yield s


@pytest.fixture()
def client(srv) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _collect_tool_deltas(chunks: list) -> tuple[dict[int, dict], list[str | None]]:
    calls: dict[int, dict] = {}
    finishes = []
    for c in chunks:
        if not c.choices:
            continue
        finishes.append(c.choices[0].finish_reason)
        for d in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"first": d, "fragments": []})
            if d.function and d.function.arguments:
                entry["fragments"].append(d.function.arguments)
    return calls, [f for f in finishes if f]


def test_tools_required_and_named_stream_as_tool_calls(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                                 parallel_tool_calls=False, stream=True, max_tokens=60, temperature=0))
    calls, finishes = _collect_tool_deltas(chunks)
    assert finishes == ["tool_calls"] and list(calls) == [0]
    first = calls[0]["first"]
    assert first.id and first.type == "function" and first.function.name in ("get_weather", "get_time")
    assert len(calls[0]["fragments"]) > 2  # the arguments arrive in pieces, as they are generated
    json.loads("".join(calls[0]["fragments"]))
    named = list(client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], stream=True, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False))
    calls, finishes = _collect_tool_deltas(named)
    assert finishes == ["tool_calls"] and calls[0]["first"].function.name == "get_time"
    assert set(json.loads("".join(calls[0]["fragments"]))) == {"zone"}


def test_a_follow_up_with_the_tool_result_is_answered(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=60, temperature=0)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    follow = client.chat.completions.create(model="default", max_tokens=40, temperature=0, tools=[WEATHER], messages=[
        *ASK, message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "sunny"}'}])
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.content


def test_the_sdk_parse_and_stream_helpers_return_parsed_objects(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Name a city in Italy as JSON."}]
    parsed = client.chat.completions.parse(model="default", messages=msgs, response_format=City, max_tokens=60,
                                           temperature=0)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    with client.chat.completions.stream(model="default", messages=msgs, response_format=City, max_tokens=60,
                                        temperature=0) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_completion()
    assert kinds.count("content.delta") > 3 and final.choices[0].message.parsed == city


def test_langchain_structured_output_and_bound_tools_streaming(srv) -> None:  # type: ignore[no-untyped-def]
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model="default", temperature=0, max_tokens=60,
                     max_retries=0, timeout=300)
    city = llm.with_structured_output(City, method="json_schema").invoke("Name a city in France as JSON.")
    assert isinstance(city, City) and city.name

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    gathered = None
    pieces = 0
    for chunk in bound.stream("What is the weather in Rome?"):
        gathered = chunk if gathered is None else gathered + chunk
        pieces += bool(chunk.tool_call_chunks)
    assert pieces > 2 and gathered is not None
    assert [c["name"] for c in gathered.tool_calls] == ["get_weather"]
    assert isinstance(gathered.tool_calls[0]["args"]["city"], str)
