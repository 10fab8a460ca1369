"""Attention that gives each row of a left-padded batch exactly what it gives alone.

The engine batches requests of different lengths by left padding (`multistream.text._kv_rows`):
a short row's keys start with padding columns that the mask hides. Mathematically the padding
changes nothing, but SDPA sums over more columns in another order, so a row's attention differs
from its attention alone in the last bits. In fp32 that never reaches a greedy choice; in a
quantized model it does, because each quantized layer rounds its input to bf16 (its kernel's
fast path): a last-bit difference moves some values to the neighbouring bf16 number, and a few
hundred of those per token change the text within twenty tokens.

So quantized models attend row by row, each on its own columns only (padding sliced off), through
transformers' own SDPA function with the same arguments a row alone gets. The quantized kernels
themselves are row-independent (row ``i`` of a batched ``_weight_int8pack_mm`` equals the row
alone, bit for bit), so a stream in a batch then equals its output alone exactly. It costs one
SDPA call per row and layer; a batch of one takes the plain path.

The engine passes ``row_starts`` (each row's first real column) to the model's forward;
transformers hands extra keyword arguments down to the attention function. Without them (a user
calling ``model.generate``) this is transformers' SDPA attention, unchanged.

Example:
    >>> use_row_attention(model)                  # doctest: +SKIP
    True
    >>> model(input_ids=ids, attention_mask=mask, row_starts=[3, 0])   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROW_ATTENTION", "row_attention", "use_row_attention", "uses_row_attention"]

ROW_ATTENTION = "multistream_rows"


def row_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, *args: Any, row_starts: list[int] | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, one row at a time on its own columns when ``row_starts`` is given.

    Shapes as transformers passes them: query ``[rows, heads, q, dim]``, key and value
    ``[rows, kv_heads, columns, dim]``; returns ``[rows, q, heads, dim]``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if row_starts is None or len(row_starts) != query.shape[0]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    q_len, columns = query.shape[2], key.shape[2]
    outputs = []
    for row, start in enumerate(row_starts):
        # A left-padded prefill pads the queries too: the first `skip` are padding (their output is
        # never used; zeros keep it finite).
        skip = max(0, start - (columns - q_len))
        q, k, v = query[row : row + 1, :, skip:], key[row : row + 1, :, start:], value[row : row + 1, :, start:]
        # What transformers gives a row alone: no mask when the causal pattern is SDPA's own
        # (one query, or as many queries as keys); else its mask without the padding.
        mask = None
        if attention_mask is not None and q.shape[2] not in (1, k.shape[2]):
            mask = attention_mask[row : row + 1, :, skip:, start:]
        out, _ = sdpa_attention_forward(module, q, k, v, mask, *args, **kwargs)
        if skip:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, skip, 0))
        outputs.append(out)
    return torch.cat(outputs, 0), None


def use_row_attention(model: Any) -> bool:
    """Switch a transformers model to `row_attention` (it keeps SDPA's masks); False if it cannot."""
    if uses_row_attention(model):
        return True  # already (`lean_llama`'s model attends so from the start, without transformers' registries)
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ROW_ATTENTION, row_attention)
        AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)
        if getattr(model.config, "_attn_implementation", None) != "sdpa":
            return False  # eager/flash/flex models keep theirs
        model.set_attn_implementation(ROW_ATTENTION)
    except Exception:  # noqa: BLE001 - older transformers or a model without the attention interface
        return False
    return uses_row_attention(model)


def uses_row_attention(model: Any) -> bool:
    """True if the model attends with `row_attention` (so its forward takes ``row_starts``)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ROW_ATTENTION
