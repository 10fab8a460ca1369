"""Time to first token with and without the prompt prefix cache, on the default model.

Two copies of ``ms.load_text_model()`` in one plain process: one as loaded (its prefix cache on),
one whose cache keeps nothing (``llm.prefix_cache.max_bytes = 0``: every prompt prefilled whole).
Each round asks both, interleaved, the same new chat questions (distinct, so only the chat
template's start and earlier turns are shared), then a follow-up turn of the first question, then
a burst of eight new questions at once (the p50 TTFT of the burst, and the time until all eight
ended), then the next turn of a long conversation (about 2,000 tokens, its earlier turns given
text); the report is the median of each over the rounds, and the ratio. The answers must be
identical (the cache is exact); the script stops if they are not.

    python benchmarks/prefix_cache.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
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


# An earlier turn's text, repeated to make a long conversation (about 170 tokens a turn).
_PASSAGE = ("The river runs through the old town, past the mill and the market square, where traders sell "
            "bread, cheese, apples and wool every morning before the bells ring at nine. ") * 2


def long_conversation(tag: str, turns: int = 12) -> list[dict[str, str]]:
    """A conversation of about ``turns * 170`` tokens whose answers are given, ending with a question."""
    messages: list[dict[str, str]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Tell me part {i} of the story of the town ({tag}). {_PASSAGE}"})
        messages.append({"role": "assistant", "content": _PASSAGE})
    return messages + [{"role": "user", "content": "What happened next?"}]


def _burst(llm: ms.TextModel, questions: list[str]) -> tuple[float, float, list[str]]:
    """Start every question at once; (p50 TTFT, wall time until all ended, the answers)."""
    ttfts: list[float] = [0.0] * len(questions)
    texts: list[str] = [""] * len(questions)
    t0 = time.perf_counter()
    streams = [llm.stream([{"role": "user", "content": q}], max_new_tokens=16, temperature=0.0) for q in questions]

    def drain(i: int) -> None:
        for ev in streams[i]:
            if not ttfts[i]:
                ttfts[i] = time.perf_counter() - t0
            if ev.is_final:
                texts[i] = ev.text

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(ttfts), time.perf_counter() - t0, texts


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
    burst_ttft: dict[str, list[float]] = {"cached": [], "whole": []}
    burst_wall: dict[str, list[float]] = {"cached": [], "whole": []}
    long_next: dict[str, list[float]] = {"cached": [], "whole": []}
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
        burst = [f"{q} (burst {r}.{i})" for i, q in enumerate(QUESTIONS + QUESTIONS[:2])]
        answers = {}
        for name, llm in [("cached", cached), ("whole", whole)][:: 1 if r % 2 else -1]:
            p50, wall, answers[name] = _burst(llm, burst)
            burst_ttft[name].append(p50)
            burst_wall[name].append(wall)
        assert answers["cached"] == answers["whole"]
        conversation = long_conversation(f"round {r}")
        _ttft(cached, conversation)  # the conversation so far, as a chat app had sent it (kept by the cache)
        follow_up = conversation + [{"role": "assistant", "content": "The mill closed."},
                                    {"role": "user", "content": "Why did it close?"}]
        texts = {}
        for name, llm in [("cached", cached), ("whole", whole)][:: 1 if r % 2 else -1]:
            t, texts[name] = _ttft(llm, follow_up)
            long_next[name].append(t)
        assert texts["cached"] == texts["whole"]
    print("load average after:", os.getloadavg())
    print(f"prefix cache: {cached.prefix_cache.hits} hits, {cached.prefix_cache.reused_tokens} prompt tokens reused")
    print("| TTFT of | with the cache (ms, median) | whole prefill (ms, median) | ratio |")
    print("|---|---|---|---|")
    for label, data in (("a new question", new), ("a follow-up turn", follow),
                        ("eight new questions at once: p50", burst_ttft),
                        ("eight new questions at once: all ended (wall)", burst_wall),
                        (f"the next turn of a {len(cached.encode_prompt(long_conversation('x')))}-token conversation",
                         long_next)):
        c, w = statistics.median(data["cached"]) * 1e3, statistics.median(data["whole"]) * 1e3
        print(f"| {label} | {c:.1f} | {w:.1f} | {c / w:.2f}x |")
    cached.close()
    whole.close()


if __name__ == "__main__":
    main()
