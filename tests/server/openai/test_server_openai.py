"""The OpenAI-compatible routes, driven by the official `openai` SDK against a real uvicorn."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from server_fixtures import ScriptedImageModel, ScriptedTextModel, make_server

TOKENS = ["Hello", ",", " world", "!", " More", " text"]


@pytest.fixture(scope="module")
def srv():  # type: ignore[no-untyped-def]
    with make_server(ScriptedTextModel(TOKENS, delay_s=0.01), ScriptedImageModel(steps=6, size=32, delay_s=0.02)) as s:
        yield s


@pytest.fixture()
def client(srv):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=4,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world!"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 4
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_chat_non_stream_and_stop(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="default", messages=[{"role": "system", "content": "be brief"},
                                                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                         stop=[" world"], seed=1, temperature=0.5, top_p=0.9)
    assert out.choices[0].message.content == "Hello,"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens >= 2


def test_chat_errors_use_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    # The option as the client spelled it, in param and message (the family's check says max_new_tokens).
    assert info.value.body["param"] == "max_tokens" and info.value.body["message"].startswith("max_tokens must be")  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=[], stream=True)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], n=9)  # 1..8 are built
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_a_400_spells_the_default_as_json_does(client: openai.OpenAI) -> None:
    """The library's checks say "or None" (a Python caller's way to ask for the default); an HTTP
    client sends JSON, where that is null (a newcomer pass found "or None" in the server's 400s)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], seed=-1)
    message = info.value.body["message"]  # type: ignore[index]
    assert "or null" in message and "None" not in message, message


def test_an_unknown_message_role_is_a_400_naming_the_roles(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=[{"role": "robot", "content": "hi"}])  # type: ignore[misc,list-item]
    assert info.value.body["param"] == "messages"  # type: ignore[index]
    assert info.value.body["message"] == ("messages[0].role is 'robot'; a chat message's role is one of "  # type: ignore[index]
                                          "system, developer, user, assistant, tool")
    out = client.chat.completions.create(model="default", messages=[{"role": "developer", "content": "be brief"},
                                                                    {"role": "user", "content": "hi"}], max_tokens=1)
    assert out.choices[0].message.content == "Hello"
    # Responses words it the same way (its input messages have no tool role: outputs are their own items).
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input=[{"role": "robot", "content": "hi"}])  # type: ignore[list-item,typeddict-item]
    assert info.value.body["param"] == "input"  # type: ignore[index]
    assert info.value.body["message"] == ("input[0].role is 'robot'; an input message's role is one of system, "  # type: ignore[index]
                                          "developer, user, assistant (a tool's output is an item of type "
                                          "function_call_output)")


def test_image_stream_with_partial_images(client: openai.OpenAI) -> None:
    events = list(client.images.generate(prompt="a red circle", model="gpt-image-1", size="32x32", stream=True, partial_images=2))
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:-1]] == [0, 1]
    final = Image.open(io.BytesIO(base64.b64decode(events[-1].b64_json)))
    assert final.size == (32, 32)
    assert events[-1].usage.total_tokens == 0


def test_image_errors_name_openais_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", size="16x16", n=0)
    assert info.value.body["param"] == "n" and info.value.body["message"] == "n must be an integer >= 1, got 0"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:  # the server's limit (max_images), not the option's check
        client.images.generate(prompt="x", size="16x16", n=50)
    assert info.value.body["param"] == "n" and info.value.body["message"].startswith("'n' is 50 but this server allows")  # type: ignore[index]


