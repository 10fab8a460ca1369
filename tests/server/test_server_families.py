"""The server's table of families (`multistream.server.families`) and what follows from it: the
content filter over every family's input (speech too), the spoken text on the final speech event,
``--speech-concurrency``, families served by default when installed, unknown OpenAI model names
answered 404 ``model_not_found``, and an OpenAPI document whose every ``$ref`` resolves.

Real parts: uvicorn on 127.0.0.1, the official ``openai`` SDK, the embedded Piper voice, and a
real ``multistream serve`` process for the defaults."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import jsonschema
import pytest

import multistream as ms
from multistream.errors import InvalidArgumentError
from multistream.server import STOP, ServerSettings, create_app
from multistream.server.families import FAMILIES, family, find_family
from multistream.testing import ScriptedImageModel, ScriptedSpeechModel, ScriptedTextModel

from server_fixtures import iter_events, live_server, serve_subprocess

openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the table -----------------------------------------------------------------------------------


def test_the_table_names_each_family_once_and_its_old_spellings():
    assert [f.name for f in FAMILIES] == ["text", "image", "speech", "video"]
    assert find_family("audio") is family("speech")  # Stream.kind and WebSocket type of old
    assert find_family("movie") is None
    assert {f.name: f.filter_fields for f in FAMILIES} == {
        "text": ("prompt",), "image": ("prompt", "negative_prompt"), "speech": ("text",),
        "video": ("prompt", "negative_prompt")}
    assert [f.concurrency_setting for f in FAMILIES] == ["text_concurrency", "image_concurrency", "speech_concurrency",
                                                         "video_concurrency"]
    # Each family checks its own arguments where its model is not (a Ray ingress), with its own messages.
    for name, bad, message in (("text", {"prompt": "hi", "temperature": -1}, "temperature"),
                               ("image", {"prompt": "x", "steps": 0}, "steps"),
                               ("speech", {"text": "Hi.", "speed": 9}, "0.25 to 4"),
                               ("video", {"prompt": "x", "fps": 0}, "fps")):
        with pytest.raises(InvalidArgumentError, match=message):
            family(name).check(bad)
    # One name everywhere a client sees the family: a speech model's streams say "speech" too.
    tts = ScriptedSpeechModel()
    try:
        assert tts.stream("Hi.").kind == "speech"
    finally:
        tts.close()


def test_a_server_written_speech_final_carries_the_spoken_input():
    """A speech stream the server ends itself (its model did not answer a cancel in time): the
    final keeps what was spoken and the input it speaks, like the model's own final."""

    class Record:
        stream_id, request = "s1", {"text": "Hello ******* there."}
        events = [ms.AudioEvent(stream_id="s1", seq=0, t=0.1, data=b"\x01\x00" * 10, sample_rate=16000,
                                sample_offset=0, num_samples=10, text_span=(0, 6))]

    final = family("speech").server_final(Record(), "cancelled", 1, 0.5)
    assert final.is_final and final.finish_reason == "cancelled" and final.text == "Hello ******* there."
    assert final.text_span == (0, 6) and final.usage["input_characters"] == len("Hello ******* there.")
    wire = final.to_dict()
    jsonschema.validate(wire, ms.event_json_schema())
    assert ms.event_from_dict(wire) == final


def test_the_audio_event_text_field_round_trips_and_is_checked():
    ev = ms.AudioEvent(stream_id="s", seq=3, t=1.0, is_final=True, data=b"", sample_rate=22050, sample_offset=0,
                       num_samples=0, text_span=(0, 3), audio=b"RIFF", duration_s=0.0, finish_reason="stop",
                       usage={"input_characters": 3, "audio_seconds": 0.0}, metrics={}, text="Hi.")
    assert ms.event_from_dict(ev.to_dict()) == ev
    jsonschema.validate(ev.to_dict(), ms.event_json_schema())
    with pytest.raises(ms.EventFormatError, match="'text' must be a string"):
        ms.event_from_dict({**ev.to_dict(), "text": 5})


