"""The fast decode step (`multistream.text._accel.fast_decode`) compiled with ``torch.compile``.

Once the weights are quantized, what is left of a small model's decode step on a CPU is mostly
small operations (norms, rotary embedding, residuals, casts: about 85 per layer, 4 us each).
Inductor fuses them into a few kernels per layer; the quantized matmuls stay ATen's packed
kernels and the attention stays the row-by-row SDPA of `multistream.text._accel.row_attention` (a custom
op, ``multistream::row_sdpa``, that the compiled graph calls). Each call of a compiled function
costs its guards (~0.1 ms), so the layers are compiled in segments of five, one call each; the
engine's prefill points sit between segments.

Compiled once per model at load (`compile_decode`), on the loading thread, for one row and for
several (the shapes are dynamic: any batch, any length). That takes about 50 s on 2 cores, and
a second load takes as long: inductor's disk caches are warm by then, but tracing the layers and
rebuilding the graphs is most of the cost (measured on the embedded model). That is why
``load_text_model(compile=...)`` is off by default. A failure (no C++ compiler, an unsupported
op) leaves the eager fast step in place, with one log line.

The compiled step computes the same function as the eager one, not bit for bit: fused kernels
round in their own order. Each row still gets the same arithmetic whatever else is in the batch
(a stream in a batch equals its output alone), but no longer exactly what transformers' own
``generate`` gives (``compile=False`` keeps that).

Example:
    >>> report = compile_decode(model)             # doctest: +SKIP
    >>> report.seconds, report.error               # doctest: +SKIP
    (41.2, None)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from .fast_decode import PREFILL_POINTS, register_compiled
from .quantize import Int4Linear, Int8Linear

__all__ = ["CompileReport", "CompiledDecode", "compile_decode"]

logger = logging.getLogger("multistream")


class _SdpaModule:
    """What transformers' SDPA function reads from an attention module."""

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def _row_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, scaling: float,
              groups: int) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _SdpaModule(groups)
    firsts = [int(s) for s in starts.tolist()]
    if len(firsts) == 1 and firsts[0] == 0:
        return sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=scaling)[0]
    outputs = [sdpa_attention_forward(module, q[r : r + 1], k[r : r + 1, :, s:], v[r : r + 1, :, s:], None,
                                      dropout=0.0, scaling=scaling)[0] for r, s in enumerate(firsts)]
    return torch.cat(outputs, 0)


def _register_op() -> Any:
    namespace = torch.ops.multistream
    if hasattr(namespace, "row_sdpa"):
        return namespace.row_sdpa
    op = torch.library.custom_op("multistream::row_sdpa", mutates_args=())(_row_sdpa)

    @op.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, scaling: float,
          groups: int) -> torch.Tensor:
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

    return torch.ops.multistream.row_sdpa


@dataclass
class CompileReport:
    """What `compile_decode` did: seconds spent, or why it did not compile."""

    seconds: float = 0.0
    error: str | None = None

    @property
    def compiled(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class _Shape:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    eps: float
    scaling: float
    kind: str  # "int4" | "int8"
    group_size: int


def _linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, out: int, shape: _Shape) -> torch.Tensor:
    # Int4Linear / Int8Linear.forward, inlined (no module in the graph, so no per-module guards).
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if shape.kind == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight, shape.group_size, scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(flat, weight, scales)
    return y.reshape(*x.shape[:-1], out).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm.forward
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _segment(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kbufs: list[torch.Tensor],
             vbufs: list[torch.Tensor], length: int, starts: torch.Tensor, weights: list[tuple[torch.Tensor, ...]],
             shape: _Shape) -> torch.Tensor:
    """Some decoder layers of one decode step: the eager `FastDecode.step`'s arithmetic."""
    rows = hidden.shape[0]
    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    for (norm1, qkv_w, qkv_s, o_w, o_s, norm2, gu_w, gu_s, down_w, down_s), kbuf, vbuf in zip(weights, kbufs, vbufs):
        residual = hidden
        qkv = _linear(_rms_norm(hidden, norm1, shape.eps), qkv_w, qkv_s, (h + 2 * kv) * d, shape)
        q, k, v = qkv.split([h * d, kv * d, kv * d], -1)
        q = q.view(rows, 1, h, d).transpose(1, 2)
        k = k.view(rows, 1, kv, d).transpose(1, 2)
        v = v.view(rows, 1, kv, d).transpose(1, 2)
        q = (q * c) + (_rotate_half(q) * s)
        k = (k * c) + (_rotate_half(k) * s)
        kbuf[:, :, length : length + 1].copy_(k)
        vbuf[:, :, length : length + 1].copy_(v)
        out = torch.ops.multistream.row_sdpa(q, kbuf[:, :, : length + 1], vbuf[:, :, : length + 1], starts,
                                             shape.scaling, h // kv)
        hidden = residual + _linear(out.reshape(rows, 1, h * d), o_w, o_s, shape.hidden, shape)
        residual = hidden
        gate_up = _linear(_rms_norm(hidden, norm2, shape.eps), gu_w, gu_s, 2 * shape.intermediate, shape)
        gate, up = gate_up.split([shape.intermediate, shape.intermediate], -1)
        hidden = residual + _linear(torch.nn.functional.silu(gate) * up, down_w, down_s, shape.hidden, shape)
    return hidden


def _weights(layer: torch.nn.Module, kind: type) -> tuple[torch.Tensor, ...] | None:
    attn, mlp = layer.self_attn, layer.mlp
    parts = [getattr(attn, "qkv_fused", None), attn.o_proj, getattr(mlp, "gate_up_fused", None), mlp.down_proj]
    if not all(type(p) is kind and p.bias is None for p in parts):
        return None
    if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if not all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") and type(n).__name__.endswith("RMSNorm")
               for n in norms):
        return None
    if kind is Int4Linear:
        tensors = [(p.packed, p.scales_and_zeros) for p in parts]
    else:
        tensors = [(p.weight_int8, p.scales) for p in parts]
    (qkv_w, qkv_s), (o_w, o_s), (gu_w, gu_s), (down_w, down_s) = tensors
    return (norms[0].weight, qkv_w, qkv_s, o_w, o_s, norms[1].weight, gu_w, gu_s, down_w, down_s)


