"""The engine's figures: continuous batching, joins, priorities, and image step interleaving.

Run in a plain process (no threading variables): ``python benchmarks/engine.py``. Every figure is a
median over ``--rounds`` interleaved rounds, each beside its baseline measured in the same round.

Text (the embedded SmolLM2-135M, greedy, 64 new tokens per stream, raw-completion prompts that
do not stop early):

* aggregate tok/s of N concurrent streams (N = 1, 4, 8, 16) beside ``model.generate`` on a
  left-padded batch of the same N prompts, called on the main thread as a user would
  (targets: >= 0.97x at N=1, >= 0.85x at N=8 and 16);
* TTFT of a stream that joins 8 running streams, beside its TTFT alone (target <= 2x), and the
  p95 gap between tokens of the running streams while it prefills. The joiner is submitted just
  after the running streams' tokens of a step arrived, i.e. just after the next batched forward
  began: the worst moment for an engine that prefills only between steps (see "prefill points"
  in `multistream.text._batcher`);
* TTFT of a priority-10 stream submitted together with 8 priority-0 streams that wait for their
  prefill, and while 8 priority-0 streams run with every row taken (``max_batch=8``), beside its
  TTFT alone (target <= 2x).

Images (the embedded shapes model, 64x64):

* ``latent`` previews every step vs the bare pipeline call (target <= 1.03x);
* a 4-step request started while a 40-step one runs: its time beside its time alone (<= 2x);
* 4 concurrent same-shape 20-step requests, their denoising steps batched (``max_batch=4``, the
  default) beside taking the steps in turn (``max_batch=1``): wall time for all four.
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

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The history of the Roman empire begins with",
    "In the year 2050, the cities of the world will",
    "My grandmother's recipe for bread starts with",
    "The best way to learn a new programming language is",
    "Dear diary, today I walked to the market and",
    "The mountain was covered in snow, and the climbers",
    "Scientists have discovered a new species of frog that",
    "The old lighthouse keeper climbed the stairs and",
    "When the train stopped in the middle of the desert,",
    "The first rule of gardening is that",
    "On the night of the storm, the ship",
    "The museum's newest exhibit shows",
    "Every morning the baker on our street",
    "The detective looked at the letter and",
    "Far beyond the last city, the road",
]
NEW_TOKENS = 64


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _p95(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


# -- text --------------------------------------------------------------------------------------


def streams_tok_s(llm: Any, n: int) -> tuple[float, int]:
    started = time.perf_counter()
    streams = [llm.stream(p, chat=False, max_new_tokens=NEW_TOKENS) for p in PROMPTS[:n]]
    finals = [s.wait() for s in streams]
    elapsed = time.perf_counter() - started
    tokens = sum(f.usage["completion_tokens"] for f in finals)
    return tokens / elapsed, tokens


def generate_tok_s(llm: Any, n: int) -> tuple[float, int]:
    import torch

    tok = llm.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    started = time.perf_counter()
    batch = tok(PROMPTS[:n], return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = llm.model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
    elapsed = time.perf_counter() - started
    tokens = int((out[:, batch["input_ids"].shape[1]:] != tok.pad_token_id).sum())
    return tokens / elapsed, tokens


def _consume(stream: Any, times: list[float]) -> threading.Thread:
    def run() -> None:
        for _ in stream:
            times.append(time.perf_counter())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def join_ttft(llm: Any, joiner: str, samples: int = 3) -> tuple[float, float, float]:
    """(TTFT alone ms, TTFT joining 8 running streams ms, p95 gap of the running ones meanwhile):
    medians of ``samples`` joins, each submitted just after a step's tokens arrived."""
    alone = _median([llm.stream(joiner, chat=False, max_new_tokens=4).wait().metrics["ttft_ms"]
                     for _ in range(samples)])
    times = [[] for _ in range(8)]
    running = [llm.stream(p, chat=False, max_new_tokens=NEW_TOKENS) for p in PROMPTS[:8]]
    threads = [_consume(s, t) for s, t in zip(running, times)]
    while min(len(t) for t in times) < 8:
        time.sleep(0.005)
    joined, windows = [], []
    for _ in range(samples):
        seen = len(times[0])
        while len(times[0]) == seen:  # the next step's tokens: a new batched forward begins now
            time.sleep(0.001)
        submitted = time.perf_counter()
        ttft = llm.stream(joiner, chat=False, max_new_tokens=4).wait().metrics["ttft_ms"]
        joined.append(ttft)
        windows.append((submitted, submitted + ttft / 1000))
    for thread in threads:
        thread.join()
    gaps = [(b - a) * 1000 for t in times for a, b in zip(t, t[1:])
            if any(b >= start and a <= end for start, end in windows)]
    return alone, _median(joined), _p95(gaps)


