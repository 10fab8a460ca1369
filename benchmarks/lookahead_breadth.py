"""Exact lookahead on more prompts than `lookahead.py`'s one per task: texts nobody here chose.

    python benchmarks/lookahead_breadth.py [--rounds 3] [--tokens 128] [--per-kind 6] [--min-decode 0.5]

`lookahead.py` measures one prompt per task (the issue's five). This builds more of each copying
kind from the Python standard library the benchmark runs on (fixed for a Python version, and
written by others): summaries of its modules' longest prose docstrings, code rewrites of its
functions of 12-30 lines with one variable renamed, and answers that quote the sentence of a
docstring that mentions a word; then open-ended prompts. The modules, functions and sentences
are picked in a fixed order by a seeded generator, so every run asks the same questions. Each
prompt runs greedily with the default (``speculate="auto"``) and with ``speculate=0``, the two
interleaved in alternating order, rounds repeated; it prints each prompt's tokens/s ratio (median
of the rounds) and tokens per step, the median ratio of each kind, and checks the texts are
identical. As in `lookahead.py`, each reading decodes for at least ``--min-decode`` seconds: a short
answer (a quote of 14 tokens) is streamed again until its decodes add up to that.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import statistics
import sysconfig
import textwrap
from functools import partial
from pathlib import Path
from typing import Any

from lookahead import in_order, repeated, stream_once

import multistream as ms

STORIES = ("Write a story about a fox who learns to sail.", "Write a poem about winter mornings.",
           "Explain why the sky is blue to a child.", "Write a short letter inviting a friend to dinner.",
           "Describe a busy market in a small town.")


def _stdlib_modules() -> list[tuple[str, ast.Module]]:
    """(source, syntax tree) of the standard library's public top-level modules, by name, each read
    and parsed once (with ``ast``, not imported: no module runs)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(folder.glob("*.py"), key=lambda p: p.stem):
        if path.stem.startswith("_") or path.stem == "antigravity":
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            out.append((source, ast.parse(source)))
        except SyntaxError:
            continue
    return out


def _paragraphs(modules: list[tuple[str, ast.Module]], *, shortest: int = 400,
                every_docstring: bool = False) -> list[str]:
    """Prose paragraphs of ``shortest``-1200 characters from the modules' docstrings (with
    ``every_docstring``, their classes' and functions' too), without code, tables or lists."""
    out = []
    for _, tree in modules:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))] \
            if every_docstring else [tree]
        for node in nodes:
            for para in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                flat = " ".join(para.split())
                letters = sum(c.isalpha() or c.isspace() for c in flat) / max(len(flat), 1)
                if shortest <= len(flat) <= 1200 and letters > 0.9 and not re.search(r">>>|\||==|^\s*[-*]", para, re.M):
                    out.append(flat)
    return out


def _functions(modules: list[tuple[str, ast.Module]]) -> list[tuple[str, str]]:
    """(source, a variable it assigns) of the modules' functions of 12-30 lines."""
    out = []
    for source, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 12 <= node.end_lineno - node.lineno + 1 <= 30:  # type: ignore[operator]
                names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                                and isinstance(n.ctx, ast.Store) and len(n.id) > 3})
                segment = ast.get_source_segment(source, node)
                if names and segment and segment.startswith("def "):
                    out.append((textwrap.dedent(segment), names[0]))
    return out


def tasks(per_kind: int, seed: int = 0) -> dict[str, tuple[str, list[dict[str, str]]]]:
    """name -> (kind, chat messages): ``per_kind`` summaries, code rewrites and quotes, then the stories."""
    rng = random.Random(seed)
    modules = _stdlib_modules()
    paragraphs = _paragraphs(modules)
    rng.shuffle(paragraphs)
    functions = _functions(modules)
    rng.shuffle(functions)
    out: dict[str, tuple[str, list[dict[str, str]]]] = {}
    for i, text in enumerate(paragraphs[:per_kind]):
        out[f"summary{i}"] = ("summary", [{"role": "user", "content": "Summarise this text in a few sentences, "
                                           "keeping its key facts and names.\n\n" + text}])
    quotes = 0
    for text in paragraphs[per_kind:]:
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 60 < len(s) < 250]
        if quotes == per_kind:
            break
        words = [w for s in sentences[:1] for w in re.findall(r"[A-Za-z]{7,}", s) if text.count(w) == 1]
        if not words:
            continue
        out[f"quote{quotes}"] = ("quote", [{"role": "user", "content": "Answer by quoting the context word for "
                                            f"word.\n\nContext: {text}\n\nQuestion: Which sentence mentions "
                                            f"'{rng.choice(words)}'?"}])
        quotes += 1
    for i, (source, name) in enumerate(functions[:per_kind]):
        out[f"code{i}"] = ("code", [{"role": "user", "content": f"Rewrite this Python function with the variable "
                                     f"`{name}` renamed to `{name}_value`. Change nothing else and output the "
                                     f"whole function.\n\n{source}"}])
    for i, prompt in enumerate(STORIES):
        out[f"story{i}"] = ("story", [{"role": "user", "content": prompt}])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--per-kind", type=int, default=6)
    parser.add_argument("--min-decode", type=float, default=0.5,
                        help="seconds of decoding each reading sums at least (a short answer is streamed again)")
    args = parser.parse_args()
    chosen = tasks(args.per_kind)
    llm = ms.load_text_model()
    print(f"load average before: {os.getloadavg()}", flush=True)
    runs: dict[str, list[dict[Any, dict[str, Any]]]] = {name: [] for name in chosen}
    for round_ in range(args.rounds):
        for name, (_, messages) in chosen.items():
            got = {spec: repeated(partial(stream_once, llm, messages, {}, args.tokens, spec), args.min_decode)
                   for spec in in_order(round_)}
            assert got["auto"]["text"] == got[0]["text"], f"{name}: the default's text differs from speculate=0's"
            runs[name].append(got)
    llm.close()
    print(f"load average after: {os.getloadavg()}")
    print("| prompt | tokens | default tok/s | speculate=0 tok/s | ratio | tokens per step | same text |")
    print("|---|---|---|---|---|---|---|")
    by_kind: dict[str, list[float]] = {}
    for name, rounds in runs.items():
        ratio = statistics.median(r["auto"]["tok_s"] / r[0]["tok_s"] for r in rounds)
        first = rounds[0]["auto"]
        by_kind.setdefault(chosen[name][0], []).append(ratio)
        print(f"| {name} | {first['tokens']} | {statistics.median(r['auto']['tok_s'] for r in rounds):.1f} | "
              f"{statistics.median(r[0]['tok_s'] for r in rounds):.1f} | {ratio:.2f}x | "
              f"{(first['tokens'] - 1) / max(first['steps'], 1):.2f} | yes |")
    for kind, ratios in by_kind.items():
        print(f"{kind}: median {statistics.median(ratios):.2f}x, from {min(ratios):.2f}x to {max(ratios):.2f}x "
              f"({len(ratios)} prompts)")


if __name__ == "__main__":
    main()