# -- the content filter over speech, with the real voice -----------------------------------------


@pytest.fixture(scope="module")
def piper_server(tmp_path_factory):
    pytest.importorskip("piper")
    words = tmp_path_factory.mktemp("filter") / "words.txt"
    words.write_text("bananas\n", encoding="utf-8")
    tts = ms.load_speech_model()
    spoken: list[str] = []
    synthesize = tts.synth.synthesize

    def recording(text, voice, speed):  # what the voice was asked to say, piece by piece
        spoken.append(text)
        return synthesize(text, voice, speed)

    tts.synth.synthesize = recording
    app = create_app(text_model=ScriptedTextModel(["ok"]), speech_model=tts,
                     settings=ServerSettings(blocklist_file=str(words)))
    with live_server(app) as live:
        live.spoken = spoken
        yield live
    tts.close()


def test_openai_speech_input_goes_through_the_content_filter(piper_server):
    """Before: `POST /v1/audio/speech {"input": "I love bananas very much"}` spoke the word."""
    client = openai.OpenAI(base_url=f"{piper_server.url}/v1", api_key="unused", max_retries=0)
    piper_server.spoken.clear()
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input="I love bananas very much.",
                                       response_format="wav")
    assert audio.content[:4] == b"RIFF" and len(audio.content) > 10_000
    said = "".join(piper_server.spoken)
    assert "bananas" not in said.lower() and "*******" in said


def test_native_speech_final_carries_the_filtered_text(piper_server):
    piper_server.spoken.clear()
    with httpx.stream("POST", f"{piper_server.url}/v1/speech", json={"text": "Bananas are yellow. I like them."},
                      timeout=120) as r:
        assert r.status_code == 200
        events = list(iter_events(r))
    final = events[-1]
    assert final["type"] == "audio" and final["is_final"] and final["finish_reason"] == "stop"
    assert final["text"] == "******* are yellow. I like them."  # the captions match the audio
    assert final["text_span"] == [0, len(final["text"])]
    jsonschema.validate(final, ms.event_json_schema())
    assert "bananas" not in "".join(piper_server.spoken).lower()


def test_a_filter_that_stops_speech_input_is_a_400():
    tts = ScriptedSpeechModel()
    app = create_app(speech_model=tts, content_filter=lambda text, part: STOP if "secret" in text else None)
    try:
        with live_server(app) as srv:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                client.audio.speech.create(model="tts-1", voice="alloy", input="the secret plan")
            assert err.value.body["code"] == "content_filter" and err.value.body["param"] == "text"
            ok = client.audio.speech.create(model="tts-1", voice="alloy", input="the open plan", response_format="wav")
            assert ok.content[:4] == b"RIFF"
            assert "the open plan" in tts.synth.calls and not any("secret" in c for c in tts.synth.calls)
    finally:
        tts.close()


async def test_websocket_speech_under_its_old_name_is_filtered_too():
    import asyncio

    websockets = pytest.importorskip("websockets")
    from multistream.server import decode_message

    tts = ScriptedSpeechModel()
    app = create_app(speech_model=tts, content_filter=lambda text, part: text.replace("bananas", "*******"))
    try:
        with live_server(app) as srv:
            async with websockets.connect(f"{srv.ws_url}/v1/ws", open_timeout=30) as ws:
                await ws.send(json.dumps({"type": "audio", "text": "I love bananas.", "id": 1}))
                events: list = []
                while not (events and events[-1].is_final):
                    msg = decode_message(await asyncio.wait_for(ws.recv(), 30))
                    assert not isinstance(msg, dict) or msg.get("type") != "rejected", msg
                    if not isinstance(msg, dict):
                        events.append(msg)
            assert events[-1].text == "I love *******." and "I love *******." in tts.synth.calls
            assert not any("bananas" in c for c in tts.synth.calls)
    finally:
        tts.close()


# -- --speech-concurrency ------------------------------------------------------------------------


