"""Decode speed of the embedded text model on this machine, per precision / quantization mode.

A plain process (no thread or OpenMP settings: what a user's ``python`` gets). Every mode is
loaded once, then rounds interleave the modes (machine noise hits them alike); medians over the
rounds, ratios against fp32 (``quantize=None``, the speed before quantization) measured in the
same run.

    python benchmarks/cpu_decode.py [--tokens 64] [--rounds 5] [--concurrency 8 16] [--quality]

Prints, per mode (``fp32``, ``bf16``, ``int8``, ``int4``: on the native block kernels and
decoder layers where they build, fp32 activations; ``int4-int8acts``: the same with llama.cpp's
int8 rounding of the activations; ``int4-aten``: ATen's weight-only int4 kernels, eager and
compiled, the path without a C compiler; ``*`` marks what ``load_text_model()`` gives):
single-stream decode tokens/s, TTFT and inter-token p50/p95 through ``llm.stream()``;
then the aggregate tokens/s of 8 and 16 concurrent streams (one engine, batched steps) with
their inter-token p50/p95. llama.cpp on the same GGUF file runs beside them when ``llama_cpp`` is
importable (``pip install llama-cpp-python``: a source build, ~11 minutes on 2 cores).
``--quality``: greedy agreement with fp32 (first 32 tokens of 32 prompts) and perplexity of the
paragraphs in ``tests/data``.

Targets (issue 28): the default single stream >= 1.0x llama.cpp's (0.9x the floor), TTFT <=
llama.cpp's, 8-stream aggregate >= 3x fp32's; greedy text equal to fp32's on at least 15 of 16
prompts, perplexity within 0.5 %. Run it on a quiet machine (``uptime`` load under 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Measure the checkout this file is in, whichever multistream is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp_stream  # noqa: E402  (beside this file)
import torch
from llama_cpp_stream import percentile  # noqa: E402

import multistream as ms
from multistream.testing._quality import agreement, greedy_tokens, perplexity
from multistream.text._accel.compiled_decode import compile_decode
from multistream.text._accel.quantize import quantize_model
from multistream.text._loading import AUTO_QUANTIZE_EMBEDDED_CPU, embedded_gguf_path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
PROMPT = "Write a long, detailed story about a lighthouse keeper and the sea."
MODES: dict[str, dict[str, Any]] = {
    "fp32": {"quantize": None},
    "bf16": {"quantize": None, "dtype": torch.bfloat16},
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
    # llama.cpp's arithmetic on the same kernels: activations rounded to int8 per block (an opt-in)
    "int4-int8acts": {"quantize": "int4", "activations": "int8"},
    # ATen's kernels (what a machine without a C compiler gets), quantized here after loading fp32
    "int4-aten": {"quantize": None, "aten": "int4"},
    "int4-aten+compiled": {"quantize": None, "aten": "int4", "compile_aten": True},
}
DEFAULT = AUTO_QUANTIZE_EMBEDDED_CPU  # what load_text_model() gives on a CPU (compile=False)


def load_mode(name: str, max_batch: int) -> ms.TextModel:
    options = dict(MODES[name])
    aten, compile_aten = options.pop("aten", None), options.pop("compile_aten", False)
    llm = ms.load_text_model(max_batch=max_batch, **options)
    if aten:
        llm.quantization = quantize_model(llm.model, aten, block_kernels=False)
        llm.compiled = compile_decode(llm.model) if compile_aten else None
    return llm


def prompts() -> list[str]:
    return [line for line in (DATA / "quality_prompts.txt").read_text().splitlines() if line.strip()]


def paragraphs() -> list[str]:
    return [p.strip() for p in (DATA / "paragraphs.txt").read_text().split("\n\n") if p.strip()]


def one_stream(llm: ms.TextModel, n: int) -> dict[str, float]:
    final = llm.generate(PROMPT, max_new_tokens=n)
    m = final.metrics
    return {"tok_s": m["tokens_per_s"], "ttft": m["ttft_ms"], "p50": m["itl_ms_p50"], "p95": m["itl_ms_p95"],
            "tokens": final.usage["completion_tokens"]}


def concurrent(llm: ms.TextModel, n: int, streams: int) -> dict[str, float]:
    """``streams`` streams started together; aggregate tokens/s from the first start to the last end."""
    texts = prompts()
    finals: list[Any] = [None] * streams
    gaps: list[float] = []
    lock = threading.Lock()

    def consume(i: int, stream: Any) -> None:
        last = None
        mine = []
        for ev in stream:
            now = time.perf_counter()
            if last is not None and ev.token_ids:
                mine.append((now - last) * 1000)
            last = now
        finals[i] = ev
        with lock:
            gaps.extend(mine)

    start = time.perf_counter()
    running = [llm.stream(texts[i % len(texts)] + " Answer at length.", max_new_tokens=n) for i in range(streams)]
    threads = [threading.Thread(target=consume, args=(i, s)) for i, s in enumerate(running)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(f.usage["completion_tokens"] for f in finals)
    return {"agg": tokens / wall, "p50": percentile(gaps, 0.5), "p95": percentile(gaps, 0.95), "tokens": tokens}


HERE = "llama.cpp (Q4_1 GGUF)"
ALONE = "llama.cpp, own process (no torch)"


def llama_cpp_prompt(llm: ms.TextModel) -> str:
    """The prompt as llama.cpp gets it: our chat template's text (any loaded mode has the tokenizer)."""
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                             add_generation_prompt=True)


