"""Drafting policies for exact lookahead, replayed over the default model's greedy answers.

    python benchmarks/lookahead_policies.py [--tokens 128] [--costs 0.2,0.33]

A greedy answer does not depend on how it was drafted (lookahead is exact), so a policy's steps
can be counted without the model: record each task's answer once (``speculate=0``), then replay a
policy over it: at each step it proposes drafts from the prompt and the answer so far, the drafts
that equal the answer's next tokens are kept, and the step yields those plus one token. That gives
tokens per decode step and drafted positions exactly (the engine's own `Lookahead` replays to the
benchmark's tokens per step: summary 1.37 here against 1.36 measured). Speed is then modelled:
a step with ``k`` drafts costs ``1 + c * k`` one-token steps. ``c``, an extra position's cost, is
an estimate from two measurements on 2 cores: an extra position cost 0.10-0.17 of a whole
``model()`` forward of one token (forwards of 2-11 tokens), and that forward (19 ms under load)
took about twice the engine's decode step (10 ms at ``speculate=0``, another run): so 0.2-0.33.

Policies:
- ``engine``: multistream's `Lookahead` (3/2/1-gram match, latest occurrence, draft length from the
  request's decayed acceptance rate against the step's cost);
- ``suffix a,b,m``: vLLM suffix decoding's rule on the prompt and answer: the longest suffix of the
  context (at least ``m`` tokens) found earlier, the latest such occurrence, ``a * match + b``
  drafts (at most 10);
- ``classed``: the engine's rule (3/2/1-gram match, draft length from decayed acceptance against
  the step's cost), with its acceptance rates kept apart by how the n-gram's earlier occurrences
  went on (one occurrence, several that agree, several that do not), since a rare token's one
  occurrence is a likelier copy than a common word's latest; ``classed + cursor`` also takes, for
  an n-gram seen several times, its first occurrence after where the last kept drafts were copied
  from (a summary copies its article in order);
- ``class table (bound)``: drafts from the latest occurrence of the longest earlier match of the
  context's end (vLLM suffix decoding's place), as many as maximise the expected tokens kept minus
  ``c`` per draft, where the chance that draft ``i`` is kept comes from a table by match length
  (1, 2, 3, 4 or more tokens) and by whether the match's earlier occurrences go on alike. The
  table is measured on the task's own answer (it knows each task's acceptance in advance), and the
  drafts are chosen for each cost ``c`` in turn: a bound on drafting by kind of match, not a policy;
- ``tree BxL``: several drafts at once, as tree verification (SpecInfer, Medusa, EAGLE's draft
  trees) would check them: the next ``L`` tokens after up to ``B`` earlier occurrences of the
  context's end (the longest matches first, latest first among equals, at least 2 tokens, distinct
  continuations only), merged into a tree whose every node is a drafted position; the step keeps
  the longest branch that equals the answer. A tree needs an attention mask per branch, which the
  engine does not have: this asks whether several places to copy from would pay for it;
- ``oracle``: the longest correct continuation from any earlier occurrence of the last token (what
  prompt lookup could give if it always chose the right place): an upper bound, not a policy.

Tasks and prompts are `lookahead.py`'s. The JSON task's grammar-forced drafts are not replayed
(its figures are the n-gram part only).
"""

from __future__ import annotations

import argparse
import bisect
from typing import Any, Protocol

from lookahead import TASKS  # the same five tasks and prompts

import multistream as ms
from multistream.text._lookahead import AUTO_CAP, Lookahead, draft_length


class Policy(Protocol):
    def drafts(self, context: list[int], *, rows: int, room: int) -> list[int]: ...
    def verified(self, drafted: int, kept: int) -> None: ...


