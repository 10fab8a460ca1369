"""A lean decode step for Llama-family models on the engine's rows, with a KV cache that grows in place.

A decode step of a small model on a CPU is mostly overhead once its weights are quantized:
transformers' forward builds an attention mask, goes through several wrappers per layer and
concatenates every layer's whole KV cache with the new column (an O(length) copy per layer per
step). `FastDecode` runs the same computation, op for op (the model's own norm, projection, MLP and
rotary modules, transformers' ``apply_rotary_pos_emb`` and SDPA function, so its logits are bit for
bit those of ``model(...)``), but:

- the keys and values live in buffers with spare columns: a step writes its column in place and
  the cache layers hold views of the buffers (a copy only every `GROW` steps, when they fill up);
- no mask: it attends row by row (`multistream.text._row_attention`), each row on its own columns;
- the engine's prefill points are called between layers directly (no hooks needed).

It serves models that attend with `row_attention` (the quantized ones) and whose decoder layers
have the Llama structure (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp``): Llama, SmolLM, Mistral without a sliding window. A model
whose ``forward`` was replaced on the instance (a wrapper, accelerate's hooks) keeps its forward.

Example:
    >>> fast = FastDecode.for_model(model)                    # doctest: +SKIP
    >>> logits = fast.step(input_ids, positions, rows, row_starts)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._kv_rows import RowCache
from ._row_attention import row_attention, uses_row_attention

__all__ = ["GROW", "FastDecode"]

GROW = 64  # spare columns per buffer: one copy of the cache every GROW decode steps
_MODEL_TYPES = frozenset({"llama", "mistral"})


class FastDecode:
    """The decode step of one model (see the module docstring). Build it with `for_model`."""

    def __init__(self, model: Any) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.apply_rotary = apply_rotary_pos_emb

    @classmethod
    def for_model(cls, model: Any) -> FastDecode | None:
        """A fast decode step for ``model``, or None if it is not a model this step knows."""
        config = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        if config is None or inner is None or not uses_row_attention(model):
            return None
        if getattr(config, "model_type", None) not in _MODEL_TYPES or getattr(config, "sliding_window", None):
            return None
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if not all(hasattr(inner, name) for name in needed) or not hasattr(model, "lm_head"):
            return None
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
                return None
            if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
                return None
        return cls(model)

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: RowCache, row_starts: list[int] | None,
        between_layers: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for one new token per row; ``rows`` gains the token's column."""
        length = rows.length
        layers = list(getattr(rows.cache, "layers", []))
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, position_ids=positions)
        batch = hidden.shape[0]
        for i, (layer, cached) in enumerate(zip(self.layers, layers)):
            if between_layers is not None:
                between_layers(i)
            attn = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (batch, 1, -1, attn.head_dim)
            fused = getattr(attn, "qkv_fused", None)
            if fused is not None:  # one kernel call; bit for bit the three projections (_quantize)
                q, k, v = fused(hidden).split(fused.splits, -1)
            else:
                q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
            q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
            q, k = self.apply_rotary(q, k, cos, sin)
            keys, values = _append(cached, k, v, length)
            out, _ = row_attention(attn, q, keys, values, None, dropout=0.0, scaling=attn.scaling, row_starts=row_starts)
            hidden = residual + attn.o_proj(out.reshape(batch, 1, -1).contiguous())
            residual = hidden
            hidden = residual + self._mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        hidden = self.inner.norm(hidden)
        return self.model.lm_head(hidden[:, -1:, :])[:, -1, :]


    @staticmethod
    def _mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(mlp, "gate_up_fused", None)
        if fused is None or not hasattr(mlp, "act_fn"):
            return mlp(x)
        gate, up = fused(x).split(fused.splits, -1)
        return mlp.down_proj(mlp.act_fn(gate) * up)  # LlamaMLP.forward, with gate and up in one call


def _append(layer: Any, k: torch.Tensor, v: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one column at ``length`` into the layer's buffers (new ones with `GROW` spare columns
    when its keys are not a view of them, or they are full); the layer then holds views of them."""
    buffers = getattr(layer, "multistream_buffers", None)
    keys = layer.keys
    if buffers is None or buffers[0].data_ptr() != keys.data_ptr() or buffers[0].shape[0] != keys.shape[0] \
            or buffers[0].shape[2] <= length or keys.shape[2] != length:
        rows, heads, _, dim = keys.shape
        kbuf = keys.new_empty(rows, heads, length + 1 + GROW, dim)
        vbuf = layer.values.new_empty(rows, heads, length + 1 + GROW, dim)
        kbuf[:, :, :length].copy_(keys)
        vbuf[:, :, :length].copy_(layer.values)
        buffers = (kbuf, vbuf)
        layer.multistream_buffers = buffers
    kbuf, vbuf = buffers
    kbuf[:, :, length : length + 1].copy_(k)
    vbuf[:, :, length : length + 1].copy_(v)
    layer.keys, layer.values = kbuf[:, :, : length + 1], vbuf[:, :, : length + 1]
    return layer.keys, layer.values
