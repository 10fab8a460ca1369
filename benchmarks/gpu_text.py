"""GPU check of text quantization: SmolLM2-1.7B's layout with random weights, bf16 / int8 / int4.

Builds a Llama with SmolLM2-1.7B-Instruct's configuration (24 layers, hidden 2048, MLP 8192, 32
heads, vocab 49152, tied embeddings; 1.7B parameters) with random weights and the embedded
model's tokenizer (same vocabulary; nothing is downloaded), then for each mode quantizes it the
way ``load_text_model(quantize=...)`` does (`quantize_model`) and measures through
``llm.stream()``: weight memory, peak GPU memory, single-stream decode tokens/s and TTFT, and the
aggregate tokens/s of 8 concurrent streams.
EOS is biased away (random weights would end answers at random lengths).

    python benchmarks/gpu_check.py --text          # on a CUDA machine (not yet run on one)
    python benchmarks/gpu_check.py --text --tiny   # anywhere: a narrow model on the CPU, to check the script
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from typing import Any

import torch

MODES = (None, "int8", "int4")


def smollm2_1_7b_config(tiny: bool, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    if tiny:
        sizes = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 4}
    else:  # SmolLM2-1.7B-Instruct's config.json
        sizes = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
                 "num_key_value_heads": 32}
    return LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=8192, rope_theta=130000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, **sizes)


def build(mode: str | None, config: Any, device: torch.device, dtype: torch.dtype, tokenizer: Any) -> Any:
    from transformers import LlamaForCausalLM

    import multistream as ms
    from multistream.text._accel.quantize import quantize_model

    torch.manual_seed(0)
    with torch.device(device):  # a copy of the config: quantizing unties the head in the config it is given
        model = LlamaForCausalLM(copy.deepcopy(config)).to(dtype).eval()
    report = quantize_model(model, mode)  # as load_text_model does (row attention included)
    llm = ms.TextModel(model, tokenizer, name=f"smollm2-1.7b-layout-{mode or 'bf16'}", max_batch=16)
    llm.quantization = report
    return llm


def single(llm: Any, prompt: str, n: int, no_eos: dict[str, float]) -> dict[str, float]:
    final = llm.generate(prompt, max_new_tokens=n, logit_bias=no_eos)
    m = final.metrics
    return {"tok_s": m["tokens_per_s"], "ttft": m["ttft_ms"], "p95": m["itl_ms_p95"]}


def concurrent(llm: Any, prompt: str, n: int, streams: int, no_eos: dict[str, float]) -> float:
    finals: list[Any] = [None] * streams
    started = time.perf_counter()
    running = [llm.stream(f"{prompt} ({i})", max_new_tokens=n, logit_bias=no_eos) for i in range(streams)]
    threads = [threading.Thread(target=lambda i=i: finals.__setitem__(i, running[i].wait())) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(f.usage["completion_tokens"] for f in finals) / (time.perf_counter() - started)


def run(tiny: bool, reps: int = 3, tokens: int = 128, streams: int = 8, log: Any = print,
        tokenizer_dir: str | None = None, modes: tuple[str | None, ...] = MODES) -> dict[str, dict[str, float]]:
    from transformers import AutoTokenizer

    from multistream.text._loading import _embedded_model_folder

    if tiny:
        device, dtype, tokens = torch.device("cpu"), torch.float32, 16
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or _embedded_model_folder())
    config = smollm2_1_7b_config(tiny, tokenizer)
    no_eos = {str(t): -100.0 for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}}
    prompt = "Write a long, detailed story about a lighthouse keeper and the sea."
    results: dict[str, dict[str, float]] = {}
    for mode in modes:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        llm = build(mode, config, device, dtype, tokenizer)
        try:
            llm.generate(prompt, max_new_tokens=8, logit_bias=no_eos)  # warm-up: kernels, allocator
            runs = [single(llm, prompt, tokens, no_eos) for _ in range(reps)]
            aggregate = statistics.median(concurrent(llm, prompt, tokens, streams, no_eos) for _ in range(reps))
            name = mode or ("bf16" if dtype == torch.bfloat16 else "fp32")
            results[name] = {
                "weights_mib": llm.quantization.bytes_after / 2**20 if llm.quantization.mode else
                sum(p.numel() * p.element_size() for p in llm.model.parameters()) / 2**20,
                "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan"),
                "tok_s": statistics.median(r["tok_s"] for r in runs),
                "ttft": statistics.median(r["ttft"] for r in runs),
                "p95": statistics.median(r["p95"] for r in runs),
                "aggregate": aggregate,
            }
            log(f"{name}: {llm.quantization.describe()}; {results[name]}")
        finally:
            llm.close()
            del llm
    return results


def print_table(results: dict[str, dict[str, float]], streams: int = 8) -> None:
    base = next(iter(results.values()))
    print(f"| mode | weights MiB | peak GPU MiB | decode tok/s | vs first | TTFT ms | p95 ms | {streams} streams tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['weights_mib']:.0f} | {r['peak_mib']:.0f} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / base['tok_s']:.2f}x | {r['ttft']:.0f} | {r['p95']:.1f} | {r['aggregate']:.1f} |")
