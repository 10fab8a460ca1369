"""Streaming overhead on the embedded text model: ``llm.stream()`` against plain ``generate()``.

In one process, interleaved rounds (so machine noise hits every method alike), greedy decoding,
the same prompt and the same number of new tokens; medians over the rounds.

    python benchmarks/text_stream.py [--tokens 128] [--rounds 5] [--model PATH]

Prints tokens/s of each method and their ratios to plain ``model.generate()``:
- ``ms.stream``: our stream consumed by a ``for`` loop (target ratio >= 0.97),
- ``TextIteratorStreamer``: transformers' streamer read from another thread,
- the naive loop that calls ``generate(max_new_tokens=1)`` once per token without a KV cache,
and TTFT of ``ms.stream`` minus the time of one prefill-plus-first-token forward (target <= 10 ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time


import torch  # noqa: E402

import multistream as ms  # noqa: E402

PROMPT = "Write a long, detailed story about a lighthouse keeper and the sea."


def run_plain(llm: ms.TextModel, ids: torch.Tensor, n: int) -> tuple[float, int]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = llm.model.generate(ids, max_new_tokens=n, do_sample=False)
    return time.perf_counter() - start, out.shape[1] - ids.shape[1]


def run_stream(llm: ms.TextModel, n: int) -> tuple[float, int, float]:
    start = time.perf_counter()
    first = None
    for ev in llm.stream(PROMPT, max_new_tokens=n):
        if first is None:
            first = time.perf_counter() - start
    final = ev
    return time.perf_counter() - start, final.usage["completion_tokens"] + (final.finish_reason == "stop"), first or 0.0


def run_text_iterator_streamer(llm: ms.TextModel, ids: torch.Tensor, n: int) -> tuple[float, int]:
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(llm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()

    def work() -> None:
        with torch.inference_mode():
            out = llm.model.generate(ids, max_new_tokens=n, do_sample=False, streamer=streamer)
        result.append(out.shape[1] - ids.shape[1])

    result: list[int] = []
    thread = threading.Thread(target=work)
    thread.start()
    for _ in streamer:
        pass
    thread.join()
    return time.perf_counter() - start, result[0]


def run_naive(llm: ms.TextModel, ids: torch.Tensor, n: int) -> tuple[float, int]:
    start = time.perf_counter()
    seq = ids
    with torch.inference_mode():
        for _ in range(n):
            seq = llm.model.generate(seq, max_new_tokens=1, do_sample=False, use_cache=False)
            if int(seq[0, -1]) in llm.eos_token_ids:
                break
    return time.perf_counter() - start, seq.shape[1] - ids.shape[1]


def prefill_time(llm: ms.TextModel, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        out = llm.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        int(torch.argmax(out.logits[0, -1]))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--naive-rounds", type=int, default=1, help="the naive loop is slow; 1 round by default")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    llm = ms.load_text_model(args.model)
    ids = torch.tensor([llm.encode_prompt(PROMPT)])
    n = args.tokens
    print(f"model {llm.name} on {llm.device}, {torch.get_num_threads()} threads, prompt {ids.shape[1]} tokens, "
          f"{n} greedy tokens, {args.rounds} interleaved rounds")

    run_plain(llm, ids, 8)  # warm-up: first calls allocate
    run_stream(llm, 8)
    rates: dict[str, list[float]] = {"plain generate()": [], "ms.stream()": [], "TextIteratorStreamer": []}
    ttfts, prefills, counts = [], [], set()
    for _ in range(args.rounds):
        seconds, tokens = run_plain(llm, ids, n)
        rates["plain generate()"].append(tokens / seconds)
        counts.add(("plain", tokens))
        seconds, tokens, ttft = run_stream(llm, n)
        rates["ms.stream()"].append(tokens / seconds)
        counts.add(("stream", tokens))
        ttfts.append(ttft)
        seconds, tokens = run_text_iterator_streamer(llm, ids, n)
        rates["TextIteratorStreamer"].append(tokens / seconds)
        prefills.append(prefill_time(llm, ids))
    naive = [tokens / seconds for seconds, tokens in (run_naive(llm, ids, n) for _ in range(args.naive_rounds))]

    base = statistics.median(rates["plain generate()"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:24s} {median:8.2f} tokens/s   ratio {median / base:.3f}   (runs: {', '.join(f'{v:.1f}' for v in values)})")
    print(f"{'naive loop, no KV cache':24s} {statistics.median(naive):8.2f} tokens/s   ratio {statistics.median(naive) / base:.3f}")
    ttft, prefill = statistics.median(ttfts) * 1000, statistics.median(prefills) * 1000
    print(f"ms.stream() TTFT {ttft:.1f} ms, one prefill+first-token forward {prefill:.1f} ms, "
          f"overhead {ttft - prefill:.1f} ms (target <= 10 ms)")
    print(f"tokens per run: {sorted(counts)}")


if __name__ == "__main__":
    main()
