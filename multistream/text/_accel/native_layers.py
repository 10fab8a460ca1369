"""Llama decoder layers computed by the native kernels (``kernels.c``), for every number of tokens.

Once a small model's weights are block-quantized (`multistream.text._accel.block_layers`), the rest
of an eager step (norms, rotary embedding, views, SDPA, residuals: some sixty small torch ops per
layer) costs more than its matmuls. A native layer does the whole layer in C, in two calls around
the KV cache's append, which stays the caller's:

1. ``qkv``: RMS norm, the fused q/k/v projection, the rotary embedding;
2. the cache appends k and v (transformers' ``cache.update``, or the engine's in-place buffers);
3. ``rest``: attention of each token on its own columns, the output projection, the residual, the
   second norm, the gated MLP, the residual.

A caller that owns its KV buffers (the engine's `FastDecode`) runs a stretch of layers in one call
(`NativeStack`), which writes the new columns itself.

**One arithmetic.** The native path serves one-token decode steps *and* multi-token forwards
(prefills, ``llm.score``, a re-prefill after an edit or a failover, ``model(ids)``,
``model.generate``), and the C code computes each token the same way in all of them. The rotary
embedding comes from a table the model's own rotary module fills in fixed blocks of positions
(`RotaryTable`), and the model's final norm is native too (`attach_native_layers`), so a token's
logits are bit for bit the same however it reached the model.

`attach_native_layers` gives each eligible decoder layer this path: its class becomes a subclass
whose ``forward`` takes the native path for fp32 CPU hidden states without padding (or with the
engine's ``row_starts``) and transformers' own for anything else (a padded batch in ``generate``).

A layer is eligible when its model is a Llama or a Mistral without a sliding window
(`NATIVE_MODEL_TYPES`) with a rotary embedding that does not depend on the sequence length, fp32
activations, block-quantized fused projections (``qkv_fused``, ``gate_up_fused``), ``o_proj`` and
``down_proj`` without biases, RMS norms and a SiLU MLP; other layers keep their forward.

Example:
    >>> attach_native_layers(model)                     # doctest: +SKIP
    30
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .block_layers import Q4Linear, Q8Linear, buffers_generation
from .kernels import (
    KVBuffers,
    LayerRun,
    LayerShape,
    LayerWeights,
    StopPoints,
    Tokens,
    layer_qkv,
    layer_rest,
    native_kernels,
)
from .kernels import rms_norm as native_rms_norm

__all__ = ["NATIVE_MODEL_TYPES", "NativeLayer", "NativeStack", "RotaryTable", "attach_native_layers", "native_layer"]

_SUBCLASSES: dict[type, type] = {}
NATIVE_MODEL_TYPES = frozenset({"llama", "mistral"})  # the Llama layer: RMS norms, rotate-half rotary, SiLU MLP
# Rotary embeddings whose values depend on the sequence length (so a table by position cannot hold them).
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _block(layer: Any) -> bool:
    return isinstance(layer, (Q4Linear, Q8Linear)) and layer.bias is None and layer.dtype == torch.float32


class RotaryTable:
    """cos/sin of the model's rotary embedding by position, computed by the model's own rotary
    module in fixed blocks of `BLOCK` positions and kept: a position's row never depends on which
    other positions a forward had (torch's vectorized cos splits work by tensor size).

    Example:
        >>> table = RotaryTable(model.model.rotary_emb)                 # doctest: +SKIP
        >>> cos, sin = table.rows(torch.tensor([0, 1, 2]))              # doctest: +SKIP
    """

    BLOCK = 256

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary
        self._cos: list[torch.Tensor] = []
        self._sin: list[torch.Tensor] = []
        self._joined: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def _extend(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            while len(self._cos) * self.BLOCK < positions:
                start = len(self._cos) * self.BLOCK
                ids = torch.arange(start, start + self.BLOCK).unsqueeze(0)
                probe = torch.zeros(1, dtype=torch.float32)
                with torch.no_grad():
                    cos, sin = self.rotary(probe, position_ids=ids)
                self._cos.append(cos[0].float().contiguous())
                self._sin.append(sin[0].float().contiguous())
                self._joined = None
            if self._joined is None:
                self._joined = (torch.cat(self._cos), torch.cat(self._sin))
            return self._joined

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[len(positions), dim]`` for a flat tensor of non-negative positions."""
        positions = positions.reshape(-1).to(torch.int64)
        if positions.numel() and int(positions.min()) < 0:
            raise RuntimeError("rotary positions must not be negative")
        top = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self._joined if self._joined is not None and self._joined[0].shape[0] >= top else self._extend(top)
        return cos.index_select(0, positions), sin.index_select(0, positions)


class NativeLayer:
    """The native path of one decoder layer (build it with `for_layer`)."""

    def __init__(self, layer: Any, config: Any, rotary: RotaryTable) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.rotary = rotary
        self.shape = LayerShape(int(config.hidden_size), int(config.num_attention_heads),
                                int(config.num_key_value_heads), int(attn.head_dim),
                                int(mlp.gate_up_fused.out_features) // 2, float(attn.scaling))
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps1, self.eps2 = float(self.norm1.variance_epsilon), float(self.norm2.variance_epsilon)
        self.qkv_proj, self.o_proj = attn.qkv_fused, attn.o_proj
        self.gate_up_proj, self.down_proj = mlp.gate_up_fused, mlp.down_proj
        self._weights: tuple[tuple[torch.Tensor, ...], LayerWeights] | None = None
        self._checked_at: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def weights(self) -> LayerWeights:
        """The layer's weights as the kernels read them, rebuilt (and checked) whenever a buffer was
        replaced (``model.to(...)`` replaces them; a cast one raises)."""
        norm1, norm2 = self.norm1.weight, self.norm2.weight
        checked = self._checked_at
        if checked is not None and self._weights is not None and checked[0] == buffers_generation() \
                and checked[1] is norm1 and checked[2] is norm2:
            return self._weights[1]  # nothing was assigned, moved or cast since the last check
        generation = buffers_generation()
        projections = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        tensors = tuple(t for p in projections for t in (p.weight_q, p.scales)) + (self.norm1.weight,
                                                                                   self.norm2.weight)
        held = self._weights
        if held is None or len(held[0]) != len(tensors) or not all(a is b for a, b in zip(held[0], tensors)):
            weights = LayerWeights(self.norm1.weight, self.eps1, self.norm2.weight, self.eps2,
                                   *(p.matrix() for p in projections))
            weights.struct(self.shape)  # validates dtypes, devices and shapes now
            self._weights = held = (tensors, weights)
        self._checked_at = (generation, norm1, norm2)
        return held[1]

    @classmethod
    def for_layer(cls, layer: Any, config: Any, rotary: RotaryTable) -> NativeLayer | None:
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
        if not all(_plain_rms_norm(n) for n in norms):
            return None
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        dim = int(getattr(attn, "head_dim", 0))
        if not dim or dim % 2 or heads % kv_heads or parts[0].out_features != (heads + 2 * kv_heads) * dim:
            return None
        if parts[2].out_features % 2 or parts[3].in_features != parts[2].out_features // 2:
            return None
        return cls(layer, config, rotary)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cache: Any, layer_idx: int,
                row_starts: list[int] | None) -> torch.Tensor:
        """The layer on ``hidden`` ``[rows, tokens, hidden]`` at ``positions`` ``[rows, tokens]``; the
        tokens' k and v go through ``cache.update`` (None: no cache, the tokens attend to themselves);
        row ``i`` attends from column ``row_starts[i]`` (None: 0)."""
        rows, count = hidden.shape[0], hidden.shape[1]
        past = 0 if cache is None else int(cache.get_seq_length(layer_idx))
        cos, sin = self.rotary.rows(positions)
        tokens = Tokens.of_rows(cos, sin, rows=rows, tokens=count, past=past, starts=row_starts)
        weights = self.weights()
        q, k, v = layer_qkv(weights, self.shape, tokens, hidden.reshape(rows * count, -1))
        shape = self.shape
        k = k.view(rows, count, shape.kv_heads, shape.dim).transpose(1, 2)
        v = v.view(rows, count, shape.kv_heads, shape.dim).transpose(1, 2)
        keys, values = (k, v) if cache is None else cache.update(k, v, layer_idx)
        if keys.shape[2] != past + count:
            raise RuntimeError(f"the cache holds {keys.shape[2]} columns after appending {count} to {past}")
        out = layer_rest(weights, shape, tokens, hidden.reshape(rows * count, -1), q, KVBuffers(keys, values))
        return out.view(rows, count, shape.hidden)


def _plain_rms_norm(norm: Any) -> bool:
    """A Llama RMS norm (``w * x / rms(x)``, fp32 weight): Gemma's ``(1 + w)`` norms are not."""
    return (norm is not None and type(norm).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "LeanRMSNorm")
            and hasattr(norm, "variance_epsilon") and getattr(norm, "weight", None) is not None
            and norm.weight.dtype == torch.float32)


