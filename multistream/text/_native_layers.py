"""Llama decoder layers that decode a token in two native calls (``_block_kernels.c``).

Once a small model's weights are block-quantized (`multistream.text._block_layers`), its matmuls
take about a quarter of an eager decode step on a CPU; the rest is some sixty small torch
operations per layer (norms, rotary embedding, views, SDPA, residuals) at several microseconds
each. A native layer does the whole layer for one new token per row in two C calls, around the
KV cache's append, which stays the caller's:

1. ``qkv``: RMS norm, the fused q/k/v projection, the rotary embedding;
2. the cache appends k and v (transformers' ``cache.update``, or the engine's in-place buffers);
3. ``rest``: attention of each row on its own columns, the output projection, the residual, the
   second norm, the gated MLP, the residual.

A caller that owns its KV buffers (the engine's `FastDecode`) makes it one call, ``decode``, which
writes the new column itself.

`attach_native_layers` gives each eligible decoder layer this path: its class becomes a subclass
whose ``forward`` takes the native path for one-token steps (``model.generate``'s decode steps,
the engine's forward) and transformers' own for prefills. The engine's `FastDecode` calls the same
two functions, so a stream and ``model.generate`` compute the same numbers, bit for bit.

A layer is eligible when its model is a Llama or a Mistral without a sliding window
(`NATIVE_MODEL_TYPES`), with fp32 activations, block-quantized fused
projections (``qkv_fused``, ``gate_up_fused``), ``o_proj`` and ``down_proj`` without biases, RMS
norms and a SiLU MLP; other layers keep their forward.

Example:
    >>> attach_native_layers(model)                     # doctest: +SKIP
    30
"""

from __future__ import annotations

import ctypes
import functools
import operator
from typing import Any

import torch

from ._block_kernels import check_buffers, native_kernels
from ._block_layers import Q4Linear, Q8Linear

__all__ = ["NativeLayer", "NativeStack", "attach_native_layers", "native_layer"]

_SUBCLASSES: dict[type, type] = {}
NATIVE_MODEL_TYPES = frozenset({"llama", "mistral"})  # the Llama layer: RMS norms, rotate-half rotary, SiLU MLP


def _block(layer: Any) -> bool:
    return isinstance(layer, (Q4Linear, Q8Linear)) and layer.bias is None and layer.dtype == torch.float32


def _pointers(layer: Q4Linear | Q8Linear) -> tuple[int, int, int]:
    # Read at each call, never kept: buffers can be replaced (or moved) after the layer was attached.
    check_buffers(layer.weight_q, layer.scales)
    return layer.weight_q.data_ptr(), layer.scales.data_ptr(), layer.kind


