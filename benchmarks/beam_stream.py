"""Streaming beam search on the embedded text model: ``llm.stream(num_beams=4)`` beside
``model.generate(num_beams=4)``, which returns nothing until it ends.

In one process, interleaved rounds (so machine noise hits both alike), the same prompts and
``max_new_tokens``; medians over prompts and rounds.

    python benchmarks/beam_stream.py [--beams 4] [--tokens 48] [--rounds 2] [--model PATH]

Prints, per prompt and overall:
- ``first committed``: seconds until the stream's first committed character (text that can no
  longer change), beside the seconds ``generate(num_beams=k)`` takes to return anything;
- ``committed before end``: the share of the final text committed before the final event;
- tok/s of the stream (answer tokens over its wall time) against ``generate``'s, and the median of
  their per-run ratios;
- whether the final texts are equal (they must be).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import multistream as ms

PROMPTS = [
    "Write a haiku about rivers",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning to cook.",
]


def run_generate(llm: ms.TextModel, prompt: str, k: int, n: int) -> tuple[float, str, int]:
    ids = llm.encode_prompt(prompt)
    start = time.perf_counter()
    with torch.inference_mode():
        out = llm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 num_beams=k, do_sample=False, max_new_tokens=n)
    elapsed = time.perf_counter() - start
    answer = out[0, len(ids):].tolist()
    eos = llm.eos_token_ids
    tokens = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
    return elapsed, llm.tokenizer.decode(answer, skip_special_tokens=True), tokens


def run_stream(llm: ms.TextModel, prompt: str, k: int, n: int) -> tuple[float, float | None, float, str, int]:
    start = time.perf_counter()
    first_committed = None
    committed_before_end = 0
    for ev in llm.stream(prompt, num_beams=k, max_new_tokens=n):
        if not ev.is_final:
            committed_before_end = max(committed_before_end, ev.committed)
            if first_committed is None and ev.committed > 0:
                first_committed = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    share = committed_before_end / len(ev.text) if ev.text else 1.0
    return elapsed, first_committed, share, ev.text or "", ev.usage["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    llm = ms.load_text_model(args.model)
    k, n = args.beams, args.tokens
    run_stream(llm, PROMPTS[0], k, 4)  # warm up both paths
    run_generate(llm, PROMPTS[0], k, 4)
    rows: dict[str, list[tuple[float, float | None, float, float, float, bool]]] = {p: [] for p in PROMPTS}
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            g_time, g_text, g_tokens = run_generate(llm, prompt, k, n)
            s_time, first, share, s_text, s_tokens = run_stream(llm, prompt, k, n)
            rows[prompt].append((g_time, first, share, g_tokens / g_time, s_tokens / s_time, g_text == s_text))
    print(f"num_beams={k}, max_new_tokens={n}, {args.rounds} interleaved rounds, medians; device {llm.device}\n")
    print("| prompt | generate returns (s) | first committed char (s) | committed before end | "
          "generate tok/s | stream tok/s | ratio | same text |")
    print("|---|---|---|---|---|---|---|---|")
    everything = []
    for prompt, runs in rows.items():
        everything.extend(runs)
        _print_row(prompt[:32], runs)
    _print_row("**all**", everything)


def _print_row(label: str, runs: list[tuple[float, float | None, float, float, float, bool]]) -> None:
    med = statistics.median
    firsts = [r[1] for r in runs if r[1] is not None]
    first = f"{med(firsts):.2f}" if firsts else "none"
    g_tps, s_tps = med([r[3] for r in runs]), med([r[4] for r in runs])
    ratio = med([r[4] / r[3] for r in runs])  # per run (same round, same prompt), then the median
    print(f"| {label} | {med([r[0] for r in runs]):.2f} | {first} | {med([r[2] for r in runs]):.0%} | "
          f"{g_tps:.1f} | {s_tps:.1f} | {ratio:.2f} | {all(r[5] for r in runs)} |")


if __name__ == "__main__":
    main()