def test_speech_concurrency_caps_the_speech_gate():
    with pytest.raises(InvalidArgumentError, match="speech_concurrency"):
        ServerSettings(speech_concurrency=0)
    assert ServerSettings.from_env(speech_concurrency=3).speech_concurrency == 3
    tts = ScriptedSpeechModel(delay_s=0.3)  # its engine takes 8 at once: the setting is what makes one wait
    app = create_app(speech_model=tts, settings=ServerSettings(speech_concurrency=1))
    try:
        with live_server(app) as srv:
            assert srv.state.gates["speech"].concurrency == 1
            first = httpx.stream("POST", f"{srv.url}/v1/speech",
                                 json={"text": " ".join(f"Sentence {i}." for i in range(40))}, timeout=60)
            response = first.__enter__()
            assert response.status_code == 200
            sid = response.headers["X-Stream-Id"]
            token = response.headers["X-Resume-Token"]
            second: dict = {}

            def run_second() -> None:
                r = httpx.post(f"{srv.url}/v1/speech", json={"text": "Waiting."}, timeout=60)
                second["events"] = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]

            thread = threading.Thread(target=run_second)
            thread.start()
            health = {}
            for _ in range(600):
                health = httpx.get(f"{srv.url}/healthz", timeout=10).json()
                if health["queued"].get("speech") == 1:
                    break
                thread.join(0.05)
            assert health["queued"]["speech"] == 1  # the second waits for the first's slot
            httpx.delete(f"{srv.url}/v1/streams/{sid}", headers={"X-Resume-Token": token}, timeout=10)
            first.__exit__(None, None, None)
            thread.join(60)
            assert second["events"][-1]["finish_reason"] == "stop" and second["events"][-1]["text"] == "Waiting."
    finally:
        tts.close()


def test_speech_concurrency_is_a_serve_flag():
    import argparse

    from multistream.cli import serve as serve_cli

    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    serve_cli.add_parser(subparsers)
    args = parser.parse_args(["serve", "--speech-concurrency", "2", "--speech-model", "none"])
    assert args.speech_concurrency == 2 and args.speech_model == "none"
    assert serve_cli.model_spec("speech", "none") is None and serve_cli.model_spec("speech", "off") is None
    assert serve_cli.model_spec("speech", "x.onnx") == "x.onnx"


# -- served by default ---------------------------------------------------------------------------


def test_serve_speaks_by_default_and_speech_model_none_turns_it_off():
    """Before: `multistream serve` answered /v1/audio/speech with 404 unless given --speech-model default."""
    pytest.importorskip("piper")
    port = _free_port()
    proc = serve_subprocess(port, "--text-model", "none", "--image-model", "none", "--video-model", "none", wait_s=120)
    try:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        audio = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.", response_format="wav")
        assert audio.content[:4] == b"RIFF"
        assert [m.model_extra["kind"] for m in client.models.list().data] == ["speech"]
    finally:
        proc.terminate()
        proc.wait(30)
    port = _free_port()
    proc = serve_subprocess(port, "--text-model", "multistream.testing:ScriptedTextModel", "--image-model", "none",
                            "--speech-model", "none", "--video-model", "none", wait_s=120)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json={"model": "tts-1", "input": "Hello."},
                       timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_served"
        assert "--speech-model default" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)


# -- OpenAI model names --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def all_families():
    tts = ScriptedSpeechModel()
    app = create_app(text_model=ScriptedTextModel(["Hi", "!"]), image_model=ScriptedImageModel(steps=2, size=32),
                     speech_model=tts)
    with live_server(app) as live:
        yield live
    tts.close()