def test_a_bad_image_option_is_a_400_at_once_when_every_slot_is_busy() -> None:
    """The option checks ran in the model's .stream(), once a slot was free: with the one slot busy
    for 10 s, ``steps=0`` waited in the queue all that time for its 400."""
    with make_server(image=ScriptedImageModel(steps=200, size=32, delay_s=0.05), image_concurrency=1) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=3)
        with httpx.stream("POST", live.url + "/v1/image", json={"prompt": "a"}, timeout=60) as running:
            assert running.status_code == 200
            for extra, param in (({"steps": 0}, "steps"), ({"seed": -1}, "seed")):
                with pytest.raises(openai.BadRequestError) as info:  # not APITimeoutError
                    client.images.generate(prompt="x", extra_body=extra)
                assert info.value.body["param"] == param  # type: ignore[index]
            assert live.state.gates["image"].queued == 0
            httpx.delete(f"{live.url}/v1/streams/{running.headers['x-stream-id']}",
                         headers={"X-Resume-Token": running.headers["x-resume-token"]})


def test_a_bad_field_inside_an_object_field_is_named(srv) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"bogus": 1}}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "stream_options"
    assert "unknown field 'stream_options.bogus'" in error["message"]  # it said 'stream_options' was unknown
    assert "'stream_options' takes ['continuous_usage_stats', 'include_obfuscation', 'include_usage']" in error["message"]


def test_image_non_stream(client: openai.OpenAI) -> None:
    out = client.images.generate(prompt="a red circle", size="16x16", n=2, output_format="jpeg")
    assert len(out.data) == 2
    img = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
    assert img.size == (16, 16) and img.format == "JPEG"
    with pytest.raises(openai.BadRequestError):
        client.images.generate(prompt="x", size="huge")
    with pytest.raises(openai.BadRequestError):
        client.images.generate(prompt="x", response_format="url")


def test_models_list(client: openai.OpenAI, srv) -> None:  # type: ignore[no-untyped-def]
    ids = [m.id for m in client.models.list()]
    assert ids == ["scripted-text", "scripted-image"]
    assert httpx.post(srv.url + "/v1/chat/completions", content=b"nope").json()["error"]["type"] == "invalid_request_error"


def test_non_streaming_client_that_times_out_cancels_the_generation() -> None:
    """An SDK timeout on a non-streaming call must not leave the model running to max_tokens."""
    import time

    model = ScriptedTextModel(["tok"] * 400, delay_s=0.05)
    with make_server(model) as s:
        sdk = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):
            sdk.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=400)
        deadline = time.monotonic() + 15
        while model.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert model.finish_reasons == ["cancelled"]


class _ScoringModel(ScriptedTextModel):
    """A scripted model that can score prompts (what /v1/completions' echo with logprobs calls)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scored: list[str] = []

    def score(self, prompt: Any, *, top_logprobs: int = 0, chat: Any = None) -> list[Any]:
        self.scored.append(prompt)
        return [None] + [{"token_id": i, "token": w, "bytes": list(w.encode()), "logprob": -0.5, "top_logprobs": []}
                         for i, w in enumerate(str(prompt).split(" ")[1:])]


def test_echo_scoring_queues_for_a_slot_like_a_stream() -> None:
    """Scoring a prompt runs on the model's engine: with its one slot taken by a stream, an
    echo request waits in the queue (here: until queue_timeout_s, a 503), not beside it; once
    the slot is free it is served."""
    model = _ScoringModel(tokens=[f" w{i}" for i in range(40)], delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_timeout_s=0.5) as srv:
        body = {"model": "default", "prompt": "The capital of France", "max_tokens": 0, "echo": True, "logprobs": 1}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", srv.url + "/v1/text", json={"prompt": "busy", "max_new_tokens": 30}) as busy:
                lines = busy.iter_lines()
                assert next(lines)  # the stream holds the slot now
                r = client.post(srv.url + "/v1/completions", json=body)
                assert r.status_code == 503 and "queue" in r.json()["error"]["message"], r.text
                assert model.scored == []
                for _ in lines:  # the stream to its end: its slot is free again
                    pass
            r = client.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "The capital of France" and model.scored == ["The capital of France"]


def test_every_openai_route_refuses_a_missing_key_in_openais_shape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The middleware's refusals (401 here) take OpenAI's error shape on every OpenAI route, so the
    SDK raises AuthenticationError; the paths come from the OpenAI routers themselves (a list
    written by hand in the middleware had left out /v1/completions)."""
    from multistream.server.openai import PATH_PREFIXES

    with make_server(ScriptedTextModel(TOKENS), api_key="k-right") as s:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/images/generations", "/v1/audio/speech",
                     "/v1/responses", "/v1/videos"):
            assert path.startswith(PATH_PREFIXES)
            r = httpx.post(s.url + path, json={"model": "default"}, timeout=30)
            assert r.status_code == 401, path
            assert r.json()["error"] == {"message": "missing or wrong API key: send `Authorization: Bearer <key>`",
                                         "type": "authentication_error", "param": None, "code": "unauthorized"}, path
        assert httpx.get(s.url + "/v1/models", timeout=30).json()["error"]["type"] == "authentication_error"
        assert httpx.post(s.url + "/v1/text", json={"prompt": "hi"}, timeout=30).json()["error"] == {
            "type": "unauthorized", "message": "missing or wrong API key: send `Authorization: Bearer <key>`"}
        sdk = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            sdk.completions.create(model="default", prompt="hi")


