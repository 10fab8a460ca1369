"""Steering a running answer vs stopping it and resending the whole history.

For a history of about 100, 500 and 2,000 tokens (a long user message, then a few written tokens),
the embedded SmolLM2-135M streams an answer; then either

* ``steer``: ``stream.steer(instruction)``; timed from the call to the first event generated
  under the new instruction (``revision == 1``). The engine prefills only the instruction's
  tokens: the KV cache of the history is reused.
* ``resend``: ``stream.cancel()`` and a new stream whose prompt is the whole history (the user
  message, the answer so far, the instruction as a new user turn); timed from the cancel to its
  first token. This is what chat UIs do today.

Medians over ``--rounds`` interleaved rounds, in a plain process: ``python benchmarks/steer.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SENTENCE = "The river runs past the old mill, where the miller keeps his records of every sack of grain. "
INSTRUCTION = "Now answer in one short sentence."


def history_message(llm: Any, tokens: int) -> str:
    per = len(llm.tokenizer(SENTENCE, add_special_tokens=False)["input_ids"])
    return "Read this and tell me about it:\n" + SENTENCE * max(1, tokens // per)


def steer_latency(llm: Any, message: str) -> tuple[float, int]:
    stream = llm.stream([{"role": "user", "content": message}], max_new_tokens=12)
    iterator = iter(stream)
    for _ in range(3):
        next(iterator)
    started = time.perf_counter()
    stream.steer(INSTRUCTION)
    for ev in iterator:
        if ev.revision == 1 and (ev.delta or ev.is_final):
            elapsed = time.perf_counter() - started
            stream.cancel()
            for _ in iterator:
                pass
            return elapsed, llm.count_tokens([{"role": "user", "content": message}])
    raise RuntimeError("the stream ended before the steer took effect")


def resend_latency(llm: Any, message: str) -> float:
    stream = llm.stream([{"role": "user", "content": message}], max_new_tokens=12)
    iterator = iter(stream)
    written = "".join(next(iterator).delta for _ in range(3))
    started = time.perf_counter()
    stream.cancel()
    for _ in iterator:
        pass
    history = [
        {"role": "user", "content": message},
        {"role": "assistant", "content": written},
        {"role": "user", "content": INSTRUCTION},
    ]
    again = llm.stream(history, max_new_tokens=1)
    next(iter(again))
    elapsed = time.perf_counter() - started
    again.cancel()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="100,500,2000")
    args = parser.parse_args()
    import multistream as ms

    llm = ms.load_text_model()
    sizes = [int(s) for s in args.sizes.split(",")]
    messages = {n: history_message(llm, n) for n in sizes}
    steer_latency(llm, messages[sizes[0]])  # warm-up
    steer: dict[int, list[float]] = {n: [] for n in sizes}
    resend: dict[int, list[float]] = {n: [] for n in sizes}
    prompt_tokens: dict[int, int] = {}
    for rnd in range(args.rounds):
        for n in sizes:
            if rnd % 2:
                resend[n].append(resend_latency(llm, messages[n]))
            elapsed, prompt_tokens[n] = steer_latency(llm, messages[n])
            steer[n].append(elapsed)
            if not rnd % 2:
                resend[n].append(resend_latency(llm, messages[n]))
        print(f"  round {rnd + 1}/{args.rounds} done")
    print(f"\nlatency to the first token under a new instruction (median of {args.rounds} rounds)")
    print(f"{'history tokens':>15} {'steer ms':>9} {'resend ms':>10} {'resend/steer':>13}")
    for n in sizes:
        s, r = statistics.median(steer[n]) * 1000, statistics.median(resend[n]) * 1000
        print(f"{prompt_tokens[n] + 3:>15} {s:9.0f} {r:10.0f} {r / s:13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