def llama_cpp_runner(n: int, text: str) -> Any:
    """llama.cpp in this process, or None when ``llama_cpp`` is not importable."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    # As many threads as torch uses, so both sides get the same cores.
    return llama_cpp_stream.runner(str(embedded_gguf_path()), text, n, torch.get_num_threads())


def llama_cpp_alone(n: int, text: str) -> subprocess.Popen[str] | None:
    """llama.cpp in a process of its own (no torch: how its users run it), loaded and ready for
    `run_alone`, or None if it did not start."""
    script = Path(__file__).with_name("llama_cpp_stream.py")
    child = subprocess.Popen([sys.executable, str(script), str(embedded_gguf_path()), text, str(n),
                              str(torch.get_num_threads())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    if not json.loads(child.stdout.readline() or "{}").get("ready"):
        print("llama.cpp in its own process did not start")
        child.kill()
        return None
    return child


def run_alone(child: subprocess.Popen[str]) -> dict[str, float]:
    """One timed run in the llama.cpp process (interleaved with this process's rounds)."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("run\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def engine_tokens(llm: ms.TextModel, prompt: str, n: int) -> list[int]:
    """The greedy tokens of a stream (through the engine: the compiled step where there is one)."""
    return [t for ev in llm.stream(prompt, max_new_tokens=n) for t in ev.token_ids]


def quality(models: dict[str, ms.TextModel]) -> None:
    reference_model = models["fp32"]
    encoded = [reference_model.encode_prompt(p) for p in prompts()]
    eos = reference_model.eos_token_ids
    # (EOS left out: a stream's events carry no token for it)
    reference = [[t for t in greedy_tokens(reference_model.model, ids, 32, eos) if t not in eos] for ids in encoded]
    base_ppl = perplexity(reference_model.model, reference_model.tokenizer, paragraphs())
    print(f"\nquality against fp32: {len(encoded)} prompts, greedy, first 32 tokens; perplexity of "
          f"{len(paragraphs())} paragraphs (tests/data/paragraphs.txt)")
    print("| mode | shared greedy prefix (mean) | all 32 tokens equal | perplexity | vs fp32 |")
    print("|---|---|---|---|---|")
    for name, llm in models.items():
        tokens = reference if name == "fp32" else [[t for t in engine_tokens(llm, p, 32) if t not in eos]
                                                   for p in prompts()]
        shares = [agreement(r, t) for r, t in zip(reference, tokens)]
        ppl = base_ppl if name == "fp32" else perplexity(llm.model, llm.tokenizer, paragraphs())
        print(f"| {name} | {sum(shares) / len(shares):.2f} | {sum(s == 1.0 for s in shares)}/{len(shares)} | "
              f"{ppl:.3f} | {100 * (ppl / base_ppl - 1):+.1f}% |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--concurrent-modes", nargs="*", default=["fp32", DEFAULT],
                        help="modes measured with concurrent streams (default: fp32 and the default mode)")
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--quality", action="store_true", help="also measure quality against fp32 (minutes)")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed rounds (with --quality)")
    args = parser.parse_args()
    n = args.tokens

    models: dict[str, ms.TextModel] = {}
    for name in args.modes:
        started = time.perf_counter()
        models[name] = load_mode(name, max(args.concurrency + [1]))
        compiled = models[name].compiled
        note = f", decode step compiled in {compiled.seconds:.0f} s" if compiled and compiled.compiled else ""
        print(f"loaded {name}: {models[name].quantization.describe()}{note} ({time.perf_counter() - started:.1f} s)")
    prompt_text = llama_cpp_prompt(next(iter(models.values())))
    llama = llama_cpp_runner(n, prompt_text)
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads "
          f"({torch.backends.cpu.get_cpu_capability()}), prompt {len(next(iter(models.values())).encode_prompt(PROMPT))} tokens, "
          f"{n} greedy tokens, {args.rounds} interleaved rounds")
    if llama is None:
        print("llama.cpp: not importable, skipped (pip install llama-cpp-python: a source build, ~11 min on 2 cores)")

    if not args.no_speed:
        speed(models, llama, prompt_text, args)
    if args.quality:
        quality(models)
    for llm in models.values():
        llm.close()


