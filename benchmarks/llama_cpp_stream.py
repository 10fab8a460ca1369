"""llama.cpp (llama-cpp-python) streaming the same GGUF file: tokens/s, TTFT and inter-token gaps.

Imported by `cpu_decode.py` to run beside multistream in one process, and run as a script to
measure llama.cpp in a process of its own, with no torch loaded: that is how a llama.cpp user
runs it, and its OpenMP threads then share their runtime with nobody. As a script it loads the
model, then times one run per line read from stdin and prints each run's figures as a JSON
line, so the caller can interleave its rounds with its own:

    python benchmarks/llama_cpp_stream.py MODEL.gguf PROMPT_TEXT TOKENS THREADS   # then "run" lines
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable
from typing import Any


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def runner(model_path: str, text: str, n: int, threads: int) -> Callable[[], dict[str, float]]:
    """A function that streams ``n`` greedy tokens of ``text`` (a chat-templated prompt) and times them."""
    from llama_cpp import Llama

    model: Any = Llama(model_path=model_path, n_ctx=1024, n_threads=threads, verbose=False)

    def run() -> dict[str, float]:
        # llama-cpp-python keeps the last prompt's KV and reuses a matching prefix: without a
        # reset every round after the first would time a cache hit, not a prefill.
        model.reset()
        start = time.perf_counter()
        times = []
        for _ in model.create_completion(text, max_tokens=n, temperature=0.0, stream=True):
            times.append(time.perf_counter())
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
        span = times[-1] - times[0] if len(times) > 1 else float("nan")
        return {"tok_s": (len(times) - 1) / span, "ttft": (times[0] - start) * 1000, "p50": percentile(gaps, 0.5),
                "p95": percentile(gaps, 0.95), "tokens": len(times)}

    return run


def main() -> None:
    path, text, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    run = runner(path, text, n, threads)
    run()  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(run()), flush=True)


if __name__ == "__main__":
    main()
