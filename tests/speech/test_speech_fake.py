"""The speech machinery without a voice: `ScriptedSpeechModel` (the real engine, splitter and
events over a tone) behind the server's speech routes, and in ``ms.speak``."""

from __future__ import annotations

import io
import wave

import httpx
import pytest

import multistream as ms
from multistream.server import ServerSettings, create_app
from multistream.testing import ScriptedSpeechModel, ScriptedTextModel

from server_fixtures import live_server

pytest.importorskip("pysbd")


@pytest.fixture(scope="module")
def tts():
    model = ScriptedSpeechModel(delay_s=0.02)
    yield model
    model.close()


def test_scripted_speech_model_streams_events(tts):
    events = list(tts.stream("One. Two, three. Four."))
    final = events[-1]
    assert final.finish_reason == "stop" and [ev.is_final for ev in events].count(True) == 1
    with wave.open(io.BytesIO(final.audio)) as w:
        assert w.readframes(w.getnframes()) == b"".join(ev.data for ev in events[:-1])
    assert tts.synth.calls[-3:] == ["One.", " Two, three.", " Four."]


def test_a_new_speech_model_is_returned_after_its_first_run() -> None:
    # The voice's first run (the warm-up sentence) is over before the constructor returns, so it
    # never overlaps what the caller does next (a main-thread collection during a voice's first
    # onnxruntime run crashed a test process twice).
    import time

    started = time.perf_counter()
    model = ScriptedSpeechModel(delay_s=0.3)
    try:
        assert time.perf_counter() - started >= 0.3, "returned before the warm-up sentence was spoken"
        assert model.synth.calls == ["Hello."]
    finally:
        model.close()


def test_speech_routes_with_the_fake(tts):
    app = create_app(speech_model=tts, settings=ServerSettings())
    with live_server(app) as srv:
        r = httpx.post(f"{srv.url}/v1/audio/speech", json={"model": "tts-1", "voice": "nova", "input": "Hi. Bye.",
                                                           "response_format": "pcm"}, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("audio/pcm")
        # "Hi." and "Bye.": 7 characters of tone at 400 samples (16 kHz), a 0.2 s pause, resampled to 24 kHz
        assert abs(len(r.content) / 2 - (7 * 400 + 3200) * 1.5) < 50
        wav = httpx.post(f"{srv.url}/v1/audio/speech", json={"model": "tts-1", "voice": "tone", "input": "Hi.",
                                                             "response_format": "wav"}, timeout=30)
        assert wav.content[:4] == b"RIFF"
        models = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]
        assert {"id": "scripted-speech", "kind": "speech"}.items() <= next(m for m in models if m["kind"] == "speech").items()


def test_speak_with_the_fake(tts):
    llm = ScriptedTextModel(["Hello", " there.", " How", " are", " you", " today?", " Fine."], delay_s=0.05)
    events = list(ms.speak(llm.stream("hi"), tts))
    text_final = next(i for i, ev in enumerate(events) if ev.type == "text" and ev.finish_reason)
    assert any(ev.type == "audio" for ev in events[:text_final]) and events[-1].type == "audio"


def test_the_readme_speak_example_prints_the_final_meaningfully(tts, capsys):
    """The README's ``ms.speak`` loop printed ``ev.num_samples`` for every audio event, and the final
    has none of its own (the whole utterance is in ``.audio``): its last line was "audio 0". Run as
    written (on the fakes), it ends with the utterance's length instead."""
    from repo_paths import ROOT

    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Speech"):]
    block = block[block.index("```python") + len("```python"):block.index("```", block.index("```python") + 3)]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("msgs = "))
    assert lines[start + 1].startswith("for ev in ms.speak(")
    loop = lines[start:start + 2]
    for line in lines[start + 2:]:  # the loop's body
        if not line.startswith(" "):
            break
        loop.append(line)
    llm = ScriptedTextModel(["Hello", " there.", " How", " are", " you?"], delay_s=0.01)
    exec("\n".join(loop), {"ms": ms, "llm": llm, "tts": tts})
    printed = capsys.readouterr().out.splitlines()
    assert "audio 0" not in printed
    assert any(line.startswith("audio ") for line in printed) and any(line.startswith("text ") for line in printed)
    last = printed[-1].split()
    assert last[0] == "spoken" and last[2] == "s" and float(last[1]) > 0, printed