class NativeLayer:
    """The native decode path of one decoder layer (build it with `for_layer`)."""

    def __init__(self, layer: Any, config: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.cdll = native_kernels().cdll  # type: ignore[union-attr]
        self.heads, self.kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        self.dim, self.hidden = int(attn.head_dim), int(config.hidden_size)
        self.intermediate = int(mlp.gate_up_fused.out_features) // 2
        self.scaling = float(attn.scaling)
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps1, self.eps2 = float(self.norm1.variance_epsilon), float(self.norm2.variance_epsilon)
        self.qkv_proj, self.o_proj = attn.qkv_fused, attn.o_proj
        self.gate_up_proj, self.down_proj = mlp.gate_up_fused, mlp.down_proj
        self._checked: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None = None

    def _weights(self) -> tuple[int, ...]:
        """The weights' pointers, checked again whenever a buffer was replaced (``model.to(...)``
        replaces them): a step reads them without re-validating each tensor."""
        projections = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        tensors = tuple(t for p in projections for t in (p.weight_q, p.scales)) + (self.norm1.weight,
                                                                                   self.norm2.weight)
        checked = self._checked
        if checked is None or not all(map(operator.is_, checked[0], tensors)):
            pointers = tuple(v for p in projections for v in _pointers(p))
            for norm in tensors[-2:]:
                if norm.dtype != torch.float32 or norm.device.type != "cpu" or not norm.is_contiguous():
                    raise RuntimeError("a native decoder layer's norm weights were cast or moved after quantizing")
            self._checked = checked = (tensors, pointers + (tensors[-2].data_ptr(), tensors[-1].data_ptr()))
        return checked[1]

    @classmethod
    def for_layer(cls, layer: Any, config: Any) -> NativeLayer | None:
        """The native path for ``layer``, or None if the layer is not one it computes."""
        if native_kernels() is None:
            return None
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return None
        parts = [getattr(attn, "qkv_fused", None), getattr(attn, "o_proj", None),
                 getattr(mlp, "gate_up_fused", None), getattr(mlp, "down_proj", None)]
        if not all(_block(p) for p in parts):
            return None
        if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            return None
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon")
                   and getattr(n, "weight", None) is not None and n.weight.dtype == torch.float32 for n in norms):
            return None
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        dim = int(getattr(attn, "head_dim", 0))
        if not dim or heads % kv_heads or parts[0].out_features != (heads + 2 * kv_heads) * dim:
            return None
        if parts[2].out_features % 2 or parts[3].in_features != parts[2].out_features // 2:
            return None
        return cls(layer, config)

    def qkv(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``[rows, 1, hidden]`` -> q ``[rows, heads, 1, dim]``, k and v ``[rows, kv_heads, 1, dim]``
        (normed, projected, rotated); ``cos``/``sin`` ``[rows, 1, dim]`` from the model's rotary embedding."""
        rows = hidden.shape[0]
        x, cos, sin = hidden.contiguous(), cos.contiguous(), sin.contiguous()
        q = hidden.new_empty(rows, self.heads, 1, self.dim)
        k = hidden.new_empty(rows, self.kv_heads, 1, self.dim)
        v = hidden.new_empty(rows, self.kv_heads, 1, self.dim)
        w, s, kind = _pointers(self.qkv_proj)
        status = self.cdll.ms_layer_qkv(
            x.data_ptr(), rows, self.hidden, self.norm1.weight.data_ptr(), self.eps1, w, s, kind,
            cos.data_ptr(), sin.data_ptr(), self.heads, self.kv_heads, self.dim, q.data_ptr(), k.data_ptr(),
            v.data_ptr(), torch.get_num_threads())
        _check(status)
        return q, k, v

    def rest(self, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             row_starts: list[int] | None) -> torch.Tensor:
        """The layer's output ``[rows, 1, hidden]`` from its input ``hidden``, ``q`` from `qkv` and the
        cache's keys and values ``[rows, kv_heads, columns, dim]`` (the new column included); row
        ``i`` attends to columns ``row_starts[i]`` on (None: all)."""
        rows, columns = hidden.shape[0], keys.shape[2]
        if keys.stride(3) != 1 or values.stride(3) != 1 or keys.dtype != torch.float32:
            keys, values = keys.float().contiguous(), values.float().contiguous()
        x = hidden.contiguous()
        out = torch.empty_like(x)
        key_strides = (ctypes.c_int64 * 3)(*keys.stride()[:3])
        value_strides = (ctypes.c_int64 * 3)(*values.stride()[:3])
        starts = None if row_starts is None else (ctypes.c_int64 * rows)(*row_starts)
        (ow, os_, okind), (gw, gs, gkind), (dw, ds, dkind) = (
            _pointers(self.o_proj), _pointers(self.gate_up_proj), _pointers(self.down_proj))
        status = self.cdll.ms_layer_rest(
            x.data_ptr(), q.data_ptr(), rows, self.hidden, keys.data_ptr(), values.data_ptr(), key_strides,
            value_strides, columns, starts, self.scaling, self.heads, self.kv_heads, self.dim, ow, os_, okind,
            self.norm2.weight.data_ptr(), self.eps2, gw, gs, gkind, dw, ds, dkind, self.intermediate,
            out.data_ptr(), torch.get_num_threads())
        _check(status)
        return out


    def check_buffers(self, kbuf: torch.Tensor, vbuf: torch.Tensor, rows: int, length: int) -> None:
        """Raise unless ``kbuf``/``vbuf`` are what the native step writes into (it writes column ``length``)."""
        expected = (rows, self.kv_heads, self.dim)
        for buf in (kbuf, vbuf):
            if buf.dtype != torch.float32 or buf.device.type != "cpu" or buf.dim() != 4 or buf.stride(3) != 1 \
                    or (buf.shape[0], buf.shape[1], buf.shape[3]) != expected or buf.shape[2] <= length:
                raise RuntimeError(f"a native decode step needs fp32 CPU KV buffers [{rows}, {self.kv_heads}, "
                                   f"> {length}, {self.dim}], got {buf.dtype} {tuple(buf.shape)}")

    def decode(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kbuf: torch.Tensor,
               vbuf: torch.Tensor, length: int, row_starts: list[int] | None) -> torch.Tensor:
        """`qkv`, the new k and v written at column ``length`` of the caller's buffers ``kbuf``/``vbuf``
        ``[rows, kv_heads, capacity, dim]`` (fp32, capacity > ``length``), then `rest` on columns
        ``row_starts[i]`` to ``length``: the same numbers as the two calls, in one."""
        rows = hidden.shape[0]
        self.check_buffers(kbuf, vbuf, rows, length)
        x, cos, sin = hidden.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(x)
        qw, qs, qkind, ow, os_, okind, gw, gs, gkind, dw, ds, dkind, norm1, norm2 = self._weights()
        status = self.cdll.ms_layer_decode(
            x.data_ptr(), rows, self.hidden, norm1, self.eps1, qw, qs, qkind, cos.data_ptr(), sin.data_ptr(),
            self.heads, self.kv_heads, self.dim, kbuf.data_ptr(), vbuf.data_ptr(), _int64s(kbuf.stride()[:3]),
            _int64s(vbuf.stride()[:3]), length, None if row_starts is None else _int64s(tuple(row_starts)),
            self.scaling, ow, os_, okind, norm2, self.eps2, gw, gs, gkind, dw, ds, dkind, self.intermediate,
            out.data_ptr(), torch.get_num_threads())
        _check(status)
        return out


class _LayerArgs(ctypes.Structure):
    """``ms_layer`` of ``_block_kernels.c``: one layer's weights and KV buffers."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "norm1_w", "norm2_w", "qkv_w", "o_w", "gu_w", "down_w", "qkv_s", "o_s", "gu_s", "down_s", "kbuf", "vbuf")] + [
        ("ks", ctypes.c_int64 * 3), ("vs", ctypes.c_int64 * 3), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
        ("qkv_kind", ctypes.c_int32), ("o_kind", ctypes.c_int32), ("gu_kind", ctypes.c_int32),
        ("down_kind", ctypes.c_int32)]


class NativeStack:
    """Consecutive native layers decoded in one C call per run of them (`NativeLayer.decode` each,
    without a trip through Python between layers). The arguments of each layer are kept in a C
    array and rewritten only when its weights or KV buffers change.

    Example:
        >>> stack = NativeStack([native_layer(layer) for layer in model.model.layers])   # doctest: +SKIP
        >>> hidden = stack.decode(0, 30, hidden, cos, sin, buffers, length, None)          # doctest: +SKIP
    """

    def __init__(self, natives: list[NativeLayer]) -> None:
        self.natives = natives
        self.args = (_LayerArgs * len(natives))()
        self._keys: list[Any] = [None] * len(natives)
        first = natives[0]
        self.cdll, self.shape = first.cdll, (first.heads, first.kv_heads, first.dim, first.hidden,
                                                   first.intermediate, first.scaling)
        if any((n.heads, n.kv_heads, n.dim, n.hidden, n.intermediate, n.scaling) != self.shape for n in natives):
            raise ValueError("the layers of a native stack must share their shapes")

    def _fill(self, i: int, kbuf: torch.Tensor, vbuf: torch.Tensor) -> None:
        native = self.natives[i]
        weights = native._weights()
        key = (weights, kbuf.data_ptr(), vbuf.data_ptr(), kbuf.stride(), vbuf.stride())
        if key == self._keys[i]:
            return
        qw, qs, qkind, ow, os_, okind, gw, gs, gkind, dw, ds, dkind, norm1, norm2 = weights
        self.args[i] = _LayerArgs(norm1, norm2, qw, ow, gw, dw, qs, os_, gs, ds, kbuf.data_ptr(), vbuf.data_ptr(),
                                  (ctypes.c_int64 * 3)(*kbuf.stride()[:3]), (ctypes.c_int64 * 3)(*vbuf.stride()[:3]),
                                  native.eps1, native.eps2, qkind, okind, gkind, dkind)
        self._keys[i] = key

    def decode(self, start: int, end: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               buffers: list[tuple[torch.Tensor, torch.Tensor]], length: int, row_starts: list[int] | None
               ) -> torch.Tensor:
        """Layers ``start``..``end - 1`` on ``hidden`` ``[rows, 1, hidden]``; ``buffers``: their (kbuf, vbuf)."""
        rows = hidden.shape[0]
        for i, (kbuf, vbuf) in zip(range(start, end), buffers):
            self.natives[i].check_buffers(kbuf, vbuf, rows, length)
            self._fill(i, kbuf, vbuf)
        heads, kv_heads, dim, width, intermediate, scaling = self.shape
        x = hidden.contiguous().clone()  # written in place
        cos, sin = cos.contiguous(), sin.contiguous()
        status = self.cdll.ms_layers_decode(
            ctypes.byref(self.args, start * ctypes.sizeof(_LayerArgs)), end - start, x.data_ptr(), rows, width,
            cos.data_ptr(), sin.data_ptr(), heads, kv_heads, dim, intermediate, scaling, length,
            None if row_starts is None else _int64s(tuple(row_starts)), torch.get_num_threads())
        _check(status)
        return x


@functools.lru_cache(maxsize=256)
def _int64s(values: tuple[int, ...]) -> Any:
    """A C array of ``values`` (strides, row starts): the same few recur at every layer and step."""
    return (ctypes.c_int64 * len(values))(*values)


def _check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"a native decoder layer failed (status {status}: out of memory or a shape the "
                           "block kernels do not take)")


def native_layer(layer: Any) -> NativeLayer | None:
    """The native path attached to ``layer`` (`attach_native_layers`), if any."""
    return getattr(layer, "multistream_native", None)


def _visible(mask: torch.Tensor | None) -> bool:
    """True if an attention mask hides nothing (no padding): the native path needs no mask then."""
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


class _NativeDecode:
    """Mixed into a decoder layer's class: one-token steps take the native path."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        native = native_layer(self)
        row_starts = kwargs.get("row_starts")
        position_embeddings = kwargs.get("position_embeddings")
        if (native is None or args or hidden_states.shape[1] != 1 or position_embeddings is None
                or hidden_states.dtype != torch.float32 or hidden_states.device.type != "cpu"
                or (row_starts is None and not _visible(kwargs.get("attention_mask")))):
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[misc]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # its name before transformers 5.40
        cos, sin = position_embeddings
        q, k, v = native.qkv(hidden_states, cos, sin)
        keys, values = (k, v) if cache is None else cache.update(k, v, self.self_attn.layer_idx)
        starts = row_starts if row_starts is not None and len(row_starts) == hidden_states.shape[0] else None
        return native.rest(hidden_states, q, keys, values, starts)


def attach_native_layers(model: Any) -> int:
    """Give each eligible decoder layer of ``model`` the native decode path; returns how many got it."""
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if inner is None or config is None or not hasattr(inner, "layers") or native_kernels() is None:
        return 0
    # Only families whose layer is exactly what the C code computes: Qwen3's q/k norms, Gemma's
    # (1 + w) norms or a sliding window would be silently skipped by it.
    if getattr(config, "model_type", None) not in NATIVE_MODEL_TYPES or getattr(config, "sliding_window", None):
        return 0
    attached = 0
    for layer in inner.layers:
        native = NativeLayer.for_layer(layer, config)
        if native is None:
            continue
        base = type(layer)
        if not issubclass(base, _NativeDecode):
            if base not in _SUBCLASSES:
                _SUBCLASSES[base] = type(f"Native{base.__name__}", (_NativeDecode, base), {})
            layer.__class__ = _SUBCLASSES[base]
        layer.multistream_native = native
        attached += 1
    return attached
