"""What a text request asked for, fixed at submission (vLLM v1's ``EngineCoreRequest``).

Nothing on the engine thread writes it: the row's changing state is `RowState`, the events are
`TextOutput`'s, edits wait in the `EditQueue`.

Example (what `TextModel.stream` builds):
    >>> from multistream.text._options import parse_text_options
    >>> from multistream.text._sampling import SamplingPlan
    >>> options = parse_text_options(max_new_tokens=8)
    >>> spec = RequestSpec(prompt_ids=(1, 2, 3), options=options, plan=SamplingPlan.resolve(options, None),
    ...                    max_new_tokens=8, eos_token_ids=frozenset({2}))
    >>> spec.priority, spec.resumes
    (0, False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ._edits import Edit
from ._options import TextOptions
from ._sampling import SamplingPlan

__all__ = ["History", "RequestSpec"]

#: An answer that exists already: (context, answer token ids, each answer token's position in the context).
History = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class RequestSpec:
    """One text request as asked: prompt, options, limits, and where it starts from."""

    prompt_ids: tuple[int, ...]
    options: TextOptions
    plan: SamplingPlan  # the sampling options resolved against the model's generation_config
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    context_length: int = 1 << 30
    priority: int = 0
    is_chat: bool = False  # steering instructions are inserted as chat turns (else as plain text)
    # An answer to start from, and whether its text is sent again as the first delta (revise) or
    # taken as already sent (failover, restart continuation).
    history: History | None = None
    echo_history: bool = False
    # Logprob entries of the history's answer tokens (revise), parallel to its answer; else None.
    history_logprobs: tuple[dict[str, Any] | None, ...] | None = None
    # A rewind that takes effect before the first token (revise: its instruction and branch token).
    first_edit: Edit | None = None
    # Called on the engine thread with each edit as it takes effect: its revision dict plus
    # ``revision`` (its number) and ``at`` (answer tokens before its instruction tokens).
    on_edit: Callable[[dict[str, Any]], Any] | None = None

    @property
    def resumes(self) -> bool:
        """True when the request continues an answer that exists already."""
        return self.history is not None