class NativeStack:
    """Consecutive native layers decoded in one C call per run of them, each layer's k and v written
    into the engine's KV buffers (`FastDecode`).

    Example:
        >>> stack = NativeStack([native_layer(layer) for layer in model.model.layers])   # doctest: +SKIP
        >>> hidden, done = stack.decode(0, 30, hidden, tokens, buffers)                   # doctest: +SKIP
    """

    def __init__(self, natives: list[NativeLayer]) -> None:
        self.natives = natives
        first = natives[0]
        if any(n.shape != first.shape for n in natives):
            raise ValueError("the layers of a native stack must share their shapes")
        self.shape, self.rotary = first.shape, first.rotary
        self.run = LayerRun(first.shape, len(natives))

    def tokens(self, positions: torch.Tensor, rows: int, length: int, row_starts: list[int] | None) -> Tokens:
        """One new token per row at column ``length`` (the step's tokens, shared by its runs of layers)."""
        cos, sin = self.rotary.rows(positions)
        return Tokens.of_rows(cos, sin, rows=rows, tokens=1, past=length, starts=row_starts)

    def decode(self, start: int, end: int, hidden: torch.Tensor, tokens: Tokens,
               buffers: list[tuple[torch.Tensor, torch.Tensor]], stops: StopPoints | None = None
               ) -> tuple[torch.Tensor, int]:
        """Layers ``start``..``end - 1`` on ``hidden`` ``[rows, 1, hidden]`` (``buffers``: their
        (kbuf, vbuf)): ``(hidden, done)``, ``done`` the first layer not run (``end`` unless one of
        ``stops`` found its flag set)."""
        for i, (kbuf, vbuf) in zip(range(start, end), buffers):
            self.run.set(i, self.natives[i].weights(), KVBuffers(kbuf, vbuf), tokens)
        out, done = self.run.forward(start, end, tokens, hidden.reshape(tokens.count, -1), stops)
        return out.view(hidden.shape), done


