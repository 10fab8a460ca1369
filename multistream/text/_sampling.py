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
from ._seeds import choice_seed, position_seed

__all__ = ["Penalties", "RowSampler", "SamplingPlan", "adjust_rows", "choice_seed", "generation_settings",
           "logits_processors", "position_seed"]


def generation_settings(model: Any) -> Any:
    """The model's ``generation_config`` values, read with ``getattr``: a model may offer them as
    ``generation_settings`` without building transformers' ``GenerationConfig`` (the embedded
    model does: `LeanLlamaForCausalLM.generation_settings`, which spares a start that import).

    Example:
        >>> generation_settings(llm.model).eos_token_id                       # doctest: +SKIP
        2
    """
    settings = getattr(model, "generation_settings", None)
    return settings if settings is not None else getattr(model, "generation_config", None)


@dataclass(frozen=True)
class SamplingPlan:
    """The sampling settings of one request once the model's defaults are filled in."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int  # drawn at random when the caller gave none, so any run can be replayed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

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
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            logit_bias=tuple(sorted((options.logit_bias or {}).items())),
            min_p=float(options.min_p if options.min_p is not None else config("min_p", 0.0)),
        )

    @property
    def adjusts(self) -> bool:
        """OpenAI's penalties or a logit bias apply (vectorised over the batch by `adjust_rows`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply first: the batch's argmax serves such rows at once."""
        return self.greedy and self.repetition_penalty == 1.0 and not self.adjusts


class Penalties:
    """One request's state for OpenAI's penalties and ``logit_bias``: how often each token occurs in
    the answer (a dense float32 row on the logits' device, updated in place) and the dense bias.

    `adjust_rows` stacks these rows for every request of a step that has them and applies
    ``logits - frequency * count - presence * (count > 0) + bias`` in one vectorised expression,
    as OpenAI and vLLM document it.
    """

    def __init__(self, plan: SamplingPlan, vocab: int, device: Any) -> None:
        self.frequency = plan.frequency_penalty
        self.presence = plan.presence_penalty
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.bias: torch.Tensor | None = None
        if plan.logit_bias:
            self.bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            ids = torch.tensor([t for t, _ in plan.logit_bias], device=device)
            self.bias[ids] = torch.tensor([b for _, b in plan.logit_bias], dtype=torch.float32, device=device)
        self._counted = 0  # answer tokens `counts` holds
        self._version = 0  # the request's rewind count when they were counted

    def sync(self, answer_ids: list[int], version: int = 0) -> None:
        """Bring the counts up to the answer as it is now: appended to, or (``version`` changed: a
        rewind cut it) counted again."""
        if version != self._version or len(answer_ids) < self._counted:
            self.counts.zero_()
            self._counted, self._version = 0, version
        new = answer_ids[self._counted:]
        if len(new) == 1:
            self.counts[new[0]] += 1
        elif new:
            self.counts.index_add_(0, torch.tensor(new, device=self.device),
                                   torch.ones(len(new), dtype=torch.float32, device=self.device))
        self._counted = len(answer_ids)


def adjust_rows(logits: torch.Tensor, penalties: list[Penalties]) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``, one row per entry of ``penalties``) with OpenAI's penalties and
    the logit biases applied, in float32, all rows at once.

    Example:
        >>> plan = SamplingPlan(greedy=True, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=0,
        ...                     frequency_penalty=1.0, logit_bias=((0, -100.0),))
        >>> p = Penalties(plan, 3, "cpu"); p.sync([1, 1])
        >>> adjust_rows(torch.zeros(1, 3), [p]).tolist()
        [[-100.0, -2.0, 0.0]]
    """
    counts = torch.stack([p.counts for p in penalties])
    dev = counts.device
    freq = torch.tensor([[p.frequency] for p in penalties], dtype=torch.float32, device=dev)
    pres = torch.tensor([[p.presence] for p in penalties], dtype=torch.float32, device=dev)
    out = logits.float().to(dev) - freq * counts - pres * (counts > 0).float()
    if any(p.bias is not None for p in penalties):
        zero = torch.zeros(penalties[0].vocab, dtype=torch.float32, device=dev)
        out = out + torch.stack([p.bias if p.bias is not None else zero for p in penalties])
    return out


def logits_processors() -> Any:
    """transformers' ``logits_process`` module (its import takes about 0.7 s the first time: a
    server's `TextModel.warm_up` pays it, not its first sampled stream's caller).

    Example:
        >>> logits_processors().TopKLogitsWarper(5)                          # doctest: +SKIP
    """
    from transformers.generation import logits_process

    return logits_process


class RowSampler:
    """Picks the tokens of one request from its row of the batch's logits (already masked by the
    request's grammar, if it has one: `multistream.text._constraints.apply_masks`)."""

    def __init__(self, plan: SamplingPlan) -> None:
        self.plan = plan
        processors: list[Any] = []
        if plan.repetition_penalty != 1.0 or not plan.greedy:
            # transformers' processors, imported only where one applies: greedy decoding, the
            # default, starts without importing transformers.
            lp = logits_processors()
            processors = lp.LogitsProcessorList()
            if plan.repetition_penalty != 1.0:
                processors.append(lp.RepetitionPenaltyLogitsProcessor(plan.repetition_penalty))
            if not plan.greedy:
                if plan.temperature != 1.0:
                    processors.append(lp.TemperatureLogitsWarper(plan.temperature))
                if plan.top_k:
                    processors.append(lp.TopKLogitsWarper(plan.top_k))
                if plan.top_p < 1.0:
                    processors.append(lp.TopPLogitsWarper(plan.top_p))
                if plan.min_p > 0:
                    processors.append(lp.MinPLogitsWarper(plan.min_p))
        self._processors = processors
        self._generator: torch.Generator | None = None
        self.penalties: Penalties | None = None  # made by the batcher on the logits' device (see `adjust_rows`)

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

