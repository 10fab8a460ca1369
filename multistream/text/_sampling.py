"""Choosing the next token: transformers' logits processors, and randomness by position.

`SamplingPlan.resolve` fills the options a caller left out from the model's ``generation_config``,
as ``model.generate`` does. `RowSampler` picks one request's tokens with transformers' own
processors (repetition penalty on float32 logits, then temperature, top-k, top-p), so its choices
equal ``generate``'s. A seeded draw depends only on ``(seed, position)``: the generator is reseeded
from both before every draw. So a seeded stream gives the same tokens whatever else shares its
batch, and a generation resumed at token k continues exactly as an uninterrupted one would.

Example:
    >>> from multistream.text._options import parse_text_options
    >>> plan = SamplingPlan.resolve(parse_text_options(temperature=0.7), generation_config=None)
    >>> plan.greedy, plan.top_k, plan.top_p
    (False, 50, 1.0)
    >>> position_seed(7, 0) != position_seed(7, 1)
    True
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch

from ._options import TextOptions

__all__ = ["RowSampler", "SamplingPlan", "position_seed"]

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the draw at ``position`` of a stream seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class SamplingPlan:
    """The sampling settings of one request once the model's defaults are filled in."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int  # drawn at random when the caller gave none, so any run can be replayed

    @classmethod
    def resolve(cls, options: TextOptions, generation_config: Any) -> SamplingPlan:
        """Options the caller left as None take the model's ``generation_config`` values."""

        def config(name: str, fallback: Any) -> Any:
            value = getattr(generation_config, name, None) if generation_config is not None else None
            return fallback if value is None else value

        temperature = options.temperature
        if temperature is None:
            temperature = float(config("temperature", 1.0)) if config("do_sample", False) else 0.0
        greedy = temperature == 0
        return cls(
            greedy=greedy,
            temperature=float(temperature),
            top_k=int(options.top_k if options.top_k is not None else config("top_k", 50)),
            top_p=float(options.top_p if options.top_p is not None else config("top_p", 1.0)),
            repetition_penalty=float(
                options.repetition_penalty if options.repetition_penalty is not None
                else config("repetition_penalty", 1.0)
            ),
            seed=options.seed if options.seed is not None else secrets.randbits(63),
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply first: the batch's argmax serves such rows at once."""
        return self.greedy and self.repetition_penalty == 1.0


class RowSampler:
    """Picks the tokens of one request from its row of the batch's logits (already masked by the
    request's grammar, if it has one: `multistream.text._constraints.apply_masks`)."""

    def __init__(self, plan: SamplingPlan) -> None:
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.plan = plan
        processors = LogitsProcessorList()
        if plan.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(plan.repetition_penalty))
        if not plan.greedy:
            if plan.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(plan.temperature))
            if plan.top_k:
                processors.append(TopKLogitsWarper(plan.top_k))
            if plan.top_p < 1.0:
                processors.append(TopPLogitsWarper(plan.top_p))
        self._processors = processors
        self._generator: torch.Generator | None = None

    @property
    def plain_greedy(self) -> bool:
        return self.plan.plain_greedy

    def pick(self, logits: torch.Tensor, sequence: list[int], position: int, generated: list[int]) -> int:
        """The token at output ``position`` from last-position ``logits`` (shape ``[vocab]``).

        ``sequence`` is every token so far (prompt and output), as ``generate`` gives its
        processors.
        """
        scores = logits.float().unsqueeze(0)
        if len(self._processors):
            ids = torch.tensor([sequence], device=scores.device)
            scores = self._processors(ids, scores)
        if self.plan.greedy:
            return int(torch.argmax(scores[0]))
        probs = torch.softmax(scores[0], dim=-1)
        # Sample on the logits' device (with device_map the last layer may sit on another GPU).
        if self._generator is None or self._generator.device != probs.device:
            self._generator = torch.Generator(device=probs.device)
        self._generator.manual_seed(position_seed(self.plan.seed, position))
        return int(torch.multinomial(probs, 1, generator=self._generator))

