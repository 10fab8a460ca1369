"""EXPERIMENT, not shipped: a static draft table (the model's usual next token after two tokens) as a
second draft source for exact lookahead, beside prompt lookup.

    python scripts/experiments/draft_table.py [--costs 0.2,0.3] [--prior 0.6] [--prior-weight 2] [--only-unmatched]

Status (2026-12-07, measured here; negative): not worth shipping. Open-ended text repeats little of
its prompt, but a small model phrases alike across answers, and llama.cpp's ``lookup-static`` drafts
from an n-gram cache of a corpus for that reason. This builds such a cache for the embedded model
from its own greedy answers (``max_new_tokens=160``) to 450 questions made from the Python standard
library's *subpackages* (`benchmarks/lookahead_breadth.py` asks about its top-level modules, so its
prompts stay unseen) and from templates (stories, poems, descriptions, explanations for a child);
none of `benchmarks/lookahead.py`'s prompts is among them. 48,021 answer tokens (485-582 s on 2 cores,
cached in multistream's cache folder) gave 3,988 entries (two tokens -> the token that followed
most often, at least twice and in at least half the cases).

It then replays the engine's `Lookahead` over the greedy answers of `lookahead.py`'s five tasks and
`lookahead_breadth.py`'s 23 prompts (as `benchmarks/lookahead_policies.py` does: exact steps, speed
modelled at ``1 + c * drafts`` a step), with and without the table as a fallback where the
request's own text offers no draft that pays, the table's drafts weighed by an acceptance rate of
their own (decayed like the n-gram sizes' rates, from ``--prior``). Figures (new / engine alone):

| prior, weight | c | summary | code | quote | JSON | story | breadth medians: summaries, quotes, code, open-ended (min quote) |
|---|---|---|---|---|---|---|---|
| 0.6, 2 | 0.2 | 0.998 | 1.000 | 1.000 | 0.995 | 0.995 | 1.006, 0.991, 0.999, 1.043 (0.984) |
| 0.6, 2 | 0.3 | 0.997 | 1.000 | 1.000 | 0.992 | 0.993 | 1.002, 0.987, 0.998, 1.031 (0.976) |
| 0.6, 6 | 0.2 | 0.998 | 1.000 | 1.000 | 0.992 | 1.024 | 1.002, 0.982, 1.008, 1.002 (0.968) |
| 0.75, 10 | 0.2 | 0.996 | 1.000 | 1.000 | 0.989 | 1.070 | 1.006, 0.966, 1.007, 1.077 (0.952) |
| 0.75, 10, ``--only-unmatched`` | 0.2 | 0.996 | 1.000 | 1.000 | 0.995 | 1.055 | 1.000, 0.994, 0.996, 1.028 (0.968) |

(``--only-unmatched``: the table drafts only where not even the context's last token occurred
before.) The table's first drafts were kept at 0.51 (45 of 88) on those answers, about the
engine's break-even for a row alone (a draft costs a position, a row's step two), so the rate gate soon closes it;
opened wider (a prior of 0.75 weighing 10 drafts: 73 of 172 kept) it drafts more and costs the
quotes and JSON (whose misses are where the request's own matches failed) about what it gives the
stories. A few percent either way, modelled, against runs of the benchmark that spread by 10 %:
not worth a shipped data file and a second draft source in the engine. Ungated on the benchmark's
story, 18 of its 30 first drafts were kept: the gain would need drafts run whatever their
acceptance, which costs on a busy host. An earlier, ungated replay on a smaller corpus (24k tokens
of answers about installed third-party packages' docstrings, not built by this script) gave the
same picture with 3-token keys (the story about 1.05 tokens a step against 1.08 with 2), and held-out
entries seen 5+ times with a share of 0.9+ were kept at 0.55 (48 of 87).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import statistics
import sys
import sysconfig
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lookahead_breadth import _functions, _paragraphs  # noqa: E402
from lookahead_breadth import tasks as breadth_tasks  # noqa: E402
from lookahead_policies import modelled_speed, record, replay  # noqa: E402

import multistream as ms  # noqa: E402
from multistream._cache import cache_dir  # noqa: E402
from multistream.text._lookahead import _DECAY, _RECOVER, AUTO_CAP, Lookahead, draft_length  # noqa: E402

SKIP = {"test", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip", "venv"}

SUBJECTS = ("an old sailor", "a robot", "a young girl", "a baker", "a lonely dragon", "two brothers", "a cat",
            "a teacher", "a musician", "a tiny mouse", "a farmer", "a king", "an astronaut", "a detective",
            "a grandmother", "a bird", "a painter", "a shy boy", "a gardener", "a bear")
DEEDS = ("loses a friend", "builds a house", "travels to the city", "discovers a secret", "plants a garden",
         "meets a stranger", "wins a race", "fixes a clock", "writes a letter", "climbs a mountain",
         "opens a shop", "learns to dance", "finds a lost dog", "moves to a new town")
TOPICS = ("the ocean", "autumn leaves", "friendship", "the night sky", "rain in the city", "a quiet library",
          "the first snow", "a summer festival", "old trains", "the desert", "a river", "morning coffee",
          "the moon", "a forest", "a mountain village", "a thunderstorm", "spring flowers", "an empty beach")
THINGS = ("a volcano", "electricity", "a rainbow", "gravity", "the internet", "a computer", "money", "a cloud",
          "an island", "a magnet", "the seasons", "a bridge", "plants", "the heart", "sound", "the sun")


def _subpackage_sources() -> list[tuple[str, ast.Module]]:
    """(source, syntax tree) of the standard library's subpackage modules, by path (not imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*/**/*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in SKIP or parts[0].startswith("_") or "tests" in parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            out.append((source, ast.parse(source)))
        except (UnicodeDecodeError, SyntaxError):
            continue
    return out


