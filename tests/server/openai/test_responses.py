"""OpenAI's Responses API through the official ``openai`` SDK (and the OpenAI Agents SDK) against a real
uvicorn on 127.0.0.1: create (streamed and not), the ``responses.stream()`` helper,
``previous_response_id``, a function tool, background + ``retrieve(id, stream=True, starting_after=N)``,
cancel, DELETE, input_items, owners and OpenAI's error shape. The machinery runs on scripted fakes;
JSON schema, a function tool and an agent also run on the embedded model (marked ``model``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from server_fixtures import ScriptedTextModel, make_server, wait_until

CALL = ['<tool_call>', '{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}', '</tool_call>']
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}


class ToolThenAnswer(ScriptedTextModel):
    """Calls get_weather, then (once the tool's answer is in the conversation) answers in words."""

    def stream(self, prompt: Any, **options: Any) -> Any:
        answered = isinstance(prompt, list) and prompt[-1]["role"] == "tool"
        self.tokens = ["It ", "is ", "sunny."] if answered else list(CALL)
        return super().stream(prompt, **options)


@pytest.fixture(scope="module")
def srv():  # type: ignore[no-untyped-def]
    with make_server(ScriptedTextModel(["Hel", "lo", " there", "."], delay_s=0.005), grace_period_s=5) as s:
        yield s


@pytest.fixture(scope="module")
def slow():  # type: ignore[no-untyped-def]
    with make_server(ScriptedTextModel([f" w{i}" for i in range(40)], delay_s=0.05), grace_period_s=0.5) as s:
        yield s


def _client(server: Any, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_create_not_streamed(srv) -> None:  # type: ignore[no-untyped-def]
    r = _client(srv).responses.create(model="default", input="hi", max_output_tokens=16, metadata={"k": "v"})
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Hello there." and r.metadata == {"k": "v"}
    assert r.usage is not None and r.usage.output_tokens == 4 and r.usage.total_tokens == r.usage.input_tokens + 4
    assert [item.type for item in r.output] == ["message"]
    again = _client(srv).responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == "completed"


def test_create_streamed_typed_events(srv) -> None:  # type: ignore[no-untyped-def]
    events = list(_client(srv).responses.create(model="default", input="hi", stream=True, max_output_tokens=3))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # max_output_tokens ran out
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Hello there" == events[-4].text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_stream_helper(srv) -> None:  # type: ignore[no-untyped-def]
    with _client(srv).responses.stream(model="default", input=[{"role": "user", "content": "hi"}]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there."


def test_previous_response_id_carries_the_conversation(srv) -> None:  # type: ignore[no-untyped-def]
    client = _client(srv)
    first = client.responses.create(model="default", input="hi", instructions="Be brief.")
    second = client.responses.create(model="default", input="and then?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    prompt = srv.state.models["text"].model.calls[-1]["prompt"]
    # OpenAI's rule: the earlier instructions are not carried on, the conversation is.
    assert prompt == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."},
                      {"role": "user", "content": "and then?"}]
    items = list(client.responses.input_items.list(second.id))
    assert [i.content[0].text for i in items] == ["and then?"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="default", input="x", previous_response_id="resp_nope")


def test_store_false_and_delete(srv) -> None:  # type: ignore[no-untyped-def]
    client = _client(srv)
    r = client.responses.create(model="default", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept = client.responses.create(model="default", input="hi")
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_bad_bodies_get_openai_errors(srv) -> None:  # type: ignore[no-untyped-def]
    client = _client(srv)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="default", input="hi", temperature=-1)
    assert bad.value.body["param"] == "temperature" and "temperature" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as tool:
        client.responses.create(model="default", input="hi", tools=[{"type": "web_search"}])
    assert tool.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="default", input="hi", background=True, store=False)
    raw = httpx.post(srv.url + "/v1/responses", json={"model": "default"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "input"
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_function_tool_streamed_and_not() -> None:
    with make_server(ToolThenAnswer()) as server:
        client = _client(server)
        r = client.responses.create(model="default", input="Weather in Paris?", tools=[WEATHER])
        call = r.output[0]
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
        events = list(client.responses.create(model="default", input="Weather in Paris?", tools=[WEATHER], stream=True))
        fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert json.loads(fragments) == json.loads(done.arguments) == {"city": "Paris"}
        assert events[-1].type == "response.completed"
        # The tool's answer goes back as a function_call_output item; the model then answers.
        follow = client.responses.create(model="default", previous_response_id=r.id, tools=[WEATHER], input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        assert follow.output_text == "It is sunny."
        prompt = server.state.models["text"].model.calls[-1]["prompt"]
        assert prompt[-2]["tool_calls"][0]["id"] == call.call_id and prompt[-1]["role"] == "tool"


def test_background_retrieve_stream_starting_after(slow) -> None:  # type: ignore[no-untyped-def]
    client = _client(slow)
    r = client.responses.create(model="default", input="hi", background=True, max_output_tokens=12)
    assert r.background and r.status in ("queued", "in_progress")
    # Nobody reads it, past the grace period (0.5 s; its 12 tokens take 0.6 s): it runs on to its end.
    wait_until(lambda: client.responses.retrieve(r.id).status == "incomplete", what="the background response's end")
    with client.responses.retrieve(r.id, stream=True, starting_after=5) as tail:
        events = list(tail)
    assert [e.sequence_number for e in events] == list(range(6, 6 + len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "".join(
        f" w{i}" for i in range(12))
    full = list(client.responses.retrieve(r.id, stream=True))
    assert [e.to_dict() for e in full[6:]] == [e.to_dict() for e in events]  # a replay is the same stream
    assert client.responses.retrieve(r.id).status == "incomplete"


def test_cancel_background(slow) -> None:  # type: ignore[no-untyped-def]
    client = _client(slow)
    r = client.responses.create(model="default", input="hi", background=True)
    wait_until(lambda: client.responses.retrieve(r.id).output_text, what="the first words")  # cancel mid-answer
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert 0 < len(cancelled.output_text) < len("".join(f" w{i}" for i in range(40)))
    assert client.responses.retrieve(r.id).status == "cancelled"


def test_owner_only_on_a_keyed_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("k-alice name=alice\nk-bob name=bob\n")
    with make_server(ScriptedTextModel(["a"]), keys_file=str(keys)) as server:
        r = _client(server, "k-alice").responses.create(model="default", input="hi")
        assert _client(server, "k-alice").responses.retrieve(r.id).output_text == "a"
        with pytest.raises(openai.NotFoundError):
            _client(server, "k-bob").responses.retrieve(r.id)
        with pytest.raises(openai.AuthenticationError):
            _client(server, "wrong").responses.retrieve(r.id)


def test_agents_sdk_runs_a_tool_agent() -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return "sunny, 21 C"

    with make_server(ToolThenAnswer()) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model="default", openai_client=client)
        agent = agents.Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather])

        async def run() -> Any:
            return await agents.Runner.run(agent, "What is the weather in Paris?")

        result = asyncio.run(run())
    assert seen == ["Paris"] and result.final_output == "It is sunny."


# -- the embedded model -------------------------------------------------------------------------


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def real(text_model):  # type: ignore[no-untyped-def]
    with make_server(text_model) as s:
        yield s


@pytest.mark.model
def test_json_schema_parse_on_the_embedded_model(real) -> None:  # type: ignore[no-untyped-def]
    r = _client(real).responses.parse(model="default", input="Name a city in France.", text_format=City,
                                      max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, City) and r.output_parsed.name


@pytest.mark.model
def test_function_tool_on_the_embedded_model(real) -> None:  # type: ignore[no-untyped-def]
    r = _client(real).responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=60, temperature=0)
    call = next(item for item in r.output if item.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)


@pytest.mark.model
def test_agents_sdk_on_the_embedded_model(real) -> None:  # type: ignore[no-untyped-def]
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=real.url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(name="a", instructions="Answer in one short sentence.",
                         model=agents.OpenAIResponsesModel(model="default", openai_client=client),
                         model_settings=agents.ModelSettings(max_tokens=24, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "What is the capital of France?"))
    assert isinstance(result.final_output, str) and result.final_output.strip()