def priority_ttft(llm: Any, llm_full: Any, prompt: str) -> tuple[float, float, float]:
    """(alone ms, with 8 priority-0 arrivals ms, with 8 priority-0 running in a full batch ms)."""
    alone = _median([llm.stream(prompt, chat=False, max_new_tokens=4, priority=10).wait().metrics["ttft_ms"]
                     for _ in range(3)])
    # 8 low-priority requests arrive together with it: it is prefilled first.
    lows = [llm.stream(p, chat=False, max_new_tokens=NEW_TOKENS, priority=0) for p in PROMPTS[:8]]
    high = llm.stream(prompt, chat=False, max_new_tokens=4, priority=10).wait().metrics["ttft_ms"]
    for s in lows:
        s.wait()
    # Every row of an 8-row engine is taken by a running low-priority stream: one is paused.
    times = [[] for _ in range(8)]
    lows = [llm_full.stream(p, chat=False, max_new_tokens=NEW_TOKENS, priority=0) for p in PROMPTS[:8]]
    threads = [_consume(s, t) for s, t in zip(lows, times)]
    while min(len(t) for t in times) < 4:
        time.sleep(0.005)
    fulls = []
    for _ in range(3):
        seen = len(times[0])
        while len(times[0]) == seen:  # just after a batched forward began, as in join_ttft
            time.sleep(0.001)
        fulls.append(llm_full.stream(prompt, chat=False, max_new_tokens=4, priority=10).wait().metrics["ttft_ms"])
    full = _median(fulls)
    for thread in threads:
        thread.join()
    return alone, high, full


# -- images ------------------------------------------------------------------------------------


def four_at_once(sd: Any) -> float:
    """Seconds until 4 concurrent 20-step requests of one shape have all finished."""
    prompts = ["a red circle on a blue background", "a green square on a white background",
               "a yellow triangle on a green background", "a blue circle on a yellow background"]
    started = time.perf_counter()
    streams = [sd.stream(p, steps=20, seed=i, preview="latent") for i, p in enumerate(prompts)]
    for s in streams:
        assert s.wait().finish_reason == "stop"
    return time.perf_counter() - started


