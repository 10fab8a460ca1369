"""Constrained decoding: the answer must match a regular expression, or be one of given choices.

``llm.stream(prompt, allowed=r"(yes|no)")`` or ``allowed=["red", "green", "blue"]``: at every step
only tokens that keep the answer a prefix of some full match are candidates, and the stream can
end (EOS) only on a full match. Matching uses the ``regex`` package's partial matching, and each
step tests only the tokens whose first character can come next, so a step costs milliseconds.

A token is seen through its own decode, so the constraint is meant for formats whose tokens
decode alone (ASCII text, JSON-like formats), which is what constrained decoding is used for.

Example:
    >>> import multistream as ms
    >>> llm = ms.load_text_model()                                              # doctest: +SKIP
    >>> llm.generate("Is the sky blue? Answer yes or no.", allowed=["yes", "no"]).text  # doctest: +SKIP
    'yes'
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import regex

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["AllowedText", "compile_allowed"]


def compile_allowed(allowed: Any) -> str | None:
    """Check ``allowed=`` (a pattern, or a list of choices) and return it as one pattern."""
    if allowed is None:
        return None
    if isinstance(allowed, str):
        pattern = allowed
    elif isinstance(allowed, (list, tuple)) and allowed and all(isinstance(c, str) and c for c in allowed):
        pattern = "|".join(regex.escape(c) for c in allowed)
    else:
        raise InvalidArgumentError(
            f"allowed must be a regular expression string or a non-empty list of non-empty strings, got {allowed!r}"
        )
    try:
        regex.compile(pattern)
    except regex.error as exc:
        raise InvalidArgumentError(f"allowed={allowed!r} is not a valid regular expression: {exc}") from exc
    return pattern


class _Vocabulary:
    """Each token's own decode, grouped by first character (built once per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        size = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
        self.texts: list[str] = texts
        self.by_first: dict[str, list[int]] = {}
        for token_id, text in enumerate(texts):
            if text:
                self.by_first.setdefault(text[0], []).append(token_id)


_VOCABULARIES: weakref.WeakKeyDictionary[Any, _Vocabulary] = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


def _vocabulary(tokenizer: Any) -> _Vocabulary:
    with _VOCAB_LOCK:
        vocab = _VOCABULARIES.get(tokenizer)
        if vocab is None:
            vocab = _VOCABULARIES[tokenizer] = _Vocabulary(tokenizer)
        return vocab


class AllowedText:
    """The ``allowed=`` constraint of one stream: masks the logits of every other token."""

    def __init__(self, pattern: str, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.pattern = regex.compile(pattern)
        self.vocab = _vocabulary(tokenizer)
        self.eos = sorted(eos_token_ids)

    def _text(self, generated: list[int]) -> str:
        texts = self.vocab.texts
        return "".join(texts[t] for t in generated)

    def allowed_ids(self, generated: list[int]) -> list[int]:
        text = self._text(generated)
        match = self.pattern.fullmatch
        ids: list[int] = []
        for first, candidates in self.vocab.by_first.items():
            if match(text + first, partial=True) is None:
                continue
            texts = self.vocab.texts
            ids.extend(t for t in candidates if match(text + texts[t], partial=True) is not None)
        if match(text) is not None or not ids:
            ids.extend(self.eos)  # a full match may end; a dead end must (never loops forever)
        return ids

    def apply(self, scores: torch.Tensor, generated: list[int]) -> torch.Tensor:
        """``scores`` (1 x vocab) with every token that breaks the pattern at -inf."""
        import torch  # here, so that checking ``allowed=`` (text_options) stays torch-free

        keep = torch.full_like(scores, float("-inf"))
        ids = torch.tensor(self.allowed_ids(generated), device=scores.device)
        ids = ids[ids < scores.shape[-1]]
        keep[:, ids] = scores[:, ids]
        return keep