class CompiledDecode:
    """The compiled segments of one model's decode step. Build it with `compile_decode`."""

    def __init__(self, model: Any, shape: _Shape, weights: list[tuple[torch.Tensor, ...]]) -> None:
        self.shape = shape
        self.weights = weights
        self.spacing = max(1, len(weights) // PREFILL_POINTS)  # the engine's prefill points: between segments
        self._op = _register_op()
        self._segment = torch.compile(_segment, dynamic=True, fullgraph=True)

    @classmethod
    def for_model(cls, model: Any) -> CompiledDecode | None:
        config = model.config
        layers = list(model.model.layers)
        first = getattr(layers[0].self_attn, "qkv_fused", None) if layers else None
        if type(first) not in (Int4Linear, Int8Linear) or next(model.parameters()).device.type != "cpu":
            return None
        weights = [_weights(layer, type(first)) for layer in layers]
        if any(w is None for w in weights):
            return None
        attn = layers[0].self_attn
        shape = _Shape(
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=attn.head_dim,
            hidden=config.hidden_size, intermediate=config.intermediate_size,
            eps=float(layers[0].input_layernorm.variance_epsilon), scaling=float(attn.scaling),
            kind="int4" if type(first) is Int4Linear else "int8",
            group_size=getattr(first, "group_size", 0),
        )
        return cls(model, shape, weights)  # type: ignore[arg-type]

    def segments(self) -> list[tuple[int, int]]:
        n = len(self.weights)
        return [(start, min(n, start + self.spacing)) for start in range(0, n, self.spacing)]

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kbufs: list[torch.Tensor],
                   vbufs: list[torch.Tensor], length: int, starts: torch.Tensor,
                   prefill_point: Any | None = None) -> torch.Tensor:
        """Every decoder layer, the prefill point (if any) called before each segment but the first."""
        for start, end in self.segments():
            if start and prefill_point is not None:
                prefill_point()
            hidden = self._segment(hidden, cos, sin, kbufs[start:end], vbufs[start:end], length, starts,
                                   self.weights[start:end], self.shape)
        return hidden

    def warm_up(self) -> None:
        """Compile for one row and for several, on made-up inputs (the shapes are dynamic after that).

        Without duck shaping: dynamo would otherwise tie the batch size to any weight dimension of
        the same size in the warm-up (int4 scales end in a dimension of 2, SmolLM has 3 KV heads)
        and compile again, on the engine thread, the first time another batch size comes.
        """
        from torch.fx.experimental import _config as fx_config

        with fx_config.patch(use_duck_shape=False):
            self._warm_up()

    def _warm_up(self) -> None:
        s = self.shape
        dtype = self.weights[0][0].dtype
        for rows in (1, 2):
            hidden = torch.randn(rows, 1, s.hidden, dtype=dtype)
            cos = torch.randn(rows, 1, s.head_dim, dtype=dtype)
            sin = torch.randn(rows, 1, s.head_dim, dtype=dtype)
            n = len(self.weights)
            kbufs = [torch.zeros(rows, s.kv_heads, 24, s.head_dim, dtype=dtype) for _ in range(n)]
            vbufs = [torch.zeros(rows, s.kv_heads, 24, s.head_dim, dtype=dtype) for _ in range(n)]
            starts = torch.tensor([0] + [3] * (rows - 1))
            for length in (9, 17):  # two lengths, so no integer is specialised on
                self.run_layers(hidden, cos, sin, kbufs, vbufs, length, starts)


def compile_decode(model: Any) -> CompileReport:
    """Compile ``model``'s decode step (see the module docstring); its `FastDecode` then uses it.

    Example:
        >>> compile_decode(llm.model).compiled        # doctest: +SKIP
        True
    """
    started = time.perf_counter()
    try:
        decode = CompiledDecode.for_model(model)
        if decode is None:
            return CompileReport(error="not a model the compiled step knows (quantized Llama-family layers on a CPU)")
        with torch.no_grad():  # the engine thread's grad mode, so the guards hold there
            decode.warm_up()
    except Exception as exc:  # noqa: BLE001 - no compiler, an op inductor cannot take: stay eager
        message = str(exc).strip().splitlines()
        error = f"{type(exc).__name__}: {message[0] if message else 'no message'}"
        logger.warning("compiling the decode step failed (%s); decoding eagerly", error)
        return CompileReport(seconds=time.perf_counter() - started, error=error)
    register_compiled(model, decode)
    report = CompileReport(seconds=time.perf_counter() - started)
    logger.info("compiled the decode step in %.1f s", report.seconds)
    return report