def image_times(sd: Any) -> dict[str, list[float]]:
    """Seconds per run: the bare pipeline and latent previews twice each (plain, latent, latent,
    plain: neither always goes first), then the 4-step request alone and during a 40-step one."""
    import torch

    prompt = "a red circle on a blue background"

    def plain_run() -> float:
        started = time.perf_counter()
        sd.pipeline(prompt, num_inference_steps=20, generator=torch.Generator("cpu").manual_seed(0))
        return time.perf_counter() - started

    def latent_run() -> float:
        started = time.perf_counter()
        final = sd.stream(prompt, steps=20, seed=0, preview="latent", preview_every=1).wait()
        assert final.finish_reason == "stop"
        return time.perf_counter() - started

    plain, latent = [plain_run()], [latent_run()]
    latent.append(latent_run())
    plain.append(plain_run())
    started = time.perf_counter()
    sd.stream("a green square on a white background", steps=4, seed=1, preview="latent").wait()
    short_alone = time.perf_counter() - started
    long = sd.stream(prompt, steps=40, seed=0, preview="latent")
    long_events: list[float] = []
    thread = _consume(long, long_events)
    while len(long_events) < 3:
        time.sleep(0.002)
    started = time.perf_counter()
    sd.stream("a green square on a white background", steps=4, seed=1, preview="latent").wait()
    short_during = time.perf_counter() - started
    thread.join()
    import multistream as ms

    in_turn = ms.ImageModel(sd.pipeline, max_batch=1, name="steps in turn")
    batched, turns = [four_at_once(sd)], [four_at_once(in_turn)]
    turns.append(four_at_once(in_turn))
    batched.append(four_at_once(sd))
    in_turn.close()
    return {"plain": plain, "latent": latent, "short_alone": [short_alone], "short_during": [short_during],
            "four_batched": batched, "four_in_turn": turns}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1,4,8,16")
    parser.add_argument("--skip-images", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    import torch

    import multistream as ms

    llm = ms.load_text_model()
    llm_full = ms.TextModel(llm.model, llm.tokenizer, name="max_batch=8", max_batch=8)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"{NEW_TOKENS} greedy tokens per stream; median of {args.rounds} interleaved rounds")
    streams_tok_s(llm, 2), generate_tok_s(llm, 2)  # warm-up

    rows: dict[int, dict[str, list[float]]] = {n: {"stream": [], "generate": []} for n in sizes}
    joins: list[tuple[float, float, float]] = []
    prios: list[tuple[float, float, float]] = []
    images: list[dict[str, list[float]]] = []
    sd = None if args.skip_images else ms.load_image_model()
    if sd is not None:
        image_times(sd)  # warm-up
    for rnd in range(args.rounds):
        for n in sizes:
            order = ("stream", "generate") if rnd % 2 == 0 else ("generate", "stream")
            for what in order:
                rate, tokens = (streams_tok_s if what == "stream" else generate_tok_s)(llm, n)
                rows[n][what].append(rate)
                if tokens != n * NEW_TOKENS:
                    print(f"  note: {what} N={n} made {tokens} tokens, not {n * NEW_TOKENS}")
        joins.append(join_ttft(llm, PROMPTS[15]))
        prios.append(priority_ttft(llm, llm_full, PROMPTS[14]))
        if sd is not None:
            images.append(image_times(sd))
        print(f"  round {rnd + 1}/{args.rounds} done")

    print("\ntext: aggregate tok/s, streams on the engine vs model.generate on a batch")
    print(f"{'N':>3} {'streams':>9} {'generate':>9} {'ratio':>6}")
    for n in sizes:
        s, g = _median(rows[n]["stream"]), _median(rows[n]["generate"])
        print(f"{n:>3} {s:9.1f} {g:9.1f} {s / g:6.2f}")
    alone, joined, gap = (_median([j[i] for j in joins]) for i in range(3))
    print(f"\njoin: TTFT alone {alone:.0f} ms, joining 8 running streams {joined:.0f} ms "
          f"({joined / alone:.2f}x); p95 inter-token gap of the running streams meanwhile {gap:.0f} ms")
    alone, arrivals, full = (_median([p[i] for p in prios]) for i in range(3))
    print(f"priority 10: TTFT alone {alone:.0f} ms; with 8 priority-0 arrivals {arrivals:.0f} ms "
          f"({arrivals / alone:.2f}x); with 8 priority-0 streams filling max_batch=8 {full:.0f} ms ({full / alone:.2f}x)")
    if images:
        med = {k: _median([x for r in images for x in r[k]]) for k in images[0]}
        print(f"\nimage: latent previews every step {med['latent']:.3f} s vs bare pipeline {med['plain']:.3f} s "
              f"({med['latent'] / med['plain']:.3f}x)")
        print(f"image: 4-step request alone {med['short_alone']:.3f} s, while a 40-step one runs "
              f"{med['short_during']:.3f} s ({med['short_during'] / med['short_alone']:.2f}x)")
        print(f"image: 4 concurrent 20-step requests, steps batched {med['four_batched']:.3f} s vs in turn "
              f"{med['four_in_turn']:.3f} s ({med['four_in_turn'] / med['four_batched']:.2f}x the throughput)")
    llm_full.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
