"""Constrained decoding on llguidance: mask cost against the previous hand-written matcher, compile
time, and cost per token of a constrained stream against an unconstrained one (same run).

    python benchmarks/constrained.py [--rounds 3] [--tokens 32] [--before DIR] [--xgrammar]
    (DIR: a checkout of the main before llguidance, e.g. `git worktree add ../ms-before c7fb844`)

1. Mask cost per step at 1 and 8 rows, on the embedded model's tokenizer (SmolLM2, 49152 tokens):
   llguidance (bitmask of every row + the one masked_fill over the batch's logits) against the
   previous ``allowed=`` matcher (``regex`` partial matching in Python; read from ``--before``, a
   checkout of the previous main, in a separate process). Both follow the same answer token by
   token; the previous matcher only knows regular expressions, so the comparison uses the regex
   of that answer's format.
2. Compile time: a JSON Schema, a regex, and a tools grammar (cold: nothing cached), plus the
   tokenizer's conversion (once per tokenizer). ``--xgrammar`` adds xgrammar's figures (if installed).
3. Cost per token: the real model's decode time per token (``metrics.tokens_per_s``) for a stream
   under ``json_schema=`` against an unconstrained one, alone and with 8 rows in the batch (half
   constrained), rounds interleaved, medians, ratio.
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
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                   "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "tags", "city"], "additionalProperties": False,
}
ANSWER = '{"name": "Alice Smith", "age": 31, "tags": ["blue", "tall"], "city": "Rome"}'
# The same format as a regular expression (what the previous matcher can express).
ANSWER_REGEX = (r'\{"name": "[A-Za-z ]{1,24}", "age": [0-9]{1,3}, "tags": \[("[a-z]{1,12}"(, "[a-z]{1,12}"){0,2})?\], '
                r'"city": "(Paris|Rome|Oslo)"\}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

_BEFORE_SCRIPT = r'''
import json, statistics, sys, time, torch
from transformers import AutoTokenizer
from multistream.text_constraints import AllowedText
tok = AutoTokenizer.from_pretrained(sys.argv[1]); pattern, answer, rows = sys.argv[2], sys.argv[3], int(sys.argv[4])
ids = tok(answer, add_special_tokens=False)["input_ids"]
c = AllowedText(pattern, tok, frozenset({tok.eos_token_id}))
logits = torch.randn(rows, 49152)
times = []
for k in range(len(ids) + 1):
    step = []
    for _ in range(2):
        t = time.perf_counter()
        for r in range(rows):
            c.apply(logits[r:r + 1], ids[:k])
        step.append(time.perf_counter() - t)
    times.append(min(step))
print(json.dumps({"ms": statistics.median(times) * 1000}))
'''


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def mask_llguidance(tokenizer: Any, grammar: str, answer: str, rows: int) -> float:
    import torch

    from multistream.text._constraints import apply_masks, constraint_for

    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    eos = frozenset({tokenizer.eos_token_id})
    constraints = [constraint_for(grammar, tokenizer, eos, 49152) for _ in range(rows)]
    logits = torch.randn(rows, 49152)
    times = []
    for token in [*ids, None]:
        step = []
        for _ in range(5):  # the best of 5: other processes on a shared CPU only ever add time
            t = time.perf_counter()
            apply_masks(logits, constraints)  # every row's bitmask + one masked_fill over the batch
            step.append(time.perf_counter() - t)
        times.append(min(step))
        if token is not None:
            for c in constraints:
                c.consume(token)
    return _median_ms(times)


def mask_before(before: str, folder: str, rows: int) -> float | None:
    if not before or not os.path.exists(os.path.join(before, "multistream", "text_constraints.py")):
        return None
    env = {**os.environ, "PYTHONPATH": before}
    out = subprocess.run([sys.executable, "-c", _BEFORE_SCRIPT, folder, ANSWER_REGEX, ANSWER, str(rows)],
                         env=env, cwd=before, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ms"])


def compile_times(tokenizer: Any) -> dict[str, float]:
    import llguidance
    import llguidance.hf

    from multistream.text._constraints import compile_allowed, grammar_of
    from multistream.text._tools import check_tools

    out: dict[str, float] = {}
    t = time.perf_counter()
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152)
    out["tokenizer conversion (once per tokenizer)"] = (time.perf_counter() - t) * 1000
    grammars = {
        "json_schema": grammar_of(None, json.dumps(SCHEMA)),
        "regex": grammar_of(compile_allowed(ANSWER_REGEX), None),
        "tools (auto)": grammar_of(None, None, check_tools(TOOLS), "auto"),
    }
    for name, grammar in grammars.items():
        times = []
        for _ in range(5):
            t = time.perf_counter()
            m = llguidance.LLMatcher(ll, grammar, log_level=0)
            m.compute_bitmask()  # the first mask builds the lexer: part of what a stream waits for
            times.append(time.perf_counter() - t)
        out[f"{name} (compile + first mask)"] = _median_ms(times)
    return out


def xgrammar_figures(tokenizer: Any) -> dict[str, float] | None:
    try:
        import torch
        import xgrammar as xgr
    except ImportError:
        return None
    out: dict[str, float] = {}
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)
    out["tokenizer conversion"] = (time.perf_counter() - t) * 1000
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        times.append(time.perf_counter() - t)
    out["json_schema compile"] = _median_ms(times)
    ids = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    for rows in (1, 8):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        bitmask = xgr.allocate_token_bitmask(rows, 49152)
        logits = torch.randn(rows, 49152)
        times = []
        for token in [*ids, None]:
            step = []
            for _ in range(5):
                t = time.perf_counter()
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, i)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                step.append(time.perf_counter() - t)
            times.append(min(step))
            if token is not None:
                for m in matchers:
                    assert m.accept_token(token)
        out[f"mask {rows} row(s)"] = _median_ms(times)
    return out


def per_token(llm: Any, rounds: int, tokens: int) -> dict[str, float]:
    """Median decode ms per token: constrained vs unconstrained, alone and among 8 rows."""
    prompt = [{"role": "user", "content": "Describe a person as JSON with name, age, tags and city."}]
    results: dict[str, list[float]] = {"plain 1 row": [], "json 1 row": [], "plain in 8 rows": [], "json in 8 rows": []}

    def ms_per_token(final: Any) -> float:
        tps = final.metrics["tokens_per_s"]
        return 1000.0 / tps if tps else float("nan")

    for _ in range(rounds):
        # Alone; the unconstrained one is cut to the length the JSON took, so both decode as many tokens.
        json_final = llm.generate(prompt, json_schema=SCHEMA, max_new_tokens=tokens)
        n = json_final.usage["completion_tokens"]
        plain_final = llm.generate(prompt, max_new_tokens=max(2, n))
        results["json 1 row"].append(ms_per_token(json_final))
        results["plain 1 row"].append(ms_per_token(plain_final))
        # Eight rows: four under the schema and four free, all started together.
        finals: dict[int, Any] = {}

        def run(i: int, finals: dict[int, Any] = finals) -> None:
            kw: dict[str, Any] = {"json_schema": SCHEMA} if i % 2 else {}
            finals[i] = llm.generate(prompt, max_new_tokens=tokens, temperature=0.7, seed=i, **kw)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        results["json in 8 rows"].append(statistics.median(ms_per_token(finals[i]) for i in range(1, 8, 2)))
        results["plain in 8 rows"].append(statistics.median(ms_per_token(finals[i]) for i in range(0, 8, 2)))
    return {k: statistics.median(v) for k, v in results.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--before", default="", help="a checkout of the main before llguidance (its text_constraints.py); "
                   "without it the previous matcher's column is n/a")
    p.add_argument("--xgrammar", action="store_true", help="also measure xgrammar (if installed)")
    args = p.parse_args()

    import multistream as ms
    from multistream.text._constraints import compile_allowed, grammar_of

    llm = ms.load_text_model()
    tok = llm.tokenizer
    folder = getattr(tok, "name_or_path", "")

    print("## Mask cost per step (ms, median over the answer's tokens)\n")
    print("| rows | previous matcher (regex) | llguidance (same regex) | llguidance (JSON Schema) |")
    print("|---|---|---|---|")
    regex_grammar = grammar_of(compile_allowed(ANSWER_REGEX), None)
    schema_grammar = grammar_of(None, json.dumps(SCHEMA))
    for rows in (1, 8):
        before = mask_before(args.before, folder, rows)
        ll_regex = mask_llguidance(tok, regex_grammar, ANSWER, rows)
        ll_schema = mask_llguidance(tok, schema_grammar, ANSWER, rows)
        before_s = f"{before:.2f}" if before is not None else "n/a"
        ratio = f" ({before / ll_regex:.0f}x faster)" if before else ""
        print(f"| {rows} | {before_s} | {ll_regex:.3f}{ratio} | {ll_schema:.3f} |")

    print("\n## Compile time (ms, median of 5, cold)\n")
    print("| what | ms |\n|---|---|")
    for name, value in compile_times(tok).items():
        print(f"| {name} | {value:.1f} |")
    if args.xgrammar:
        figures = xgrammar_figures(tok)
        print("\n## xgrammar on the same inputs (ms)\n")
        print("| what | ms |\n|---|---|")
        for name, value in (figures or {"not installed": float("nan")}).items():
            print(f"| {name} | {value:.3f} |")

    print(f"\n## Cost per token, real model (decode ms/token, median of {args.rounds} interleaved rounds)\n")
    figures = per_token(llm, args.rounds, args.tokens)
    print("| stream | ms/token | ratio to unconstrained |\n|---|---|---|")
    for alone, batch in (("1 row", "1 row"), ("in 8 rows", "in 8 rows")):
        plain, constrained = figures[f"plain {alone}"], figures[f"json {batch}"]
        print(f"| unconstrained, {alone} | {plain:.1f} | 1.00 |")
        print(f"| json_schema, {batch} | {constrained:.1f} | {constrained / plain:.2f} |")
    llm.close()


if __name__ == "__main__":
    main()
