"""The cost of token confidence and OpenAI's sampling options on the engine.

Run in a plain process (no threading variables): ``python benchmarks/logprobs.py``. Every figure is
a median over ``--rounds`` interleaved rounds, each beside its baseline measured in the same round
(the embedded SmolLM2-135M, greedy, raw-completion prompts that do not stop early):

* aggregate tok/s of 1 and 8 concurrent streams with ``top_logprobs=5`` beside the same run
  without logprobs (target >= 0.95x): one log-softmax and one top-k over the batch's rows per
  step, one move to the CPU;
* TTFT of ``choices(prompt, 4)`` (the prompt prefilled once, its KV row copied into 4 rows) beside
  one stream of the same prompt (the time until every one of the 4 has its first token), and
  beside 4 separate streams of that prompt;
* aggregate tok/s of 8 streams with ``presence_penalty=0.5, frequency_penalty=0.5`` and a
  ``logit_bias`` beside 8 plain ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from engine import PROMPTS as ENGINE_PROMPTS  # noqa: E402  (raw-completion prompts that do not stop early)

PROMPTS = ENGINE_PROMPTS[:8]
LONG_PROMPT = " ".join(PROMPTS) * 3  # a prompt long enough that its prefill shows in the TTFT


def tok_per_s(llm: Any, n: int, new_tokens: int, **options: Any) -> float:
    t0 = time.perf_counter()
    streams = [llm.stream(PROMPTS[i % len(PROMPTS)], chat=False, max_new_tokens=new_tokens, **options)
               for i in range(n)]
    tokens = sum(s.wait().usage["completion_tokens"] for s in streams)
    return tokens / (time.perf_counter() - t0)


def ttft_all(streams: list[Any]) -> float:
    """Seconds until every stream has sent its first event (then they are cancelled)."""
    t0 = time.perf_counter()
    for s in streams:
        next(iter(s))
    took = time.perf_counter() - t0
    for s in streams:
        s.cancel()
        s.wait()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    import multistream as ms

    llm = ms.load_text_model()
    llm.generate("warm up", chat=False, max_new_tokens=8)
    llm.generate("warm up", chat=False, max_new_tokens=8, top_logprobs=5, frequency_penalty=0.1)
    rows: dict[str, list[float]] = {k: [] for k in (
        "1 stream: top_logprobs=5", "8 streams: top_logprobs=5", "n=4 TTFT vs n=1", "n=4 TTFT vs 4 separate",
        "8 streams: penalties + logit_bias")}
    raw: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    bias = {"13": -100.0, "30": 2.0, "28": -5.0}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for n, name in ((1, "1 stream: top_logprobs=5"), (8, "8 streams: top_logprobs=5")):
            base = tok_per_s(llm, n, args.tokens)
            with_lp = tok_per_s(llm, n, args.tokens, logprobs=True, top_logprobs=5)
            rows[name].append(with_lp / base)
            raw[name].append((base, with_lp))
        one = ttft_all([llm.stream(LONG_PROMPT, chat=False, max_new_tokens=4)])
        four = ttft_all(llm.choices(LONG_PROMPT, 4, chat=False, max_new_tokens=4, temperature=1.0, seed=1))
        separate = ttft_all([llm.stream(LONG_PROMPT, chat=False, max_new_tokens=4, temperature=1.0, seed=i)
                             for i in range(4)])
        rows["n=4 TTFT vs n=1"].append(four / one)
        raw["n=4 TTFT vs n=1"].append((one * 1000, four * 1000))
        rows["n=4 TTFT vs 4 separate"].append(four / separate)
        raw["n=4 TTFT vs 4 separate"].append((separate * 1000, four * 1000))
        base = tok_per_s(llm, 8, args.tokens)
        pen = tok_per_s(llm, 8, args.tokens, presence_penalty=0.5, frequency_penalty=0.5, logit_bias=bias)
        rows["8 streams: penalties + logit_bias"].append(pen / base)
        raw["8 streams: penalties + logit_bias"].append((base, pen))
    units = {"n=4 TTFT vs n=1": "ms", "n=4 TTFT vs 4 separate": "ms"}
    print(f"| figure ({args.rounds} interleaved rounds, {args.tokens} new tokens, medians) | baseline | measured | ratio |")
    print("|---|---|---|---|")
    for name, ratios in rows.items():
        unit = units.get(name, "tok/s")
        base = statistics.median(b for b, _ in raw[name])
        got = statistics.median(m for _, m in raw[name])
        print(f"| {name} | {base:.1f} {unit} | {got:.1f} {unit} | {statistics.median(ratios):.3f}x |")
    llm.close()


if __name__ == "__main__":
    main()
