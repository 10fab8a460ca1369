"""A lean decode step for Llama-family models on the engine's rows, with a KV cache that grows in place.

A decode step of a small model on a CPU is mostly overhead once its weights are quantized:
transformers' forward builds an attention mask, goes through several wrappers per layer and
concatenates every layer's whole KV cache with the new column (an O(length) copy per layer per
step). `FastDecode` runs the same computation, op for op (the model's own norm, projection, MLP and
rotary modules, transformers' ``apply_rotary_pos_emb`` and SDPA function, so its logits are bit for
bit those of ``model(...)``), but:

- the keys and values live in buffers with spare columns: a step writes its column in place and
  the cache layers hold views of the buffers (a copy only every `GROW` steps, when they fill up);
- no mask: it attends row by row (`multistream.text._accel.row_attention`), each row on its own columns;
- the engine's prefill points are called between layers directly (no hooks needed);
- a model whose layers are native (`multistream.text._accel.native_layers`) runs each stretch of
  layers between two prefill points as one C call (`NativeStack`): the same per-token arithmetic
  as its own forward, prefills included, so the logits are bit for bit those of ``model(...)``.

It serves models that attend with `row_attention` (the quantized ones) and whose decoder layers
have the Llama structure (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp``): Llama, SmolLM, Mistral without a sliding window. A model
whose ``forward`` was replaced on the instance (a wrapper, accelerate's hooks) keeps its forward.

Example:
    >>> fast = FastDecode.for_model(model)                    # doctest: +SKIP
    >>> logits = fast.step(input_ids, positions, rows, row_starts)   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._kv_rows import RowCache
from .kernels import StopPoints, Tokens, native_kernels
from .native_layers import NativeStack, native_layer
from .row_attention import row_attention, uses_row_attention

__all__ = ["GROW", "PREFILL_POINTS", "FastDecode", "compiled_decode", "register_compiled"]

GROW = 64  # spare columns per buffer: one copy of the cache every GROW decode steps
# Prefill points per decode forward: a newcomer waits at most about 1/N of a step for its prefill.
PREFILL_POINTS = 6
_MODEL_TYPES = frozenset({"llama", "mistral"})
# Models whose decode step was compiled (`multistream.text._accel.compiled_decode`): model -> its layers' step.
_COMPILED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def register_compiled(model: Any, decode: Any) -> None:
    """From now on `FastDecode` runs ``model``'s layers through ``decode.run_layers`` (None: eager again)."""
    with _LOCK:
        if decode is None:
            _COMPILED.pop(model, None)
        else:
            _COMPILED[model] = decode


def compiled_decode(model: Any) -> Any | None:
    """The compiled layers of ``model``'s decode step, if registered."""
    with _LOCK:
        return _COMPILED.get(model)