class SuffixRule:
    """vLLM suffix decoding's draft length on one request's context: ``alpha * match + beta``."""

    def __init__(self, alpha: float, beta: float, min_match: int, max_match: int = 16, cap: int = AUTO_CAP) -> None:
        self.alpha, self.beta, self.min_match, self.max_match, self.cap = alpha, beta, min_match, max_match, cap

    def drafts(self, context: list[int], *, rows: int, room: int) -> list[int]:
        match = longest_match(context, self.max_match)
        if match is None or match[0] < self.min_match:
            return []
        length, start, _ = match
        return context[start:start + max(0, min(int(self.alpha * length + self.beta), room, self.cap))]

    def verified(self, drafted: int, kept: int) -> None:
        pass


class Classed:
    """The engine's drafting rule with acceptance rates per kind of match (and an optional copy cursor)."""

    PRIORS = {"one": 0.55, "agree": 0.6, "disagree": 0.15, "cursor": 0.55}  # cursor: high enough to be tried
    NGRAMS = (3, 2, 1)

    def __init__(self, cursor: bool = False, cap: int = AUTO_CAP, decay: float = 0.9, weight: float = 2.0) -> None:
        self.use_cursor, self.cap, self.decay = cursor, cap, decay
        self.tried = {(n, kind): weight for n in self.NGRAMS for kind in self.PRIORS}
        self.kept = {(n, kind): weight * self.PRIORS[kind] for n in self.NGRAMS for kind in self.PRIORS}
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where each continuation starts
        self.indexed = 1
        self.cursor: int | None = None
        self.last: tuple[tuple[int, str], int] | None = None  # the drafts' class and where they were copied from

    def drafts(self, context: list[int], *, rows: int, room: int) -> list[int]:
        for end in range(self.indexed, len(context)):
            for n in self.NGRAMS:
                if end >= n:
                    self.starts.setdefault(tuple(context[end - n:end]), []).append(end)
        self.indexed = max(self.indexed, len(context))
        self.last = None
        for n in self.NGRAMS:
            starts = self.starts.get(tuple(context[-n:]))
            if not starts:
                continue
            start = starts[-1]
            if len(starts) == 1:
                kind = "one"
            elif len({context[s] for s in starts}) == 1:
                kind = "agree"
            else:
                kind = "disagree"
                if self.use_cursor and self.cursor is not None and starts[-1] >= self.cursor:
                    start, kind = starts[bisect.bisect_left(starts, self.cursor)], "cursor"
            k = draft_length(self.kept[n, kind] / self.tried[n, kind], rows=rows, limit=min(self.cap, room))
            self.last = ((n, kind), start)
            return context[start:start + k]
        return []

    def verified(self, drafted: int, kept: int) -> None:
        if drafted <= 0 or self.last is None:
            return
        key, start = self.last
        self.tried[key] = self.tried[key] * self.decay + kept + (1 if kept < drafted else 0)
        self.kept[key] = self.kept[key] * self.decay + kept
        if kept:
            self.cursor = start + kept + 1


def earlier_matches(context: list[int], most: int = 16) -> list[tuple[int, int]]:
    """Every earlier occurrence of the context's last token: (how many tokens of the context's end
    it matches, up to ``most``; where its continuation starts), longest first, latest first among
    equals."""
    found = []
    for s in range(len(context) - 1, 0, -1):
        if context[s - 1] == context[-1]:
            n = 1
            while n < most and s - 1 - n >= 0 and context[s - 1 - n] == context[-1 - n]:
                n += 1
            found.append((n, s))
    return sorted(found, key=lambda match: -match[0])  # stable: latest first among equals


def longest_match(context: list[int], most: int = 16) -> tuple[int, int, str] | None:
    """The longest earlier match of the context's end (up to ``most`` tokens): (its length, where its
    latest occurrence's continuation starts, "one" | "agree" | "disagree": whether the occurrences of
    that length are one, or several whose next tokens are the same, or several that differ)."""
    found = earlier_matches(context, most)
    if not found:
        return None
    length = found[0][0]
    starts = [s for n, s in found if n == length]  # latest first
    kind = "one" if len(starts) == 1 else ("agree" if len({context[s] for s in starts}) == 1 else "disagree")
    return length, starts[0], kind


