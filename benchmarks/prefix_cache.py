"""Time to first token with and without the prompt prefix cache, on the default model.

Two copies of ``ms.load_text_model()`` in one plain process: one as loaded (its prefix cache on),
one whose cache keeps nothing (``llm.prefix_cache.max_bytes = 0``: every prompt prefilled whole).
Each round asks both, interleaved, the same new chat questions (distinct, so only the chat
template's start and earlier turns are shared) and then a follow-up turn of the first question;
the report is the median TTFT of each over the rounds, and their ratio. The answers must be
identical (the cache is exact); the script stops if they are not.

    python benchmarks/prefix_cache.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import multistream as ms

QUESTIONS = [
    "What is the capital of France?",
    "Tell me a joke about cats.",
    "Name three colours of the rainbow.",
    "Why is the sky blue? One sentence.",
    "Write a haiku about rivers.",
    "What is two plus two?",
]


def _ttft(llm: ms.TextModel, messages: list[dict[str, str]]) -> tuple[float, str]:
    t0 = time.perf_counter()
    stream = llm.stream(messages, max_new_tokens=16, temperature=0.0)
    events = iter(stream)
    next(events)
    ttft = time.perf_counter() - t0
    final = [ev for ev in events][-1]
    return ttft, final.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("load average before:", os.getloadavg())
    cached, whole = ms.load_text_model(), ms.load_text_model()
    whole.prefix_cache.max_bytes = 0
    for llm in (cached, whole):
        _ttft(llm, [{"role": "user", "content": "Hi"}])  # warm-up (and the template's start, cached)
    new: dict[str, list[float]] = {"cached": [], "whole": []}
    follow: dict[str, list[float]] = {"cached": [], "whole": []}
    for r in range(args.rounds):
        for q in QUESTIONS:
            messages = [{"role": "user", "content": f"{q} (round {r})"}]
            order = [("cached", cached), ("whole", whole)][:: 1 if (r + len(q)) % 2 else -1]
            texts = {}
            for name, llm in order:
                t, texts[name] = _ttft(llm, messages)
                new[name].append(t)
            assert texts["cached"] == texts["whole"], (q, texts)
        turn = [{"role": "user", "content": f"{QUESTIONS[0]} (round {r})"}]
        answer = cached.generate(turn, max_new_tokens=16, temperature=0.0).text
        turn2 = turn + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me more."}]
        texts = {}
        for name, llm in [("cached", cached), ("whole", whole)][:: 1 if r % 2 else -1]:
            t, texts[name] = _ttft(llm, turn2)
            follow[name].append(t)
        assert texts["cached"] == texts["whole"]
    print("load average after:", os.getloadavg())
    print(f"prefix cache: {cached.prefix_cache.hits} hits, {cached.prefix_cache.reused_tokens} prompt tokens reused")
    print("| prompt | TTFT cached (ms, median) | TTFT whole prefill (ms, median) | ratio |")
    print("|---|---|---|---|")
    for label, data in (("a new question", new), ("a follow-up turn", follow)):
        c, w = statistics.median(data["cached"]) * 1e3, statistics.median(data["whole"]) * 1e3
        print(f"| {label} | {c:.1f} | {w:.1f} | {c / w:.2f}x |")
    cached.close()
    whole.close()


if __name__ == "__main__":
    main()
