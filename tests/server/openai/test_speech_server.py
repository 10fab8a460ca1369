"""The speech routes through the official openai SDK and httpx against a real uvicorn on 127.0.0.1,
with the embedded Piper voice (loaded once for the module)."""

from __future__ import annotations

import base64
import io
import json
import time
import wave

import httpx
import pytest

import multistream as ms
from multistream.server import ServerSettings, create_app
from multistream.testing import ScriptedTextModel

from server_fixtures import iter_sse, live_server

pytest.importorskip("piper")
openai = pytest.importorskip("openai")

TEXT = "Hello there. How are you today? I am fine."
ANSWER = "Sure thing. The sea is wide and deep. It covers most of the planet. Whales live in it."


@pytest.fixture(scope="module")
def server():
    tts = ms.load_speech_model()  # returned warmed: the voice's first run is not what the streaming tests measure
    words = ANSWER.split(" ")
    llm = ScriptedTextModel([w if i == 0 else " " + w for i, w in enumerate(words)], delay_s=0.08)
    app = create_app(text_model=llm, speech_model=tts, settings=ServerSettings())
    with live_server(app) as live:
        yield live
    tts.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _speech(client, fmt, **extra):
    arrivals = []
    start = time.perf_counter()
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format=fmt, **extra) as r:
        assert r.http_response.status_code == 200
        content_type = r.http_response.headers["content-type"]
        parts = []
        for part in r.iter_bytes():
            arrivals.append(time.perf_counter() - start)
            parts.append(part)
    return b"".join(parts), content_type, arrivals


def test_openai_sdk_pcm_is_24khz_and_streams(client):
    data, ctype, arrivals = _speech(client, "pcm")
    assert ctype.startswith("audio/pcm")
    assert len(data) % 2 == 0 and len(data) > 24000  # more than half a second at 24 kHz
    assert len(arrivals) >= 2 and arrivals[0] < arrivals[-1] * 0.8  # the first bytes come well before the end


def test_openai_sdk_wav_and_mp3(client):
    wav, ctype, _ = _speech(client, "wav")
    assert ctype == "audio/wav" and wav[:4] == b"RIFF"
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (22050, 1, 2)
    mp3, ctype, _ = _speech(client, "mp3")
    assert ctype == "audio/mpeg" and (mp3[:3] == b"ID3" or mp3[0] == 0xFF)
    import av

    with av.open(io.BytesIO(mp3)) as container:
        frames = sum(f.samples for f in container.decode(audio=0))
    assert frames > 22050  # about the same duration as the wav, decoded back


@pytest.mark.parametrize("fmt, magic", [("flac", b"fLaC"), ("opus", b"OggS")])
def test_flac_and_opus(client, fmt, magic):
    data, _, _ = _speech(client, fmt)
    assert data[:4] == magic


def test_openai_sse_form(server):
    body = {"model": "gpt-4o-mini-tts", "voice": "echo", "input": TEXT, "response_format": "pcm", "stream_format": "sse"}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [e for e in iter_sse(r) if "data" in e]
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "speech.audio.done" and kinds.count("speech.audio.delta") >= 2
    pcm = b"".join(base64.b64decode(json.loads(e["data"])["audio"]) for e in events[:-1])
    assert len(pcm) > 24000
    usage = json.loads(events[-1]["data"])["usage"]
    assert usage["input_tokens"] == len(TEXT) and usage["total_tokens"] >= usage["input_tokens"]


def test_refusals_are_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="instructions"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", instructions="whisper")
    with pytest.raises(openai.BadRequestError, match="0.25 to 4"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", speed=9)
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    with pytest.raises(openai.NotFoundError, match="the model .whisper-9. does not exist"):
        client.audio.speech.create(model="whisper-9", voice="alloy", input="Hi.")
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="  ")
    # The message reads as a sentence (it was "must be pcm is 24 kHz 16-bit ...").
    with pytest.raises(openai.BadRequestError, match=r"'response_format' must be 'mp3', 'opus', 'aac', 'flac', 'wav' or 'pcm'"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="xyz")  # type: ignore[arg-type]


def test_models_lists_the_speech_model(client):
    listed = {m.id: m for m in client.models.list()}
    assert "en_US-joe-medium" in listed
    assert listed["en_US-joe-medium"].model_extra["kind"] == "speech"


