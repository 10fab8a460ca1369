"""Streaming beam search: transformers' scoring, step by step, with a committed prefix.

`BeamSearch` is one request's beam search, fed one step of logits at a time (its ``k`` rows of a
batched forward). Its scoring is transformers' vectorised beam search (``generation/utils.py``
``_beam_search`` and its helpers ``_get_top_k_continuations``,
``_get_running_beams_for_next_iteration``, ``_update_finished_beams``,
``_check_early_stop_heuristic``) written out for one prompt with the same tensor operations in
the same order, so ties and rounding fall the same way and the final answer equals
``model.generate(num_beams=k, do_sample=False, length_penalty=..., early_stopping=...)``.

What streaming adds:

- ``source``: after each step, which beam (row) each new beam continues; the batcher reorders the
  request's KV rows by it (one index-select).
- ``committed``: the longest token prefix that every hypothesis still able to become the answer
  shares (the running beams and the finished ones kept so far). Every later hypothesis extends
  one of these, so that prefix only grows: its text can never change.
- `BeamSearch.update` turns a step into a text event: the current best hypothesis, replacing the
  tail the client shows from the first character where it differs (never before ``committed``).

Example:
    >>> import torch
    >>> beams = BeamSearch(num_beams=2, length_penalty=1.0, early_stopping=False, max_new_tokens=2,
    ...                    eos_token_ids=frozenset({0}))
    >>> beams.step(torch.tensor([[0.0, 2.0, 1.0, -1.0]]))   # first step: one row, the prompt's
    [0, 0]
    >>> beams.running, beams.committed_tokens
    ([[1], [2]], 0)
    >>> _ = beams.step(torch.tensor([[0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    >>> beams.done, beams.best()
    (True, [1, 1])
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["BeamSearch", "new_beam_search"]

_NEG = -1.0e9  # transformers' "impossible" score


def _common_prefix(seqs: list[list[int]]) -> int:
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def _common_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class BeamSearch:
    """One request's beam search (see the module docstring): scores, hypotheses, committed prefix."""

    def __init__(
        self,
        *,
        num_beams: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        k = num_beams
        self.k = k
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self._eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        self._eos_set = eos_token_ids
        # As transformers: keep 2k (more with several EOS ids) candidates, so k can go on even if
        # the best k all just ended.
        self.keep = max(2, 1 + len(eos_token_ids)) * k
        self._top_mask = torch.cat([torch.ones(k, dtype=torch.bool), torch.zeros(self.keep - k, dtype=torch.bool)])
        self.running: list[list[int]] = [[] for _ in range(k)]
        self.running_scores = torch.zeros((1, k), dtype=torch.float)
        self.running_scores[:, 1:] = _NEG  # the first step looks at beam 0 only (all rows are the prompt)
        self.finished: list[list[int]] = [[] for _ in range(k)]  # EOS included when it ended one
        self.finished_scores = torch.full((1, k), _NEG, dtype=torch.float)
        self.is_finished = torch.zeros((1, k), dtype=torch.bool)
        self._improvable = torch.ones((1, 1), dtype=torch.bool)
        self.length = 0  # tokens generated per beam so far (transformers' cur_len - prompt length)
        self.done = False
        self.committed_tokens = 0
        # What the client shows: tokens and text of the hypothesis last sent, committed characters.
        self.shown: list[int] = []
        self.shown_text = ""
        self.committed_chars = 0

    # -- scoring (transformers' _beam_search, one prompt) ---------------------------------------

    def step(self, logits: torch.Tensor) -> list[int]:
        """Take one step's logits (``k`` rows, or one row for the first step after the prefill);
        return, for each new beam, the row it continues (the KV reorder index)."""
        k, keep = self.k, self.keep
        logits = logits.to(dtype=torch.float32)
        if logits.shape[0] != k:
            logits = logits.expand(k, -1)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        vocab = log_probs.shape[-1]
        log_probs = log_probs.view(1, k, vocab) + self.running_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (1, -1))
        topk_log_probs, topk_indices = torch.topk(log_probs, k=keep)
        sources = (topk_indices // vocab)[0].tolist()
        ids = (topk_indices % vocab)
        ids_list = ids[0].tolist()
        candidates = [self.running[s] + [t] for s, t in zip(sources, ids_list)]
        hits = torch.isin(ids, self._eos.to(ids.device)) if self._eos.numel() else torch.zeros_like(ids, dtype=torch.bool)
        if self.length + 1 >= self.max_new_tokens:
            hits = torch.ones_like(hits)

        # e. the running beams of the next step: the best k that did not just end
        running_log_probs = topk_log_probs + hits.to(torch.float32) * _NEG
        next_indices = torch.topk(running_log_probs, k=k)[1]
        chosen = next_indices[0].tolist()
        self.running = [candidates[j] for j in chosen]
        self.running_scores = torch.gather(running_log_probs, 1, next_indices)
        source = [sources[j] for j in chosen]

        # f. finished hypotheses: only the top k candidates may end here
        just_finished = hits & self._top_mask[None, :]
        scores = topk_log_probs / ((self.length + 1) ** self.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        scores += full.to(torch.float32) * _NEG
        scores += (~self._improvable).to(torch.float32) * _NEG
        scores += (~just_finished) * _NEG
        merged_scores = torch.cat((self.finished_scores, scores), dim=1)
        merged = self.finished + candidates
        merged_is_finished = torch.cat((self.is_finished, just_finished), dim=1)
        top = torch.topk(merged_scores, k=k)[1]
        self.finished = [merged[j] for j in top[0].tolist()]
        self.finished_scores = torch.gather(merged_scores, 1, top)
        self.is_finished = torch.gather(merged_is_finished, 1, top)

        # g. can the running beams still beat the worst finished one?
        self.length += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.length
        best_running = self.running_scores[:, :1] / (best_length**self.length_penalty)
        worst_finished = torch.where(
            self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], _NEG
        )
        self._improvable = self._improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        open_beam = not (bool(torch.all(self.is_finished)) and self.early_stopping is True)
        self.done = not (bool(torch.any(self._improvable)) and open_beam and not bool(torch.all(hits)))
        self.committed_tokens = max(self.committed_tokens, _common_prefix(self._contenders()))
        return source

    def _contenders(self) -> list[list[int]]:
        """Every hypothesis that can still become the answer (EOS dropped)."""
        done = [self._answer(s) for s, f in zip(self.finished, self.is_finished[0].tolist()) if f]
        return done if self.done else done + self.running

    def _answer(self, tokens: list[int]) -> list[int]:
        return tokens[:-1] if tokens and tokens[-1] in self._eos_set else tokens

    def best(self) -> list[int]:
        """The answer's tokens now: the best finished hypothesis once done, else the best running
        beam (EOS dropped)."""
        if self.done and bool(self.is_finished[0, 0]):
            return self._answer(self.finished[0])
        return self.running[0]

    def best_with_eos(self) -> list[int]:
        """`best`, with its EOS if it ended with one (what ``generate`` counts as generated)."""
        if self.done and bool(self.is_finished[0, 0]):
            return list(self.finished[0])
        return list(self.running[0])

    @property
    def finish_reason(self) -> str:
        tokens = self.best_with_eos()
        return "stop" if tokens and tokens[-1] in self._eos_set else "length"

    # -- events ---------------------------------------------------------------------------------

    def update(self, decode: Callable[[list[int]], str], *, final: bool = False) -> tuple[str, list[int], int, int, int] | None:
        """What to send for the hypothesis now: ``(delta, token_ids, index, offset, committed)``,
        or None when nothing changed. ``final``: the whole answer (partial characters decoded as
        they are); otherwise a trailing partial character is held back."""
        tokens = self.best()
        text = decode(tokens)
        if final:
            committed_text = text
        else:
            text = text.rstrip("\ufffd")
            committed_text = decode(tokens[: self.committed_tokens]).rstrip("\ufffd")
        same = _common_prefix([self.shown, tokens])
        committed = max(self.committed_chars, _common_chars(committed_text, text))
        if text == self.shown_text:
            offset = len(text)
            if committed == self.committed_chars and not final:
                self.shown = tokens
                return None
        else:
            offset = min(len(decode(tokens[:same]).rstrip("\ufffd")), _common_chars(self.shown_text, text))
            # Committed text never moves: the replacement starts at or after it.
            offset = max(offset, self.committed_chars)
        delta = text[offset:]
        self.shown, self.shown_text, self.committed_chars = tokens, text, committed
        return delta, tokens[same:], same, offset, committed


def new_beam_search(options: Any, max_new_tokens: int, eos_token_ids: frozenset[int]) -> BeamSearch | None:
    """The request's `BeamSearch`, or None without beams."""
    if options.num_beams is None or options.num_beams == 1:
        return None
    return BeamSearch(
        num_beams=options.num_beams, length_penalty=options.length_penalty,
        early_stopping=options.early_stopping, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
    )