def speed(models: dict[str, ms.TextModel], llama: Any, prompt_text: str, args: argparse.Namespace) -> None:
    n = args.tokens
    for llm in models.values():  # warm-up: first calls allocate and pick kernels
        llm.generate(PROMPT, max_new_tokens=8)
    single: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    if llama is not None:
        llama()
        single[HERE] = []
    alone = llama_cpp_alone(n, prompt_text) if llama is not None else None
    if alone is not None:
        single[ALONE] = []
    multi: dict[tuple[str, int], list[dict[str, float]]] = {
        (name, c): [] for c in args.concurrency for name in args.concurrent_modes if name in models}
    for _ in range(args.rounds):
        for name, llm in models.items():
            single[name].append(one_stream(llm, n))
        if llama is not None:
            single[HERE].append(llama())
        if alone is not None:
            single[ALONE].append(run_alone(alone))
        for (name, c), runs in multi.items():
            runs.append(concurrent(models[name], n, c))
    if alone is not None:
        alone.kill()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def ratio(runs: list[dict[str, float]], name: str) -> str:
        return f"{med(runs, 'tok_s') / med(single[name], 'tok_s'):.2f}x" if name in single else "-"

    print("\nsingle stream (llm.stream, greedy):")
    print("| mode | decode tok/s | vs fp32 | vs llama.cpp here | vs llama.cpp alone | TTFT ms | inter-token p50 ms | "
          "p95 ms | tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in single.items():
        mark = " *" if name == DEFAULT else ""
        print(f"| {name}{mark} | {med(runs, 'tok_s'):.1f} | {ratio(runs, 'fp32')} | {ratio(runs, HERE)} | {ratio(runs, ALONE)} | "
              f"{med(runs, 'ttft'):.0f} | {med(runs, 'p50'):.1f} | {med(runs, 'p95'):.1f} | {med(runs, 'tokens'):.0f} |")
    if multi:
        print("\nconcurrent streams (one engine, batched decode steps):")
        print("| mode | streams | aggregate tok/s | vs fp32 | inter-token p50 ms | p95 ms |")
        print("|---|---|---|---|---|---|")
        for (name, c), runs in multi.items():
            ref = multi.get(("fp32", c))
            ratio = f"{med(runs, 'agg') / med(ref, 'agg'):.2f}x" if ref else "-"
            print(f"| {name} | {c} | {med(runs, 'agg'):.1f} | {ratio} | {med(runs, 'p50'):.1f} | {med(runs, 'p95'):.1f} |")


if __name__ == "__main__":
    main()
