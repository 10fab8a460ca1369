"""The engine-side state of one text request (vLLM v1's ``Request``): its tokens and its row.

The batcher writes a request's `RowState` and nothing else of it: how much of the context is in
the KV cache, the row's own cache while it is out of the batch, its arrival order, the shared
prompt it waits on, the branch token to force, and its drafts (`Lookahead`). The request appends
each accepted token (`append`) and cuts the answer back on a rewind (`cut`).

``context`` is every token the model sees, in order: the prompt, the answer's tokens and the
tokens of any steering instruction. ``prefilled`` of them are in the KV cache; the rest wait for
the next forward (after the first token, exactly one: the newest). The answer is ``answer_ids``
(EOS excluded); ``answer_pos[k]`` is where answer token ``k`` sits in ``context``, so a rewind
knows where to cut.

Example:
    >>> row = RowState(context=[1, 2, 3])
    >>> row.append(7); row.append(8)
    >>> row.context, row.answer_ids, row.answer_pos, row.uncached
    ([1, 2, 3, 7, 8], [7, 8], [3, 4], [1, 2, 3, 7, 8])
    >>> row.cut(1), row.context
    (4, [1, 2, 3, 7])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._lookahead import Lookahead

__all__ = ["RowState"]


@dataclass(eq=False)
class RowState:
    """A request's tokens and its place in the batch (engine thread only)."""

    context: list[int]
    answer_ids: list[int] = field(default_factory=list)
    answer_pos: list[int] = field(default_factory=list)
    prefilled: int = 0  # context tokens in the row's cache
    # The row's own cache while it is not part of the batch (prefill, or paused by a higher
    # priority or an edit): (RowCache, index or indices of its row), or None.
    own_cache: Any = None
    needs_prefill: bool = True
    order: int = 0  # arrival order, the tie-break after priority
    # Requests of one prompt that share its prefill (n choices; see `SharedPrompt`).
    share: Any = None
    # The next token, chosen by the caller instead of sampled (a branch: rewind(offset, token_id=)).
    forced_token: int | None = None
    generated: int = 0  # tokens the model generated, EOS and rewound ones included (usage)
    decode_steps: int = 0  # batched forwards that gave this request tokens (its first token excluded)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    rewinds: int = 0  # the penalties' counts are redone after a rewind
    # Exact lookahead: this request's drafts and their acceptance; None when off.
    lookahead: Lookahead | None = None

    @property
    def uncached(self) -> list[int]:
        return self.context[self.prefilled :]

    @property
    def output_position(self) -> int:
        """Position of the next answer token (the counter of seeded sampling)."""
        return len(self.answer_ids)

    def append(self, token: int) -> None:
        """An answer token, after everything in the context."""
        self.answer_pos.append(len(self.context))
        self.context.append(token)
        self.answer_ids.append(token)

    def cut(self, k: int) -> int:
        """Keep the first ``k`` answer tokens and the context before answer token ``k``; returns
        where the context was cut."""
        cut = self.answer_pos[k] if k < len(self.answer_pos) else len(self.context)
        del self.context[cut:]
        del self.answer_ids[k:]
        del self.answer_pos[k:]
        return cut

    def release(self) -> None:
        """The request ended: drop its cache and its claim on a shared prompt."""
        self.own_cache = None
        self.share = None