def native_layer(layer: Any) -> NativeLayer | None:
    """The native path attached to ``layer`` (`attach_native_layers`), if any."""
    return getattr(layer, "multistream_native", None)


def _causal_without_padding(mask: torch.Tensor | None, count: int, past: int) -> bool:
    """True if an attention mask is the plain causal pattern (each token sees every column up to its
    own): the native path needs no mask then. A mask hiding more (padding) is not ours to read."""
    if mask is None:
        return True
    if mask.dim() == 2:
        return bool(mask.all())
    visible = mask if mask.dtype == torch.bool else mask == 0
    columns = visible.shape[-1]
    if visible.shape[-2] != count or columns != past + count:
        return False
    causal = torch.arange(columns)[None, :] <= (torch.arange(count) + past)[:, None]
    return bool((visible == causal).all())


class _NativeDecode:
    """Mixed into a decoder layer's class: fp32 CPU forwards take the native path."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        native = native_layer(self)
        positions = kwargs.get("position_ids")
        if (native is None or args or positions is None or hidden_states.dtype != torch.float32
                or hidden_states.device.type != "cpu" or kwargs.get("output_attentions")):
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[misc]
        rows, count = hidden_states.shape[0], hidden_states.shape[1]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # its name before transformers 5.40
        layer_idx = self.self_attn.layer_idx  # type: ignore[attr-defined]
        row_starts = kwargs.get("row_starts")
        if row_starts is not None and len(row_starts) != rows:
            row_starts = None
        past = 0 if cache is None else int(cache.get_seq_length(layer_idx))
        if row_starts is None and not _causal_without_padding(kwargs.get("attention_mask"), count, past):
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[misc]
        # transformers passes one row of positions for a batch without padding: each row gets it.
        positions = positions.expand(rows, count) if positions.shape[0] != rows else positions
        return native.forward(hidden_states, positions, cache, layer_idx, row_starts)


class _NativeNorm:
    """Mixed into the model's final RMS norm: fp32 CPU rows through the kernels' own norm, so the
    last hidden state of a token is the same on every path (the engine's step calls it too)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # type: ignore[attr-defined]
        if hidden_states.dtype != torch.float32 or hidden_states.device.type != "cpu" \
                or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return super().forward(hidden_states)  # type: ignore[misc]
        return native_rms_norm(hidden_states, weight, float(self.variance_epsilon))  # type: ignore[attr-defined]


def _mix(module: Any, mixin: type) -> None:
    base = type(module)
    if not issubclass(base, mixin):
        key = (mixin, base)
        if key not in _SUBCLASSES:
            _SUBCLASSES[key] = type(f"Native{base.__name__}", (mixin, base), {})  # type: ignore[index]
        module.__class__ = _SUBCLASSES[key]  # type: ignore[index]


def attach_native_layers(model: Any) -> int:
    """Give each eligible decoder layer of ``model`` (and its final norm) the native path; returns
    how many layers got it (0: none, and the model is untouched)."""
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if inner is None or config is None or not hasattr(inner, "layers") or native_kernels() is None:
        return 0
    # Only families whose layer is exactly what the C code computes: Qwen3's q/k norms, Gemma's
    # (1 + w) norms or a sliding window would be silently skipped by it.
    if getattr(config, "model_type", None) not in NATIVE_MODEL_TYPES or getattr(config, "sliding_window", None):
        return 0
    rotary_module = getattr(inner, "rotary_emb", None)
    if rotary_module is None or getattr(rotary_module, "rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
        return 0
    if not _plain_rms_norm(getattr(inner, "norm", None)):
        return 0
    rotary = RotaryTable(rotary_module)
    natives = [NativeLayer.for_layer(layer, config, rotary) for layer in inner.layers]
    if not all(natives):
        return 0  # one arithmetic for the whole model or none: a mixed model keeps transformers' path
    for layer, native in zip(inner.layers, natives):
        _mix(layer, _NativeDecode)
        layer.multistream_native = native
    _mix(inner.norm, _NativeNorm)
    return len(natives)
