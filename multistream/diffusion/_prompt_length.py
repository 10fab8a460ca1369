"""Prompts longer than the text encoder reads: one short line of ours instead of the libraries' two.

A CLIP text encoder reads a fixed number of positions (77 for Stable Diffusion; 24 for the embedded
image and video models: a start and an end marker and 22 of the prompt's tokens), and the pipeline
cuts a longer prompt. transformers then warned that the "sequence length is longer than the
specified maximum" (once per tokenizer) and diffusers, on every call, quoted the whole cut text
(10.8 KB of stderr for a 2,400-token prompt). `PromptLimit.check` says it in one line on the
``multistream`` logger when the stream starts (or a steer comes), and `quiet_cut_notices` drops the
libraries' two records emitted by our own pipeline call (`multistream._notices.quiet_here`).

Only pipelines whose every text encoder is a CLIP one get this: where a T5 encoder reads the prompt
too (SD3, Flux, the video families' T5), the prompt is not cut at one number of tokens, and the
libraries' messages are left as they are.

Example:
    >>> limit = PromptLimit.of(sd.pipeline, "image")                            # doctest: +SKIP
    >>> limit.tokens                                                           # doctest: +SKIP
    22
    >>> limit.check("prompt", "red circle " * 600)                             # doctest: +SKIP
    prompt is 1200 tokens; the image model reads the first 22 (the rest is ignored)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._notices import quiet_here

__all__ = ["PromptLimit", "quiet_cut_notices"]

logger = logging.getLogger("multistream")

_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
_TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")

# What transformers' tokenizer logs (once per tokenizer) and the pipelines' encode_prompt logs
# (each call, with the cut text) when a prompt is longer than the CLIP encoder reads.
_TRANSFORMERS_NOTICE = ("transformers.tokenization_utils_base",
                        "Token indices sequence length is longer than the specified maximum sequence length")
_DIFFUSERS_NEEDLE = "truncated because CLIP can only handle sequences up to"


@dataclass(frozen=True)
class PromptLimit:
    """How many of a prompt's tokens a CLIP-only pipeline reads (``tokens``), and the tokenizer
    that counts them; ``model`` names the model in the message ("image", "video")."""

    tokenizer: Any
    tokens: int
    model: str

    @classmethod
    def of(cls, pipe: Any, model: str) -> PromptLimit | None:
        """The limit of ``pipe``, or None where it has no tokenizer or a non-CLIP text encoder."""
        encoders = [getattr(pipe, name, None) for name in _ENCODERS]
        encoders = [e for e in encoders if e is not None]
        if not encoders or not all(type(e).__name__.startswith("CLIPText") for e in encoders):
            return None
        limits = []
        for name in _TOKENIZERS:
            tokenizer = getattr(pipe, name, None)
            length = getattr(tokenizer, "model_max_length", None)
            if tokenizer is None or not isinstance(length, int) or not 0 < length < 10**6:
                continue
            try:
                markers = int(tokenizer.num_special_tokens_to_add())
            except (AttributeError, TypeError, ValueError):
                markers = 2  # CLIP's start and end markers
            limits.append((length - markers, tokenizer))
        if not limits:
            return None
        tokens, tokenizer = min(limits, key=lambda pair: pair[0])
        return cls(tokenizer=tokenizer, tokens=tokens, model=model)

    def count(self, text: str) -> int:
        """The tokens of ``text``, markers not counted (``verbose=False``: transformers' own warning
        about the length is what this replaces)."""
        return len(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def check(self, name: str, text: Any) -> None:
        """Log one warning when ``text`` (the argument ``name``) is longer than the model reads."""
        if not isinstance(text, str) or len(text) <= self.tokens:  # a token spans at least one character
            return
        count = self.count(text)
        if count > self.tokens:
            logger.warning("%s is %d tokens; the %s model reads the first %d (the rest is ignored)",
                           name, count, self.model, self.tokens)


@contextlib.contextmanager
def quiet_cut_notices(pipe: Any) -> Iterator[None]:
    """Inside the block, drop transformers' and diffusers' notices of a cut prompt that this thread
    emits (``pipe``'s call), where the model has a `PromptLimit` (its check said it already)."""
    if PromptLimit.of(pipe, "") is None:
        yield
        return
    notices = [_TRANSFORMERS_NOTICE]
    module = getattr(getattr(type(pipe), "encode_prompt", None), "__module__", None)
    if isinstance(module, str):
        notices.append((module, _DIFFUSERS_NEEDLE))  # diffusers' loggers are named after their modules
    with quiet_here(notices):
        yield