class FastDecode:
    """The decode step of one model (see the module docstring). Build it with `for_model`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        natives = [native_layer(layer) for layer in self.layers]
        # Every layer native (the block-quantized CPU models): runs of layers in one C call each.
        self.native_stack = NativeStack(natives) if natives and all(natives) else None  # type: ignore[arg-type]
        self.apply_rotary: Callable[..., Any] | None = None
        if self.native_stack is None:  # the eager step's rotary (imported only here: `lean_llama`)
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            self.apply_rotary = apply_rotary_pos_emb
        self._stops: StopPoints | None = None
        # Positions the kernels compute in one pass over the weights (exact lookahead weighs drafts
        # that start another pass); 0 where the native stack does not run.
        kernels = native_kernels() if self.native_stack is not None else None
        self.row_group = kernels.row_group() if kernels is not None else 0

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
        points: frozenset[int] = frozenset(), prefill_point: Callable[[], None] | None = None,
        arrivals: ctypes.c_int32 | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for one new token per row; ``rows`` gains the token's column.

        ``prefill_point()`` is called before the layers in ``points`` (the compiled step: before each
        of its segments but the first, which are the same layers). With ``arrivals`` (the engine's
        flag, set while a request waits), the native stack runs every layer in one C call that
        stops at a point only when the flag is set; without it, one call per run between points.
        """
        length = rows.length
        layers = list(getattr(rows.cache, "layers", []))
        hidden = self.inner.embed_tokens(input_ids)
        batch = hidden.shape[0]
        compiled = compiled_decode(self.model)
        if self.native_stack is not None and len(layers) == len(self.layers):
            buffers = [_reserve(cached, length) for cached in layers]
            tokens = self.native_stack.tokens(positions, batch, length, row_starts)
            hidden = self._native_layers(hidden, tokens, buffers, points, prefill_point, arrivals)
            for cached, (kbuf, vbuf) in zip(layers, buffers):
                cached.keys, cached.values = kbuf[:, :, : length + 1], vbuf[:, :, : length + 1]
            return self.model.lm_head(self.inner.norm(hidden)[:, -1:, :])[:, -1, :]
        cos, sin = self.inner.rotary_emb(hidden, position_ids=positions)
        if compiled is not None:
            buffers = [_reserve(cached, length) for cached in layers]
            starts = torch.tensor(row_starts if row_starts is not None else [0] * batch)
            hidden = compiled.run_layers(hidden, cos, sin, [k for k, _ in buffers], [v for _, v in buffers], length,
                                         starts, prefill_point if points else None)
            for cached, (kbuf, vbuf) in zip(layers, buffers):
                cached.keys, cached.values = kbuf[:, :, : length + 1], vbuf[:, :, : length + 1]
            return self.model.lm_head(self.inner.norm(hidden)[:, -1:, :])[:, -1, :]
        for i, (layer, cached) in enumerate(zip(self.layers, layers)):
            if i in points and prefill_point is not None:
                prefill_point()
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
            assert self.apply_rotary is not None
            q, k = self.apply_rotary(q, k, cos, sin)
            keys, values = _append(cached, k, v, length)
            out, _ = row_attention(attn, q, keys, values, None, dropout=0.0, scaling=attn.scaling, row_starts=row_starts)
            hidden = residual + attn.o_proj(out.reshape(batch, 1, -1).contiguous())
            residual = hidden
            hidden = residual + self._mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        hidden = self.inner.norm(hidden)
        return self.model.lm_head(hidden[:, -1:, :])[:, -1, :]


    @property
    def ragged(self) -> bool:
        """True if `step_ragged` serves this model (every layer native): rows may then end at different
        columns and take several tokens each (exact lookahead's verification)."""
        return self.native_stack is not None

    def step_ragged(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: RowCache, spans: list[tuple[int, int]],
        counts: list[int], points: frozenset[int] = frozenset(), prefill_point: Callable[[], None] | None = None,
        arrivals: ctypes.c_int32 | None = None,
    ) -> torch.Tensor:
        """Logits ``[sum(counts), vocab]`` for ``counts[r]`` new tokens of row ``r`` (``input_ids`` and
        ``positions``: ``[sum(counts)]``, row by row), written at columns ``spans[r][1]`` on; row ``r``
        attends from column ``spans[r][0]``. The cache layers then hold every column written (the
        caller narrows them to what it keeps: `RowCache.keep`).

        Each token is computed as it would be alone (one arithmetic, `native_layers`): its logits are
        bit for bit those of a one-token step at its position, so ``k`` drafted tokens are verified
        in one forward exactly.
        """
        assert self.native_stack is not None
        length = rows.length
        layers = list(getattr(rows.cache, "layers", []))
        ends = [end + n for (_, end), n in zip(spans, counts)]
        width = max(max(ends), length)
        kv_row = torch.tensor([r for r, n in enumerate(counts) for _ in range(n)])
        first = torch.tensor([start for (start, _), n in zip(spans, counts) for _ in range(n)])
        column = torch.tensor([end + j for (_, end), n in zip(spans, counts) for j in range(n)])
        cos, sin = self.native_stack.rotary.rows(positions)
        tokens = Tokens(cos, sin, kv_row, first, column)
        hidden = self.inner.embed_tokens(input_ids.view(-1, 1))
        buffers = [_reserve(cached, length, width - length) for cached in layers]
        hidden = self._native_layers(hidden, tokens, buffers, points, prefill_point, arrivals)
        for cached, (kbuf, vbuf) in zip(layers, buffers):
            cached.keys, cached.values = kbuf[:, :, :width], vbuf[:, :, :width]
        return self.model.lm_head(self.inner.norm(hidden))[:, -1, :]

    def _native_layers(self, hidden: torch.Tensor, tokens: Any, buffers: list[tuple[torch.Tensor, torch.Tensor]],
                       points: frozenset[int], prefill_point: Callable[[], None] | None,
                       arrivals: ctypes.c_int32 | None) -> torch.Tensor:
        stack, count = self.native_stack, len(self.layers)
        assert stack is not None
        points = frozenset(p for p in points if 0 < p < count) if prefill_point is not None else frozenset()
        if points and arrivals is not None:
            # One C call for the step; it returns early at a point only when a request is waiting.
            if self._stops is None or self._stops.flag is not arrivals or self._stops.layers != points:
                self._stops = StopPoints(points, count, arrivals)
            start = 0
            while True:
                hidden, start = stack.decode(start, count, hidden, tokens, buffers[start:], self._stops)
                if start >= count:
                    return hidden
                assert prefill_point is not None
                prefill_point()
        # One C call per run of layers between two of the engine's prefill points.
        bounds = sorted({0, count} | points)
        for start, end in zip(bounds, bounds[1:]):
            if start in points and prefill_point is not None:
                prefill_point()
            hidden, _ = stack.decode(start, end, hidden, tokens, buffers[start:end])
        return hidden

    @staticmethod
    def _mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(mlp, "gate_up_fused", None)
        if fused is None or not hasattr(mlp, "act_fn"):
            return mlp(x)
        gate, up = fused(x).split(fused.splits, -1)
        return mlp.down_proj(mlp.act_fn(gate) * up)  # LlamaMLP.forward, with gate and up in one call


def _append(layer: Any, k: torch.Tensor, v: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one column at ``length`` into the layer's buffers; the layer then holds views of them."""
    kbuf, vbuf = _reserve(layer, length)
    kbuf[:, :, length : length + 1].copy_(k)
    vbuf[:, :, length : length + 1].copy_(v)
    layer.keys, layer.values = kbuf[:, :, : length + 1], vbuf[:, :, : length + 1]
    return layer.keys, layer.values


def _reserve(layer: Any, length: int, more: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's buffers with room for ``more`` columns from ``length``: new ones with `GROW` spare
    columns when its keys are not a view of them (the cache was reshaped: rows joined or left) or
    they are full."""
    buffers = getattr(layer, "multistream_buffers", None)
    keys = layer.keys
    if buffers is None or buffers[0].data_ptr() != keys.data_ptr() or buffers[0].shape[0] != keys.shape[0] \
            or buffers[0].shape[2] < length + more or keys.shape[2] != length:
        rows, heads, _, dim = keys.shape
        kbuf = keys.new_empty(rows, heads, length + more + GROW, dim)
        vbuf = layer.values.new_empty(rows, heads, length + more + GROW, dim)
        kbuf[:, :, :length].copy_(keys)
        vbuf[:, :, :length].copy_(layer.values)
        buffers = (kbuf, vbuf)
        layer.multistream_buffers = buffers
    return buffers