def prompts(summaries: int, quotes: int, rewrites: int, open_ended: int, seed: int = 0) -> list[str]:
    """The corpus's questions, the same for a Python version and seed."""
    rng = random.Random(seed)
    modules = _subpackage_sources()
    paragraphs = _paragraphs(modules, shortest=300, every_docstring=True)
    rng.shuffle(paragraphs)
    functions = _functions(modules)
    rng.shuffle(functions)
    out = [f"Summarise this text in a few sentences:\n\n{p}" for p in paragraphs[:summaries]]
    for p in paragraphs[summaries:summaries + quotes]:
        word = rng.choice(re.findall(r"[a-z]{7,}", p) or ["it"])
        out.append(f"Answer by quoting the context exactly.\n\nContext: {p}\n\nQuestion: What does the context say "
                   f"about {word}?")
    for source, name in functions[:rewrites]:
        out.append(f"Rewrite this Python function with the variable `{name}` renamed to `{name}_value`. Reply with "
                   f"the code only.\n\n{source}")
    for i in range(open_ended):
        kind = i % 4
        if kind == 0:
            out.append(f"Write a story about {rng.choice(SUBJECTS)} who {rng.choice(DEEDS)}.")
        elif kind == 1:
            out.append(f"Write a poem about {rng.choice(TOPICS)}.")
        elif kind == 2:
            out.append(f"Describe {rng.choice(TOPICS)} in a short paragraph.")
        else:
            out.append(f"Explain to a child what {rng.choice(THINGS)} is.")
    return out


