"""llama.cpp (llama-cpp-python) streaming the same GGUF file: tokens/s, TTFT and inter-token gaps.

Imported by `cpu_decode.py` to run beside multistream in one process, and run as a script to
measure llama.cpp in a process of its own, with no torch loaded: that is how a llama.cpp user
runs it, and its OpenMP threads then share their runtime with nobody. As a script it loads the
model, then times one run per line read from stdin and prints each run's figures as a JSON
line, so the caller can interleave its rounds with its own:

    python benchmarks/llama_cpp_stream.py MODEL.gguf PROMPT_TEXT TOKENS THREADS   # then "run" lines

With ``--requests`` it takes one JSON request per line instead (``{"text", "n", "schema"}``: a
templated prompt, the tokens to make, an optional JSON schema as a grammar), and ``--lookup K``
gives the model llama-cpp-python's prompt lookup decoding (``LlamaPromptLookupDecoding(
num_pred_tokens=K)``), as `lookahead.py` compares:

    python benchmarks/llama_cpp_stream.py MODEL.gguf --requests THREADS [--lookup K]
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


def timed_stream(chunks: Any, start: float) -> dict[str, float]:
    """Figures of one streamed completion (``chunks``), begun at ``start``."""
    times = [time.perf_counter() for _ in chunks]
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    return {"tok_s": (len(times) - 1) / span, "ttft": (times[0] - start) * 1000, "p50": percentile(gaps, 0.5),
            "p95": percentile(gaps, 0.95), "tokens": len(times)}


def serve_requests(model_path: str, threads: int, lookup: int) -> None:
    """Answer JSON requests read from stdin (see the module docstring), one JSON line each."""
    from llama_cpp import Llama, LlamaGrammar
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    # logits_all=True with a draft model: llama-cpp-python 0.3.16 turns logits_all on itself then,
    # but sizes its score buffer from the argument (n_batch rows), so a run past 512 tokens fails.
    model: Any = Llama(model_path=model_path, n_ctx=2048, n_threads=threads, verbose=False, draft_model=draft,
                       logits_all=draft is not None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        grammar = LlamaGrammar.from_json_schema(json.dumps(req["schema"]), verbose=False) if req.get("schema") else None
        model.reset()  # no cache hit from the previous request's prefix: every run prefills
        start = time.perf_counter()
        out: list[str] = []

        def chunks(req: dict[str, Any] = req, grammar: Any = grammar, out: list[str] = out) -> Any:
            for chunk in model.create_completion(req["text"], max_tokens=req["n"], temperature=0.0, stream=True,
                                                 grammar=grammar):
                out.append(chunk["choices"][0]["text"])
                yield chunk

        figures = timed_stream(chunks(), start)
        print(json.dumps({**figures, "text": "".join(out)}), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[2] == "--requests":
        lookup = int(sys.argv[sys.argv.index("--lookup") + 1]) if "--lookup" in sys.argv else 0
        serve_requests(sys.argv[1], int(sys.argv[3]), lookup)
        return
    path, text, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    run = runner(path, text, n, threads)
    run()  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(run()), flush=True)


if __name__ == "__main__":
    main()