@pytest.mark.model
def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(text_model: Any) -> None:
    """The openai SDK reads ``usage.prompt_tokens_details.cached_tokens`` (chat, streamed or not;
    completions) and ``usage.input_tokens_details.cached_tokens`` (Responses): the chat template's
    start, cached after the first prompt; a completion prompt that extends an earlier one."""
    with make_server(text_model) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        whole = client.chat.completions.create(model="default", max_tokens=4,
                                               messages=[{"role": "user", "content": "Name a colour."}])
        assert whole.usage.prompt_tokens_details.cached_tokens >= 20
        assert whole.usage.prompt_tokens_details.cached_tokens < whole.usage.prompt_tokens
        chunks = list(client.chat.completions.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": "Name a fruit."}], stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 20
        response = client.responses.create(model="default", input="Name an animal.", max_output_tokens=4)
        assert response.usage.input_tokens_details.cached_tokens >= 20
        start = "On a clear day in the middle of summer, the sky above the sea is blue because"
        completion = client.completions.create(model="default", prompt=start, max_tokens=2)
        again = client.completions.create(model="default", prompt=start + " the", max_tokens=2)
        assert completion.usage.prompt_tokens_details is None  # a raw prompt: nothing of it seen before
        assert again.usage.prompt_tokens_details.cached_tokens == completion.usage.prompt_tokens


@pytest.mark.model
def test_each_api_key_has_its_own_prefix_cache(text_model: Any, tmp_path: Any) -> None:
    """On a server with API keys, a key's requests start only from its own cached prompts: the
    same question from another key is prefilled whole (no ``cached_tokens``), so its time to first
    token says nothing of what the first key asked. A client's own ``cache_salt`` (vLLM's) divides
    its key's cache further."""
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a name=alice\nkey-b name=bob\n", encoding="utf-8")
    question = [{"role": "user", "content": "Name a mountain in Asia."}]
    with make_server(text_model, keys_file=str(keys)) as srv:
        alice = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="key-a")
        bob = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="key-b")
        first = alice.chat.completions.create(model="default", messages=question, max_tokens=4)
        again = alice.chat.completions.create(model="default", messages=question, max_tokens=4)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        other = bob.chat.completions.create(model="default", messages=question, max_tokens=4)
        assert other.usage.prompt_tokens_details is None  # nothing of alice's, not even the template's start
        salted = alice.chat.completions.create(model="default", messages=question, max_tokens=4,
                                               extra_body={"cache_salt": "project-x"})
        assert salted.usage.prompt_tokens_details is None
        for spelled in ("key:alice", "alice", "project-x"):  # no salt of bob's reaches alice's prompts
            guess = bob.chat.completions.create(model="default", messages=question, max_tokens=4,
                                                extra_body={"cache_salt": spelled})
            assert guess.usage.prompt_tokens_details is None, spelled
        assert first.choices[0].message.content == other.choices[0].message.content == salted.choices[0].message.content