def test_native_speech_sse_is_the_event_protocol(server):
    with httpx.stream("POST", f"{server.url}/v1/speech", json={"text": TEXT, "speed": 1.1}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-resume-token"]
        stream_id = r.headers["x-stream-id"]
        events = [ms.event_from_json(e["data"]) for e in iter_sse(r) if "data" in e]
    assert all(ev.type == "audio" for ev in events) and events[-1].is_final
    with wave.open(io.BytesIO(events[-1].audio)) as w:
        assert w.readframes(w.getnframes()) == b"".join(ev.data for ev in events[:-1])
    assert [ev.seq for ev in events] == list(range(len(events)))
    assert all(ev.stream_id == stream_id for ev in events)
    # Resumable like the others: a reconnect replays what came after its last event.
    replay = httpx.get(f"{server.url}/v1/streams/{stream_id}/events", params={"after": 0},
                       headers={"x-resume-token": r.headers["x-resume-token"]}, timeout=30)
    again = [ms.event_from_json(line[5:].strip()) for line in replay.text.splitlines() if line.startswith("data:")]
    assert again == events[1:]
    bad = httpx.post(f"{server.url}/v1/speech", json={"text": "Hi.", "speed": 0}, timeout=30)
    assert bad.status_code == 400 and "0.25 to 4" in bad.json()["error"]["message"]


def test_chat_with_audio_modalities_streams_speech_while_writing(client):
    start = time.perf_counter()
    transcript, pcm, first_audio, last_text = [], [], None, None
    for chunk in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Tell me about the sea."}], stream=True,
            modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"}):
        if not chunk.choices:
            continue
        audio = chunk.choices[0].delta.audio  # the SDK's ChoiceDeltaAudio: id, data, transcript
        if audio is None:
            continue
        assert audio.id.startswith("audio_")
        if audio.transcript:
            transcript.append(audio.transcript)
            last_text = time.perf_counter() - start
        if audio.data:
            pcm.append(base64.b64decode(audio.data))
            if first_audio is None:
                first_audio = time.perf_counter() - start
    assert "".join(transcript) == ANSWER
    assert first_audio is not None and first_audio < last_text  # spoken while it is written
    assert sum(map(len, pcm)) > 24000 * 2  # more than a second of 24 kHz 16-bit audio


def test_chat_with_audio_without_stream_gives_a_wav(client):
    done = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"})
    message = done.choices[0].message
    assert message.audio.transcript == ANSWER and message.audio.id.startswith("audio_")
    assert base64.b64decode(message.audio.data)[:4] == b"RIFF"
    with pytest.raises(openai.BadRequestError, match="pcm16"):
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], stream=True,
                                       modalities=["text", "audio"], audio={"voice": "alloy", "format": "mp3"})


async def test_websocket_speech_as_binary_frames(server):
    import asyncio

    websockets = pytest.importorskip("websockets")
    from multistream.server import decode_message
    from multistream.server.native.websocket import encode_audio_frame

    async with websockets.connect(server.ws_url + "/v1/ws", open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "speech", "id": "s1", "text": TEXT, "voice": "alloy"}))
        await ws.send(json.dumps({"type": "speech", "id": "s2", "text": "Hi.", "speed": 7}))
        events, rejected = [], None
        while not (events and events[-1].is_final) or rejected is None:
            raw = await asyncio.wait_for(ws.recv(), 60)
            msg = decode_message(raw)
            if isinstance(msg, dict):
                if msg["type"] == "rejected":
                    rejected = msg
                continue
            assert isinstance(raw, bytes)  # audio travels as binary frames, not base64
            events.append(msg)
    assert rejected["id"] == "s2" and rejected["status"] == 400 and "0.25 to 4" in rejected["error"]["message"]
    assert all(ev.type == "audio" for ev in events) and [ev.seq for ev in events] == list(range(len(events)))
    with wave.open(io.BytesIO(events[-1].audio)) as w:
        assert w.readframes(w.getnframes()) == b"".join(ev.data for ev in events[:-1])
    assert decode_message(encode_audio_frame(events[-1])) == events[-1]