def match_class(length: int, kind: str) -> tuple[int, str]:
    """The table's key for a match: its length (4 stands for 4 or more) and its kind."""
    return min(length, 4), kind


def copied(context: list[int], start: int, answer: list[int], pos: int, cap: int) -> int:
    """How many of the answer's tokens from ``pos`` on equal the context's from ``start`` on (at most
    ``cap``): the drafts copied from ``start`` that would be kept."""
    run = 0
    while run < cap and start + run < len(context) and pos + run < len(answer) and context[start + run] == answer[pos + run]:
        run += 1
    return run


def class_table(prompt: list[int], answer: list[int], cap: int = AUTO_CAP) -> dict[tuple[int, str], list[float]]:
    """For each class of match, the share of the answer's positions where drafts 1..cap from the
    longest match's latest occurrence would all be kept (index i - 1: drafts 1..i)."""
    counts: dict[tuple[int, str], list[int]] = {}
    for pos in range(1, len(answer) - 1):
        context = prompt + answer[:pos]
        match = longest_match(context)
        if match is None:
            continue
        length, start, kind = match
        run = copied(context, start, answer, pos, cap)
        row = counts.setdefault(match_class(length, kind), [0] * (cap + 1))
        row[0] += 1
        for i in range(1, run + 1):
            row[i] += 1
    return {key: [kept / row[0] for kept in row[1:]] for key, row in counts.items()}


class ClassTable:
    """Drafts chosen from a table of acceptance by class of match, for a draft cost ``c``."""

    def __init__(self, table: dict[tuple[int, str], list[float]], c: float, cap: int = AUTO_CAP) -> None:
        self.table, self.c, self.cap = table, c, cap

    def drafts(self, context: list[int], *, rows: int, room: int) -> list[int]:
        match = longest_match(context)
        if match is None:
            return []
        length, start, kind = match
        kept = self.table.get(match_class(length, kind), [])
        k, best, net = 0, 0.0, 0.0
        for i in range(1, min(self.cap, room, len(kept)) + 1):
            net += kept[i - 1] - self.c
            if net > best:
                k, best = i, net
        return context[start:start + k]

    def verified(self, drafted: int, kept: int) -> None:
        pass


def replay(prompt: list[int], answer: list[int], policy: Policy) -> tuple[int, int]:
    """(decode steps, drafted positions) of ``policy`` generating ``answer`` after ``prompt``."""
    pos, steps, drafted = 1, 0, 0  # answer[0] comes from the prefill
    while pos < len(answer):
        drafts = policy.drafts(prompt + answer[:pos], rows=1, room=len(answer) - pos - 1)
        kept = 0
        while kept < len(drafts) and drafts[kept] == answer[pos + kept]:
            kept += 1
        policy.verified(len(drafts), kept)
        pos += kept + 1
        steps += 1
        drafted += len(drafts)
    return steps, drafted


def tree_replay(prompt: list[int], answer: list[int], branches: int, length: int, shortest: int = 2,
                ) -> tuple[int, int]:
    """(decode steps, drafted positions) of drafting a tree each step: the next ``length`` tokens
    after up to ``branches`` earlier matches of at least ``shortest`` tokens whose continuations
    differ; a position shared by two branches (a common prefix) is drafted once."""
    pos, steps, drafted = 1, 0, 0
    while pos < len(answer):
        context = prompt + answer[:pos]
        span = min(length, len(answer) - pos - 1)
        tree: dict[tuple[int, ...], int] = {}  # branch -> where it starts in the context
        for n, start in earlier_matches(context):
            if n < shortest or len(tree) == branches:
                break
            branch = tuple(context[start:start + span])
            if branch and not any(other[:len(branch)] == branch for other in tree):
                tree[branch] = start
        kept = max((copied(context, start, answer, pos, span) for start in tree.values()), default=0)
        pos += kept + 1
        steps += 1
        drafted += len({branch[:i] for branch in tree for i in range(1, len(branch) + 1)})
    return steps, drafted