def answers(llm: Any, questions: list[str], tokens: int, streams: int = 8) -> list[list[int]]:
    """The model's greedy answers (token ids), ``streams`` at a time (the engine batches them)."""
    out: list[list[int]] = [[] for _ in questions]
    lock = threading.Lock()
    queue = list(range(len(questions)))[::-1]

    def work() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop()
            for ev in llm.stream([{"role": "user", "content": questions[i]}], max_new_tokens=tokens, temperature=0.0):
                out[i].extend(ev.token_ids)

    threads = [threading.Thread(target=work) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def table(answer_ids: list[list[int]], min_count: int = 2, min_share: float = 0.5) -> dict[tuple[int, int], int]:
    """``(a, b) -> c``: the token that followed ``a, b`` most often, where it qualifies."""
    follows: dict[tuple[int, int], Counter[int]] = defaultdict(Counter)
    for ids in answer_ids:
        for i in range(2, len(ids)):
            follows[(ids[i - 2], ids[i - 1])][ids[i]] += 1
    out = {}
    for key, counts in follows.items():
        token, count = counts.most_common(1)[0]
        if count >= min_count and count / sum(counts.values()) >= min_share:
            out[key] = token
    return out


class TableLookahead(Lookahead):
    """The engine's drafting, and where it drafts nothing, a chain from the table at a rate of its own."""

    def __init__(self, entries: dict[tuple[int, int], int], prior: float, weight: float,
                 only_unmatched: bool = False) -> None:
        super().__init__(AUTO_CAP)
        self.entries, self.prior, self.weight, self.only_unmatched = entries, prior, weight, only_unmatched
        self.tried, self.kept = weight, weight * prior
        self.from_table = False
        self.first = [0, 0]  # table chains run, and those whose first draft was kept

    def drafts(self, context: list[int], *, rows: int, room: int, **kw: Any) -> list[int]:
        # drifts back to the prior, as the engine's rates do
        self.tried = self.tried * _RECOVER + (1 - _RECOVER) * self.weight
        self.kept = self.kept * _RECOVER + (1 - _RECOVER) * self.weight * self.prior
        self.from_table = False
        own = super().drafts(context, rows=rows, room=room, **kw)
        if own or room <= 0 or (self.only_unmatched and (context[-1],) in self._index):
            return own
        k = draft_length(self.kept / self.tried, rows=rows, limit=min(self.cap, room))
        out: list[int] = []
        a, b = context[-2], context[-1]
        while len(out) < k and (a, b) in self.entries:
            out.append(self.entries[(a, b)])
            a, b = b, out[-1]
        self.from_table = bool(out)
        return out

    def verified(self, drafted: int, kept: int) -> None:
        if not self.from_table:
            super().verified(drafted, kept)
            return
        self.first[0] += 1
        self.first[1] += kept > 0
        self.tried = self.tried * _DECAY + kept + (1 if kept < drafted else 0)
        self.kept = self.kept * _DECAY + kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", default="0.2,0.3")
    parser.add_argument("--prior", type=float, default=0.6)
    parser.add_argument("--prior-weight", type=float, default=2.0)
    parser.add_argument("--only-unmatched", action="store_true", help="table drafts only where the last token is new")
    args = parser.parse_args()
    llm = ms.load_text_model()
    cached = cache_dir() / "draft_table_corpus.json"
    if cached.exists():
        corpus = json.loads(cached.read_text())
    else:
        start = time.perf_counter()
        corpus = answers(llm, prompts(150, 40, 60, 200), 160)
        cached.write_text(json.dumps(corpus))
        print(f"corpus: {sum(map(len, corpus))} answer tokens in {time.perf_counter() - start:.0f} s")
    entries = table(corpus)
    held_out = record(llm, 128)
    held_out.update(record(llm, 128, {name: (messages, {}) for name, (_, messages) in breadth_tasks(6).items()}))
    llm.close()
    print(f"{len(entries)} entries; new / engine alone, modelled:")
    # A replay's steps do not depend on the cost, only the modelled speed does: each policy once per answer.
    runs = {}
    for name, (prompt, answer) in held_out.items():
        look = TableLookahead(entries, args.prior, args.prior_weight, args.only_unmatched)
        runs[name] = (replay(prompt, answer, look), replay(prompt, answer, Lookahead(AUTO_CAP)), look.first)
    first = [sum(f[0] for *_, f in runs.values()), sum(f[1] for *_, f in runs.values())]
    for cost in (float(c) for c in args.costs.split(",")):
        kinds: dict[str, list[float]] = defaultdict(list)
        for name, (with_table, alone, _) in runs.items():
            tokens = len(held_out[name][1]) - 1
            ratio = modelled_speed(tokens, with_table, cost) / modelled_speed(tokens, alone, cost)
            if name[-1].isdigit():
                kinds[name.rstrip("0123456789")].append(ratio)
            else:
                print(f"  c={cost} {name}: {ratio:.3f}")
        for kind, ratios in kinds.items():
            print(f"  c={cost} breadth {kind}: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}")
    print(f"  the table's first drafts kept: {first[1]} of {first[0]}")

if __name__ == "__main__":
    main()