def test_unknown_model_names_are_404_model_not_found(all_families):
    client = openai.OpenAI(base_url=f"{all_families.url}/v1", api_key="unused", max_retries=0)
    calls = {
        "chat": lambda m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2),
        "completions": lambda m: client.completions.create(model=m, prompt="hi", max_tokens=2),
        "responses": lambda m: client.responses.create(model=m, input="hi", max_output_tokens=16),
        "images": lambda m: client.images.generate(model=m, prompt="a red circle", size="32x32"),
        "speech": lambda m: client.audio.speech.create(model=m, voice="alloy", input="Hi."),
    }
    for name, call in calls.items():
        with pytest.raises(openai.NotFoundError) as err:
            call("llama-70b")
        body = err.value.body
        assert body["code"] == "model_not_found" and body["param"] == "model", (name, body)
        assert "llama-70b" in body["message"] and "GET /v1/models" in body["message"], name
    # The names clients use stay valid: "default", the family, the served name, OpenAI's aliases.
    for m in ("default", "text", "scripted-text"):
        assert client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2).choices[0].message.content == "Hi!"
    assert client.completions.create(model="default", prompt="hi", max_tokens=2).choices[0].text == "Hi!"
    assert client.responses.create(model="default", input="hi", max_output_tokens=16).output_text == "Hi!"
    for m in ("gpt-image-1", "dall-e-3", "dall-e-2", "default", "scripted-image"):
        assert client.images.generate(model=m, prompt="a red circle", size="32x32").data[0].b64_json
    for m in ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "default", "scripted-speech"):
        assert client.audio.speech.create(model=m, voice="alloy", input="Hi.", response_format="wav").content[:4] == b"RIFF"


def test_models_lists_what_is_served_with_its_aliases(all_families):
    client = openai.OpenAI(base_url=f"{all_families.url}/v1", api_key="unused", max_retries=0)
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert {k: v["kind"] for k, v in listed.items()} == {
        "scripted-text": "text", "scripted-image": "image", "scripted-speech": "speech"}
    assert "tts-1" in listed["scripted-speech"]["aliases"] and "dall-e-3" in listed["scripted-image"]["aliases"]
    assert client.models.retrieve("tts-1").id == "scripted-speech"
    assert client.models.retrieve("scripted-text").id == "scripted-text"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("llama-70b")
    assert err.value.body["code"] == "model_not_found"


# -- the OpenAPI document ------------------------------------------------------------------------


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_ref_in_the_openapi_document_resolves(all_families):
    """Before: /v1/completions' body was a $ref to CompletionRequest, which the document lacked."""
    doc = httpx.get(f"{all_families.url}/openapi.json", timeout=30).json()
    refs = set(_refs(doc))
    assert "#/components/schemas/CompletionRequest" in refs and "#/components/schemas/SpeechBody" in refs
    for ref in sorted(refs):
        assert ref.startswith("#/"), ref
        node = doc
        for part in ref[2:].split("/"):
            assert part in node, f"{ref} does not resolve"
            node = node[part]
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]


# -- the content filter on a text stream continued after a restart -------------------------------


def test_a_text_stream_continued_after_a_restart_is_still_filtered(tmp_path):
    """Before: a restarted server continued an orphaned text stream without the content filter,
    so its blocklisted words reached the clients resuming it."""
    import asyncio
    import time

    from multistream.server.durable.event_log import RedisEventLog, entry_id

    from redis_fixtures import REDIS, redis_server
    from server_fixtures import make_server

    if REDIS is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh --test)")
    words = tmp_path / "words.txt"
    words.write_text("w7\n", encoding="utf-8")
    sid, token = "c" * 32, "tok"
    first = {"type": "text", "stream_id": sid, "seq": 0, "t": 0.0, "is_final": False, "delta": " w0",
             "token_ids": [0], "index": 0}

    async def orphan(url: str) -> None:  # a stream whose server died after its first token
        log = RedisEventLog(url, ServerSettings())
        await log.redis.hset(log.key("m", sid), mapping={
            "token": token, "owner": "", "proc": "gone", "keyed": 0, "kind": "text", "model": "default", "resumable": 1,
            "created": time.time(), "done": 0, "hb": time.time(), "restarts": 0,
            "req": json.dumps({"prompt": "hi", "max_new_tokens": 10})})
        await log.redis.xadd(log.key("s", sid), {"j": json.dumps(first), "f": 0}, id=entry_id(0))
        await log.redis.sadd(log.key("live"), sid)
        await log.close()

    with redis_server() as redis:
        asyncio.run(orphan(redis.url))
        model = ScriptedTextModel([f" w{i}" for i in range(10)])
        with make_server(model, event_log=redis.url, blocklist_file=str(words)) as srv, \
                httpx.Client(timeout=30) as client:
            for _ in range(300):
                if sid in srv.app.state.continuer.continued:
                    break
                time.sleep(0.05)
            assert sid in srv.app.state.continuer.continued
            with client.stream("GET", f"{srv.url}/v1/streams/{sid}/events",
                               headers={"Last-Event-ID": "0", "X-Resume-Token": token}) as r:
                assert r.status_code == 200
                rest = list(iter_events(r))
    final = rest[-1]
    assert final["is_final"] and final["finish_reason"] == "length"
    assert final["text"] == " w0 w1 w2 w3 w4 w5 w6 ** w8 w9"
    text = " w0"
    for ev in rest:
        text = text[: ev.get("offset", len(text))] + ev["delta"]
    assert text == final["text"]


