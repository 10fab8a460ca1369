"""Exact lookahead: drafts from the request's own text, verified in the step's batched forward.

A row that expects its next tokens to repeat something it has seen (a summary quoting its
article, a code edit copying the function, an answer quoting its context, JSON copying fields)
proposes them as *drafts*: the tokens that followed the latest earlier occurrence of its newest
n-gram (prompt lookup; the answer so far counts too). The step then runs the row's pending token
and its ``k`` drafts as ``k + 1`` positions of one forward; the native layers compute each
position exactly as a one-token step would (one arithmetic: `multistream.text._accel.native_layers`),
so the row's tokens are chosen one at a time from those logits by the request's own sampler
(greedy argmax, or the seeded draw of that output position), and the drafts are kept while they
equal what was chosen. The text, ids and logprobs are bit for bit those of ``speculate=0``; only
the number of forwards changes.

How many drafts pay depends on the batch: one more position costs about ``B`` (its share of the
layers' work) while a step costs about ``A + B * rows`` (``A``: reading the weights once). A
draft that is accepted with probability ``q`` saves ``q`` of a row's step; so draft ``i`` (kept
only if the ``i - 1`` before it were, probability ``p ** i``) is worth running while
``p ** i > B / (A / rows + B)``. ``p`` is the request's own recent acceptance rate (decayed
counts), so a request whose drafts keep failing (open-ended text) stops drafting, and a busy
batch drafts only where acceptance is very likely. The kernels share one pass over the weights
among a group of positions (12 with AVX2, 8 with AVX-512): a draft that starts another group also
costs that pass, so the row drafts the block whose expected saving minus its cost is largest
(in a batch that fills a group one draft costs a pass; a long likely copy still fills the next group).

Example:
    >>> look = Lookahead(cap=8)
    >>> look.drafts([5, 6, 7, 8, 9, 5, 6, 7], rows=1, room=10)   # one draft until some are accepted
    [8]
    >>> look.verified(drafted=1, kept=1)
    >>> look.drafts([5, 6, 7, 8, 9, 5, 6, 7], rows=1, room=10)
    [8, 9, 5]
    >>> look.drafts([1, 2, 3], rows=1, room=10)
    []
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUTO_CAP", "Lookahead", "draft_length", "lookahead_for"]

AUTO_CAP = 10  # drafts per step at most under speculate="auto"
_NGRAMS = (3, 2, 1)  # n-gram sizes matched, longest first
# A step's fixed cost (reading the weights) over one position's cost, for the default model: about
# 3.5 ms a step against 1.4 ms a row in the native layers (issue 32's figures, one quiet core), plus
# each position's share of the 49k-token output layer (a fifth of the model's multiply-adds): about
# even. A loaded machine makes positions dearer (benchmarks/lookahead.py: a summary that accepts
# few drafts lost there at 1.5), so the estimate errs towards fewer drafts.
_FIXED_OVER_POSITION = 1.0
# Decay of the acceptance counts per verified draft step: the last ~10 steps count.
_DECAY = 0.9
# The acceptance rate assumed before any draft was verified, by the size of the n-gram matched (a
# longer match is likelier to go on), and how many verified drafts that prior weighs.
_PRIOR = {3: 0.7, 2: 0.45, 1: 0.3}
_PRIOR_WEIGHT = 2.0
_RECOVER = 0.98  # per step, the counts drift back towards the prior
# What a position that starts another group of the kernels' rows costs beyond a position's own
# work, in positions: another dequantization of every weight block. Measured on the embedded model
# (2-core AMD EPYC, AVX-512, one row): 7 positions 22.3 ms, 9 positions 29.2 ms against 2.2 ms a
# position within a group (1.1 positions more); the output layer alone: 8 rows 3.4 ms, 9 rows
# 4.4 ms, 0.36 ms a row (1.8 more). 1.5 lies between the two.
_GROUP_OPEN = 1.5


def draft_length(p: float, *, rows: int, limit: int, positions: int = 1, group: int = 0) -> int:
    """How many drafts (at most ``limit``) a row whose drafts are kept with probability ``p`` runs
    in a step of ``rows`` rows: the block of k whose expected saving (draft i kept with probability
    ``p ** i``, saving the row's share of a step) minus its cost (a position each, and a pass for
    each group of ``group`` positions it starts after the step's first ``positions``) is largest.
    Without a group to start it is the longest block whose every draft pays, ``p ** i * share > 1``.

    Example:
        >>> draft_length(0.9, rows=1, limit=10), draft_length(0.9, rows=8, limit=10), draft_length(0.3, rows=1, limit=10)
        (6, 1, 0)
    """
    share = _FIXED_OVER_POSITION / max(rows, 1) + 1.0  # a row's share of the step, in positions
    k, best, net, prob = 0, 0.0, 0.0, 1.0
    for i in range(1, limit + 1):
        prob *= p
        net += prob * share - 1.0 - (_GROUP_OPEN if group and (positions + i - 1) % group == 0 else 0.0)
        if net > best:
            k, best = i, net
    return k


class Lookahead:
    """One request's drafting: an n-gram index over its context and its recent acceptance."""

    def __init__(self, cap: int, *, batch_aware: bool = True) -> None:
        self.cap = cap
        # "auto" weighs a draft against the step's rows; an explicit cap (speculate=k) drafts as a
        # row alone would, whatever the batch (the caller asked for drafts).
        self.batch_aware = batch_aware
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self._indexed = 0  # context positions whose n-grams ending there are indexed
        self._version = 0
        # Decayed counts of drafts tried and kept, by n-gram size: its acceptance rate p.
        self._tried = {n: _PRIOR_WEIGHT for n in _NGRAMS}
        self._kept = {n: _PRIOR_WEIGHT * _PRIOR[n] for n in _NGRAMS}
        self._last_n = 0  # the n-gram size of the last drafts
        self.drafted = 0  # totals for the final event's metrics
        self.accepted = 0

    def _sync(self, context: list[int], version: int) -> None:
        """Index the n-grams that end before the context's last token (a rewind rebuilds)."""
        if version != self._version or self._indexed > len(context) - 1:
            self._index.clear()
            self._indexed = 0
            self._version = version
        index = self._index
        for end in range(max(self._indexed, 1), len(context)):
            # The n-grams ending at `end` (exclusive): their continuation starts at `end`.
            for n in _NGRAMS:
                if end >= n:
                    index[tuple(context[end - n:end])] = end
        self._indexed = max(self._indexed, len(context) - 1) if len(context) > 1 else self._indexed

    def rate(self, n: int) -> float:
        """The recent acceptance rate of drafts that followed a match of ``n`` tokens."""
        return self._kept[n] / self._tried[n]

    def drafts(self, context: list[int], *, rows: int, room: int, version: int = 0, positions: int = 1,
               group: int = 0) -> list[int]:
        """The drafts for the token after ``context`` (at most ``room``), [] when none pay in a step
        of ``rows`` rows. ``version`` changes when the context was cut (a rewind). ``positions``: what
        the step holds before these drafts (every row's pending token and the drafts of the rows
        before), ``group``: the kernels' rows per pass over the weights (0: not weighed)."""
        if room <= 0 or self.cap <= 0:
            return []
        for n in _NGRAMS:  # unverified, a rate drifts back to its prior: a request that stopped drafting tries again
            self._tried[n] = self._tried[n] * _RECOVER + (1 - _RECOVER) * _PRIOR_WEIGHT
            self._kept[n] = self._kept[n] * _RECOVER + (1 - _RECOVER) * _PRIOR_WEIGHT * _PRIOR[n]
        rows = max(rows, 1) if self.batch_aware else 1
        if not self.batch_aware:
            group = 0  # speculate=k asked for drafts whatever the batch
        limit = min(self.cap, room)
        self._sync(context, version)
        for n in _NGRAMS:
            if len(context) < n:
                continue
            start = self._index.get(tuple(context[-n:]))
            if start is None:
                continue
            k = draft_length(self.rate(n), rows=rows, limit=limit, positions=positions, group=group)
            self._last_n = n
            return context[start:start + k]
        return []

    def counted(self, drafted: int, kept: int) -> None:
        """Drafts that came from elsewhere (a grammar's forced tokens): in the totals, not the rates."""
        self.drafted += drafted
        self.accepted += kept

    def verified(self, drafted: int, kept: int) -> None:
        """``kept`` of ``drafted`` drafts were accepted in a step (the first rejection ends a block)."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += kept
        n = self._last_n
        tried = kept + (1 if kept < drafted else 0)
        self._tried[n] = self._tried[n] * _DECAY + tried
        self._kept[n] = self._kept[n] * _DECAY + kept


def lookahead_for(speculate: Any, beams: bool) -> Lookahead | None:
    """The drafting of a request with option ``speculate`` ("auto", 0 = off, k = at most k drafts)."""
    if beams or speculate == 0:
        return None
    if speculate == "auto":
        return Lookahead(AUTO_CAP)
    return Lookahead(int(speculate), batch_aware=False)