def oracle(prompt: list[int], answer: list[int], cap: int = AUTO_CAP) -> tuple[int, int]:
    """(steps, drafted) if every step drafted exactly the longest correct continuation on offer."""
    pos, steps, drafted = 1, 0, 0
    while pos < len(answer):
        context = prompt + answer[:pos]
        best = max((copied(context, start, answer, pos, cap) for _, start in earlier_matches(context)), default=0)
        pos += best + 1
        steps += 1
        drafted += best
    return steps, drafted


def record(llm: Any, tokens: int, tasks: dict[str, tuple[Any, dict[str, Any]]] | None = None,
           ) -> dict[str, tuple[list[int], list[int]]]:
    """Each task's prompt ids and greedy answer ids (``speculate=0``); ``tasks``: name -> (messages,
    extra options), `lookahead.py`'s by default."""
    out = {}
    for task, (messages, extra) in (TASKS if tasks is None else tasks).items():
        prompt = llm.encode_prompt(messages)  # the ids the engine prefills
        answer: list[int] = []
        for ev in llm.stream(messages, max_new_tokens=tokens, temperature=0.0, speculate=0, **extra):
            answer += list(ev.token_ids)
        out[task] = (list(prompt), answer)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--costs", default="0.2,0.33", help="extra position's cost, in one-token steps")
    args = parser.parse_args()
    costs = [float(c) for c in args.costs.split(",")]
    llm = ms.load_text_model()
    answers = record(llm, args.tokens)
    llm.close()
    policies: dict[str, Any] = {"engine": lambda: Lookahead(AUTO_CAP), "classed": Classed,
                                "classed + cursor": lambda: Classed(cursor=True)}
    for alpha, beta, min_match in ((0.5, 0, 1), (0.5, 1, 2), (1.0, 0, 2), (1.0, 1, 2), (1.0, 1, 3), (2.0, 0, 2)):
        policies[f"suffix {alpha},{beta},{min_match}"] = lambda a=alpha, b=beta, m=min_match: SuffixRule(a, b, m)
    print("tokens per step / modelled speed against one token per step at c = " + ", ".join(map(str, costs)))
    print("| policy | " + " | ".join(answers) + " |")
    print("|---|" + "---|" * len(answers))
    tasks = list(answers.values())
    for name, make in policies.items():
        row(name, [cell(len(a) - 1, [replay(p, a, make())] * len(costs), costs) for p, a in tasks])
    # Drafts chosen for each cost in turn from each task's own table, the speed modelled at that cost.
    row("class table (bound)", [cell(len(a) - 1, [replay(p, a, ClassTable(class_table(p, a), c)) for c in costs], costs)
                                for p, a in tasks])
    for branches, length in ((1, 2), (2, 2), (3, 2), (1, 4), (2, 4)):
        row(f"tree {branches}x{length}", [cell(len(a) - 1, [tree_replay(p, a, branches, length)] * len(costs), costs)
                                          for p, a in tasks])
    row("oracle (bound)", [cell(len(a) - 1, [oracle(p, a)] * len(costs), costs) for p, a in tasks])


def cell(tokens: int, runs: list[tuple[int, int]], costs: list[float]) -> str:
    """A task's tokens per step (of its first run) and modelled speed, run i at cost i: ``runs``
    holds (decode steps, drafted positions) per cost."""
    speeds = "/".join(f"{modelled_speed(tokens, run, c):.2f}" for run, c in zip(runs, costs))
    return f"{tokens / runs[0][0]:.2f} ({speeds})"


def modelled_speed(tokens: int, run: tuple[int, int], cost: float) -> float:
    """Speed against one token a step of ``tokens`` made in ``run`` = (decode steps, drafted
    positions), a step with ``k`` drafts costing ``1 + cost * k`` one-token steps.

    Example:
        >>> modelled_speed(120, (60, 100), 0.2)   # 2 tokens a step, 100 drafts at a fifth of a step
        1.5
    """
    steps, drafted = run
    return tokens / (steps + cost * drafted)


def row(name: str, cells: list[str]) -> None:
    print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