# -- the content filter over an edit's new instruction -------------------------------------------


def test_steer_and_rewind_instructions_go_through_the_content_filter():
    """A steer's or rewind's instruction is input too: redacted like the prompt, or a 400."""
    from server_fixtures import make_server

    def content_filter(text, part):
        return STOP if "forbidden" in text else text.replace("bananas", "*******")

    model = ScriptedTextModel([f" t{i}" for i in range(40)], delay_s=0.03)
    with make_server(model, content_filter=content_filter) as srv, httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{srv.url}/v1/text", json={"prompt": "hi", "max_new_tokens": 30}) as r:
            sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
            headers = {"X-Resume-Token": token}
            events, answers = [], {}
            for ev in iter_events(r):
                events.append(ev)
                if len(events) == 3:
                    answers["stop"] = c.post(f"{srv.url}/v1/streams/{sid}/rewind", headers=headers,
                                             json={"offset": 2, "instruction": "a forbidden topic"})
                    answers["steer"] = c.post(f"{srv.url}/v1/streams/{sid}/steer", headers=headers,
                                              json={"instruction": "talk about bananas"})
    assert answers["stop"].status_code == 400 and answers["stop"].json()["error"]["type"] == "content_filter"
    assert answers["steer"].status_code == 200 and answers["steer"].json()["accepted"]
    final = events[-1]
    assert [(e["kind"], e["instruction"]) for e in final["revisions"]] == [("steer", "talk about *******")]


def test_models_list_each_embedded_model_by_its_own_name_while_it_loads() -> None:
    """``GET /v1/models`` listed every family's embedded model as ``"default"`` until it had
    loaded (four entries with one id; found by a newcomer pass); each now has the name it reports
    once loaded, from the family table."""
    from multistream.server.openai.models import _model_entries
    from multistream.server.state import ServerState
    from multistream.speech._synth import EMBEDDED_VOICE
    from multistream.text._loading import EMBEDDED_TEXT_MODEL

    state = ServerState(ServerSettings(), models={f.name: "default" for f in FAMILIES})  # loading not started
    entries = _model_entries(state)
    assert [e["state"] for e in entries] == ["pending"] * len(FAMILIES)
    assert {e["kind"]: e["id"] for e in entries} == {f.name: f.embedded_name for f in FAMILIES}
    assert len({e["id"] for e in entries}) == len(FAMILIES) and all("default" in e["aliases"] for e in entries)
    # The names the loaders give the embedded models (the image and video ones by loading them).
    assert family("text").embedded_name == EMBEDDED_TEXT_MODEL
    assert family("speech").embedded_name == EMBEDDED_VOICE
    for name, load in (("image", ms.load_image_model), ("video", ms.load_video_model)):
        with load() as model:
            assert family(name).embedded_name == model.name
