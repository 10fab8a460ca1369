"""Quantization of a causal LM: its linear layers and its LM head as int8 or int4.

Decoding one token reads every weight once, so on a CPU a small model's decode step is bound by
memory traffic; storing the weights in 8 or 4 bits cuts that traffic 4x or 8x. Each
`torch.nn.Linear` is replaced by a quantized layer of one of two families:

- **The native block kernels** (a CPU with a C compiler; `multistream.text._accel.kernels`,
  layers in `multistream.text._accel.block_layers`): GGUF's block formats, ``Q4Linear`` (Q4_1:
  blocks of 32 weights with an fp16 scale and minimum) and ``Q8Linear`` (Q8_0: an fp16 scale per
  block). The input stays fp32 (each block is dequantized in registers and multiplied with FMA):
  a layer computes the fp32 product of its quantized weights, several times faster than ATen's
  bf16 int4 kernel below on an AVX2 CPU. ``activations="int8"`` rounds the input to int8 per block
  instead, as llama.cpp does (an opt-in). Llama decoder layers on them run in C for every number
  of tokens, with one arithmetic for decode and prefill (`multistream.text._accel.native_layers`).
- **ATen's packed-weight kernels** (elsewhere, and with ``block_kernels=False``): weight-only
  ``Int8Linear`` and ``Int4Linear``, activations in bf16:

========  =====================================================  ================================
mode      CPU                                                    CUDA
========  =====================================================  ================================
int8      ``_weight_int8pack_mm`` (per output channel scale)     ``_weight_int8pack_mm``
int4      ``_weight_int4pack_mm_for_cpu`` (groups of 32, with    ``_weight_int4pack_mm`` (tinygemm,
          ``_convert_weight_to_int4pack_for_cpu``)               groups of 32, bf16 only)
========  =====================================================  ================================

ATen's kernels multiply in bf16 on the CPU: it is their fast path on x86 (fp32 or fp16 inputs run
5-10x slower), so such a layer casts its input to bf16 and its output back to the model's dtype.
The rest of the model (norms, attention, residuals) keeps its dtype (fp32 by default on a CPU;
``dtype=torch.bfloat16`` makes it all bf16). torchao is not used: on the CPU its int8
weight-only tensor dequantizes the whole weight at each call in eager mode (measured 40x slower
than ``_weight_int8pack_mm`` on a 1536x576 layer, still 20x compiled on an AVX2 CPU), its CPU
int4 path calls the same ATen kernel as here (its int8-activation CPU layouts were not measured
here); on CUDA its int4 "tile packed" format is the same tinygemm kernel too.

A tied LM head (the embedding matrix reused as the output layer) gets its own quantized copy: the
head is the largest matmul of a small model (49152x576 for SmolLM2-135M, a fifth of its
weights), while the embedding lookup reads one row per token and stays exact. The head is 8-bit
in both modes (int4 on it costs the embedded model 6% of perplexity; 8 bits cost nothing
measurable; its GGUF file stores it as Q8_0).

Before touching the model, `quantize_model` runs each kernel on a small probe and checks it
against the dequantized weights: a kernel that is missing, raises or gives wrong numbers on this
device is not used (the next family serves the mode; with none, ``"auto"`` falls back with one log
line and a mode asked for by name raises `InvalidArgumentError`). Layers whose shape a kernel
cannot take (the block kernels need ``in_features % 32 == 0``; ATen's int8 on the CPU needs
``in_features % 8 == 0``, its int4 ``out_features % 16 == 0`` and ``in_features % 32 == 0``) are
quantized with the other mode or kept as they are, counted in the report.

Example:
    >>> import torch
    >>> layer = torch.nn.Sequential(torch.nn.Linear(64, 32))
    >>> report = quantize_model(layer, "int8", block_kernels=False)
    >>> type(layer[0]).__name__, report.mode, report.layers
    ('Int8Linear', 'int8', 1)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import InvalidArgumentError
from .block_layers import Q4Linear, Q8Linear, block_fits
from .kernels import Activations, native_kernels
from .native_layers import attach_native_layers
from .row_attention import use_row_attention

__all__ = [
    "FUSED_GROUPS",
    "QUANTIZE_MODES",
    "Int4Linear",
    "Int8Linear",
    "QuantizationReport",
    "ACTIVATIONS",
    "check_activations",
    "check_quantize",
    "exact_block_states",
    "block_kernels_serve",
    "fuse_projections",
    "kernel_problem",
    "mode_problem",
    "layer_from_state",
    "layer_state",
    "quantize_model",
]

logger = logging.getLogger("multistream")

QUANTIZE_MODES: tuple[str | None, ...] = (None, "int8", "int4", "auto")
INT4_GROUP_SIZE = 32  # the GGUF Q4_1 block: the embedded model's weights lie on this lattice


ACTIVATIONS = ("fp32", "int8")


def check_activations(activations: Any) -> str:
    """``activations=`` checked: ``"fp32"`` (the default: the block kernels keep a layer's input in
    fp32, so the quantized model computes what fp32 computes with its weights) or ``"int8"``
    (llama.cpp's arithmetic: the input rounded to int8 per block of 32; prefill and decode still
    agree, but the text drifts from fp32's).

    Example:
        >>> check_activations("INT8")
        'int8'
    """
    if isinstance(activations, str) and activations.lower() in ACTIVATIONS:
        return activations.lower()
    raise InvalidArgumentError(
        f"activations must be 'fp32' or 'int8', got {activations!r} (what the native kernels do with a "
        "quantized layer's input: 'fp32' keeps it, 'int8' rounds it per block of 32 as llama.cpp does)")


def check_quantize(quantize: Any) -> str | None:
    """``quantize=`` checked: None, ``"int8"``, ``"int4"`` or ``"auto"`` (``"none"`` means None).

    Example:
        >>> check_quantize("INT8"), check_quantize("none")
        ('int8', None)
    """
    if quantize is None:
        return None
    if isinstance(quantize, str) and quantize.lower() in ("none", "int8", "int4", "auto"):
        value = quantize.lower()
        return None if value == "none" else value
    raise InvalidArgumentError(
        f"quantize must be None, 'int8', 'int4' or 'auto', got {quantize!r} (quantization of the "
        "linear layers; None keeps the weights as loaded)"
    )


def kernel_dtype(mode: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer's input is cast to for the kernel: bf16 on the CPU (the kernels' fast path on
    x86); on CUDA the model's half dtype (int4's tinygemm takes bf16 only)."""
    if device.type == "cuda" and mode == "int8" and model_dtype in (torch.float16, torch.bfloat16):
        return model_dtype
    return torch.bfloat16


# -- the layers -------------------------------------------------------------------------------


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (one scale per output channel), computed in ``compute_dtype``.

    Example:
        >>> layer = Int8Linear.from_linear(torch.nn.Linear(64, 8), torch.bfloat16)
        >>> layer(torch.randn(2, 64)).shape
        torch.Size([2, 8])
    """

    weight_int8: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(n) for n in weight_int8.shape)
        self.compute_dtype = scales.dtype
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, compute_dtype: torch.dtype) -> Int8Linear:
        weight = linear.weight.detach().float()
        # The kernel takes scales in its compute dtype: round them first and quantize against the
        # rounded scale, so the rounding costs nothing beyond the int8 grid itself.
        scales = (weight.abs().amax(1) / 127.0).clamp_min(1e-12).to(compute_dtype)
        q = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q.contiguous(), scales.contiguous(), bias)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, in fp32 (tests, probes)."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compute={self.compute_dtype}"


def _int4_inner_k_tiles(in_features: int) -> int:
    # tinygemm (CUDA) packs K in tiles of 16 * innerKTiles; take the widest that divides K.
    return next((t for t in (8, 4, 2) if in_features % (16 * t) == 0), 2)


class Int4Linear(torch.nn.Module):
    """A linear layer with 4-bit weights in groups of ``group_size`` input channels (an offset and a
    scale per group: ``w = (q - 8) * scale + zero``), computed in bf16.

    Example:
        >>> layer = Int4Linear.from_linear(torch.nn.Linear(64, 16))
        >>> layer(torch.randn(2, 64)).shape
        torch.Size([2, 16])
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
        in_features: int, out_features: int, group_size: int,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.on_cpu = packed.device.type == "cpu"
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @staticmethod
    def quantize_weight(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, scales_and_zeros)``: q in 0..15 as int32 ``[N, K]``, and ``[K / group, N, 2]`` bf16."""
        n, k = weight.shape
        groups = weight.detach().float().reshape(n, k // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        # Round scale and offset to bf16 (what the kernel reads) before choosing q against them.
        scale = ((high - low) / 15.0).clamp_min(1e-12).to(torch.bfloat16)
        zero = (low + 8.0 * scale.float()).to(torch.bfloat16)
        q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8.0).clamp_(0, 15)
        scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        return q.reshape(n, k).to(torch.int32), scales_and_zeros

    @staticmethod
    def dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` that ``quantize_weight``'s output stands for."""
        n, k = q.shape
        scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K / group] each
        groups = (q.float().reshape(n, k // group_size, group_size) - 8.0) * scale[..., None] + zero[..., None]
        return groups.reshape(n, k)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int = INT4_GROUP_SIZE) -> Int4Linear:
        weight = linear.weight.detach()
        n, k = (int(d) for d in weight.shape)
        q, scales_and_zeros = cls.quantize_weight(weight, group_size)
        if weight.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        else:
            q8 = q.to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (q8[:, ::2] << 4 | q8[:, 1::2]).contiguous(), _int4_inner_k_tiles(k)
            )
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, scales_and_zeros.to(weight.device), bias, k, n, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if self.on_cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


# The layer kinds: ATen's kernels ("int8", "int4") and the native block kernels ("q8", "q4").
_BLOCK_KIND = {"int8": "q8", "int4": "q4"}
QUANTIZED_LAYERS = (Int8Linear, Int4Linear, Q8Linear, Q4Linear)


def _fits(kind: str, linear: torch.nn.Linear) -> bool:
    """Shapes the kernels take (others crash or raise inside ATen, so they are never given one)."""
    n, k = linear.out_features, linear.in_features
    if kind in ("q8", "q4"):
        return block_fits(linear)
    if kind == "int8":
        return k % 8 == 0
    return n % 16 == 0 and k % INT4_GROUP_SIZE == 0 and (linear.weight.device.type == "cpu" or k % 32 == 0)


def _make(kind: str, linear: torch.nn.Linear, compute_dtype: torch.dtype,
          activations: Activations = Activations.FP32) -> torch.nn.Module:
    if kind == "q8":
        return Q8Linear.from_linear(linear, activations)
    if kind == "q4":
        return Q4Linear.from_linear(linear, activations)
    if kind == "int8":
        return Int8Linear.from_linear(linear, compute_dtype)
    return Int4Linear.from_linear(linear)


def _kinds(mode: str, device: torch.device, block_kernels: bool = True) -> tuple[str, ...]:
    """The layer kinds that serve ``mode`` on ``device``, best first: the block kernels on a CPU
    where they built, then ATen's."""
    if block_kernels and device.type == "cpu" and native_kernels() is not None:
        return (_BLOCK_KIND[mode], mode)
    return (mode,)


def layer_state(layer: torch.nn.Module) -> dict[str, Any]:
    """What rebuilds a quantized layer without quantizing again (`layer_from_state`): its kind,
    packed buffers and shape; a quantized-weights cache stores these."""
    if isinstance(layer, Int8Linear):
        return {"kind": "int8", "weight_int8": layer.weight_int8, "scales": layer.scales, "bias": layer.bias}
    if isinstance(layer, (Q8Linear, Q4Linear)):
        return {"kind": "q8" if isinstance(layer, Q8Linear) else "q4", "weight_q": layer.weight_q,
                "scales": layer.scales, "bias": layer.bias, "in_features": layer.in_features, "dtype": layer.dtype}
    assert isinstance(layer, Int4Linear)
    return {"kind": "int4", "packed": layer.packed, "scales_and_zeros": layer.scales_and_zeros, "bias": layer.bias,
            "shape": (layer.in_features, layer.out_features, layer.group_size)}


def layer_from_state(state: dict[str, Any]) -> torch.nn.Module:
    """The layer `layer_state` describes."""
    if state["kind"] == "int8":
        return Int8Linear(state["weight_int8"], state["scales"], state["bias"])
    if state["kind"] in ("q8", "q4"):
        cls = Q8Linear if state["kind"] == "q8" else Q4Linear
        return cls(state["weight_q"], state["scales"], state["bias"], state["in_features"], state["dtype"])
    return Int4Linear(state["packed"], state["scales_and_zeros"], state["bias"], *state["shape"])


_PRECISION = {"q4": "int4", "int4": "int4", "q8": "int8", "int8": "int8"}  # layer kind -> mode it serves


def _state_shape(state: dict[str, Any]) -> tuple[int, int]:
    """``(in_features, out_features)`` of the layer a `layer_state` describes."""
    if state["kind"] == "int8":
        return int(state["weight_int8"].shape[1]), int(state["weight_int8"].shape[0])
    if state["kind"] == "int4":
        return int(state["shape"][0]), int(state["shape"][1])
    return int(state["in_features"]), int(state["weight_q"].shape[0])


# -- fused projections --------------------------------------------------------------------------

# Projections that read the same input: one kernel call (and one bf16 cast) for all of them.
FUSED_GROUPS = {"qkv_fused": ("q_proj", "k_proj", "v_proj"), "gate_up_fused": ("gate_proj", "up_proj")}


def _concat(layers: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One layer computing ``layers``' outputs side by side, from their quantized buffers, or None
    when they differ in kind, input or device."""
    first = layers[0]
    if not all(type(m) is type(first) and m.in_features == first.in_features for m in layers):
        return None
    if len({(m.bias is None) for m in layers}) != 1:
        return None
    bias = None if first.bias is None else torch.cat([m.bias for m in layers])
    if isinstance(first, Int8Linear):
        if len({m.compute_dtype for m in layers}) != 1:
            return None
        return Int8Linear(torch.cat([m.weight_int8 for m in layers]), torch.cat([m.scales for m in layers]), bias)
    if isinstance(first, (Q8Linear, Q4Linear)):
        if len({m.activations for m in layers}) != 1:
            return None
        return type(first)(torch.cat([m.weight_q for m in layers]), torch.cat([m.scales for m in layers]), bias,
                           first.in_features, first.dtype, first.activations)
    if isinstance(first, Int4Linear):
        packed = torch.cat([m.packed for m in layers])  # row blocks are independent (the probe checks it)
        scales = torch.cat([m.scales_and_zeros for m in layers], 1)
        return Int4Linear(packed, scales, bias, first.in_features, sum(m.out_features for m in layers),
                          first.group_size)
    return None


def _share(fused: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """Point each layer's buffers at its rows of the fused layer's (no second copy of the weights)."""
    start = 0
    for layer in layers:
        end = start + layer.out_features
        if isinstance(layer, Int8Linear):
            layer.weight_int8, layer.scales = fused.weight_int8[start:end], fused.scales[start:end]
        elif isinstance(layer, (Q8Linear, Q4Linear)):
            layer.weight_q, layer.scales = fused.weight_q[start:end], fused.scales[start:end]
        else:  # CUDA's tinygemm layout packs 8 output rows per leading index; the CPU's, one
            rows = 1 if layer.on_cpu else 8
            layer.packed = fused.packed[start // rows : end // rows]
        if layer.bias is not None:
            layer.bias = fused.bias[start:end]
        start = end


def fuse_projections(model: torch.nn.Module, *, cached: dict[str, dict[str, Any]] | None = None,
                     states: dict[str, dict[str, Any]] | None = None) -> int:
    """Give each attention (and MLP) with quantized q/k/v (gate/up) projections a ``qkv_fused``
    (``gate_up_fused``) layer that computes them in one call; the projections keep working (they
    read the fused layer's rows). Returns how many were fused. A fused layer whose output is not
    bit for bit its parts' is not kept. ``cached``: `layer_state` of fused layers by name from an
    earlier run on the same weights (rebuilt without concatenating or probing again); ``states``
    receives this run's.

    Example:
        >>> attn = torch.nn.Module()
        >>> for name, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        ...     setattr(attn, name, Int4Linear.from_linear(torch.nn.Linear(64, n)))
        >>> fuse_projections(attn), attn.qkv_fused.splits
        (1, [64, 32, 32])
    """
    fused_count = 0
    for module_name, module in list(model.named_modules()):
        for fused_name, names in FUSED_GROUPS.items():
            parts = [getattr(module, n, None) for n in names]
            if any(not isinstance(p, QUANTIZED_LAYERS) for p in parts) or hasattr(module, fused_name):
                continue
            path = f"{module_name}.{fused_name}".lstrip(".")
            fused = _cached_fused(cached, path, parts)
            if fused is None:
                fused = _probed_concat(parts)
            if fused is None:
                continue
            fused.splits = [p.out_features for p in parts]
            _share(fused, parts)
            setattr(module, fused_name, fused)
            if states is not None:  # the parts as views of the fused buffers: a cache stores them once
                states[path] = layer_state(fused)
                for n, part in zip(names, parts):
                    states[f"{module_name}.{n}".lstrip(".")] = layer_state(part)
            fused_count += 1
    return fused_count


def _cached_fused(cached: dict[str, dict[str, Any]] | None, path: str,
                  parts: list[torch.nn.Module]) -> torch.nn.Module | None:
    """The fused layer a quantized-weights cache holds for ``parts`` (None when it holds none that fits)."""
    state = (cached or {}).get(path)
    if state is None or _state_shape(state) != (parts[0].in_features, sum(p.out_features for p in parts)):
        return None
    fused = layer_from_state(state)
    if type(fused) is not type(parts[0]):
        return None
    if isinstance(fused, (Q4Linear, Q8Linear)):
        fused.activations = parts[0].activations
    return fused


def _probed_concat(parts: list[torch.nn.Module]) -> torch.nn.Module | None:
    """`_concat` of ``parts``, kept only when it computes their outputs bit for bit on a probe."""
    fused = _concat(parts)
    if fused is None:
        return None
    device = next(iter(parts[0].buffers())).device
    probe = torch.randn(2, parts[0].in_features, generator=torch.Generator().manual_seed(0)).to(device)
    try:
        with torch.no_grad():
            same = torch.equal(fused(probe), torch.cat([p(probe) for p in parts], -1))
    except Exception:  # noqa: BLE001 - a layout that does not concatenate: keep the parts
        same = False
    return fused if same else None


# -- probing the kernels ----------------------------------------------------------------------


def kernel_problem(kind: str, device: torch.device, model_dtype: torch.dtype = torch.float32) -> str | None:
    """Why the layers of ``kind`` (``"int8"``, ``"int4"``: ATen's kernels; ``"q8"``, ``"q4"``: the
    native block kernels) cannot run on ``device`` (None if they can): the kernel runs on a small
    probe layer and must match the dequantized weights.

    Example:
        >>> kernel_problem("int8", torch.device("cpu")) is None
        True
    """
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 64, generator=generator) * 0.05)
    linear = linear.to(device=device, dtype=model_dtype)
    x = torch.randn(3, 64, generator=generator).to(device=device, dtype=model_dtype)
    try:
        layer = _make(kind, linear, kernel_dtype(kind, device, model_dtype))
        with torch.no_grad():
            got = layer(x).float().cpu()
    except Exception as exc:  # noqa: BLE001 - a missing or broken kernel is a reason, not a crash
        message = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {message[0] if message else 'no message'}"
    if isinstance(layer, (Int8Linear, Q8Linear, Q4Linear)):
        weight = layer.dequantized().cpu()
    else:
        weight = Int4Linear.dequantize(*Int4Linear.quantize_weight(linear.weight.cpu()))
    # ATen's kernels round the input to bf16; the block kernels keep fp32.
    inputs = x.cpu().float() if isinstance(layer, (Q8Linear, Q4Linear)) else x.cpu().to(torch.bfloat16).float()
    reference = inputs @ weight.t()
    error = float((got - reference).abs().max())
    if not error <= 0.05 * float(reference.abs().max()) + 1e-3:
        return f"the kernel's result is off by {error:.3g} on a probe"
    return None


def block_kernels_serve(mode: str, device: torch.device) -> bool:
    """True if ``quantize=mode`` gets the native block kernels on ``device``: they built here and pass
    their check for the mode and for the LM head's 8 bits (the native decoder layers need them).

    Example:
        >>> block_kernels_serve("int4", torch.device("meta"))
        False
    """
    if device.type != "cpu" or native_kernels() is None:
        return False
    return all(kernel_problem(_BLOCK_KIND[m], device) is None for m in dict.fromkeys((mode, "int8")))


def mode_problem(mode: str, device: torch.device, model_dtype: torch.dtype = torch.float32,
                 block_kernels: bool = True) -> str | None:
    """Why no kernel serves ``mode`` on ``device`` (None if one does: the block kernels or ATen's).

    Example:
        >>> mode_problem("int4", torch.device("cpu")) is None
        True
    """
    reasons = []
    for kind in _kinds(mode, device, block_kernels):
        reason = kernel_problem(kind, device, model_dtype)
        if reason is None:
            return None
        reasons.append(reason)
    return "; ".join(reasons)


# -- the model --------------------------------------------------------------------------------


@dataclass
class QuantizationReport:
    """What `quantize_model` did: the mode applied (None: nothing), layers per kind, bytes of weights.

    Example:
        >>> report = quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 32)), None)
        >>> report.mode, report.layers
        (None, 0)
    """

    mode: str | None
    requested: str | None = None
    layers: int = 0  # linear layers quantized (the LM head included)
    by_kind: dict[str, int] = field(default_factory=dict)  # "int8"/"int4"/"kept" -> count
    bytes_before: int = 0
    bytes_after: int = 0
    fallback: str | None = None  # why the requested mode did not run, when it did not
    fused: int = 0  # groups of projections (q/k/v, gate/up) computed in one call
    # layers per kernel: "q4"/"q8" (the native block kernels, `kernels`), "int4"/"int8" (ATen's)
    kernels: dict[str, int] = field(default_factory=dict)
    native_layers: int = 0  # decoder layers computed in C (`native_layers`)
    activations: str = "fp32"  # what the block kernels do with a layer's input: "fp32" or "int8"
    # `layer_state` of each quantized layer by name (what a quantized-weights cache stores)
    states: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        if self.mode is None:
            return "weights as loaded (no quantization)"
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.by_kind.items()))
        block = sum(n for kind, n in self.kernels.items() if kind in ("q4", "q8"))
        how = (f"block kernels, {self.activations} activations" if block == self.layers else
               "ATen kernels, bf16 activations" if not block else f"{block} on block kernels, the rest on ATen's")
        return (f"{self.mode}: {kinds} linear layers ({how}), weights {self.bytes_before / 2**20:.0f} MiB -> "
                f"{self.bytes_after / 2**20:.0f} MiB")


def _linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            # Layers under accelerate's hooks (device_map offloading) keep their own forward.
            if (type(child) is torch.nn.Linear and child.weight.device.type in ("cpu", "cuda")
                    and child.weight.is_floating_point() and not hasattr(child, "_hf_hook")):
                found.append((parent, name, child))
    return found


def _size(module: torch.nn.Module) -> int:
    """Bytes of the module's tensors, each storage once (fused layers and their parts share theirs)."""
    storages = {}
    for t in list(module.parameters()) + list(module.buffers()):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _untie_head(model: torch.nn.Module) -> None:
    """Give a tied LM head its own weight (the embedding keeps the original matrix)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    embedding = get_in() if callable(get_in) else None
    if isinstance(head, torch.nn.Linear) and embedding is not None and head.weight is getattr(embedding, "weight", None):
        head.weight = torch.nn.Parameter(head.weight.detach(), requires_grad=False)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False  # so a later tie_weights() does not undo it


def exact_block_states(model: torch.nn.Module) -> dict[str, dict[str, Any]] | None:
    """`layer_state` of each linear layer as a native block layer when every weight of the model is
    a GGUF block value already: Q4_1 for each layer (Q8_0 where Q4_1 does not hold it), Q8_0 for the
    LM head, as a model converted from a GGUF file holds them. Those layers multiply by the model's
    own weights, so ``quantize_model(model, "int4", cached=states)`` changes nothing but the speed.
    None as soon as one weight is not (most models: the first layer already says so). CPU, fp32.

    Example:
        >>> exact_block_states(torch.nn.Sequential(torch.nn.Linear(64, 32))) is None
        True
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    states: dict[str, dict[str, Any]] = {}
    names = {id(module): name for name, module in model.named_modules()}
    with torch.no_grad():
        for parent, name, linear in _linears(model):
            weight = linear.weight.detach()
            if weight.dtype != torch.float32 or not block_fits(linear):
                return None
            for cls in ((Q8Linear,) if linear is head else (Q4Linear, Q8Linear)):
                packed, scales = cls.quantize_weight(weight)
                if torch.equal(cls.dequantize(packed, scales), weight):
                    layer = cls(packed, scales, None if linear.bias is None else linear.bias.detach().float(),
                                linear.in_features, torch.float32)
                    states[f"{names[id(parent)]}.{name}".lstrip(".")] = layer_state(layer)
                    break
            else:
                return None
    return states or None


def quantize_model(
    model: torch.nn.Module, mode: str | None, *, on_fallback: Callable[[str], None] | None = None,
    cached: dict[str, dict[str, Any]] | None = None, block_kernels: bool = True, activations: str = "fp32",
) -> QuantizationReport:
    """Replace the model's linear layers (in place) by `Int8Linear`/`Int4Linear` layers.

    ``mode`` is None (nothing happens), ``"int8"`` or ``"int4"`` (resolve ``"auto"`` first). A
    transformers model then attends row by row (`multistream.text._accel.row_attention`). A mode
    whose kernel does not work on the model's device raises `InvalidArgumentError`; layers whose
    shape the int4 kernel cannot take get int8 (or stay as they are), counted in ``by_kind``.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        >>> quantize_model(net, "int4").by_kind
        {'int4': 2}

    ``cached``: `layer_state` per layer name, from an earlier run on the same weights, device and
    torch (``report.states`` holds this run's): those layers are rebuilt, not quantized again.
    ``block_kernels=False`` keeps to ATen's kernels on a CPU too (`Int8Linear`, `Int4Linear`).
    ``activations``: ``"fp32"`` (the block kernels compute the fp32 product of the quantized
    weights) or ``"int8"`` (llama.cpp's int8 rounding of the input per block; see
    `check_activations`).
    """
    acts = Activations[check_activations(activations).upper()]
    report = QuantizationReport(mode=None, requested=mode, activations=acts.name.lower())
    if mode is None:
        return report
    if mode not in ("int8", "int4"):
        raise InvalidArgumentError(f"quantize_model takes None, 'int8' or 'int4', got {mode!r}")
    before = _size(model)
    _untie_head(model)
    linears = _linears(model)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    problems: dict[tuple[str, str, torch.dtype], str | None] = {}

    def problem(kind: str, linear: torch.nn.Linear) -> str | None:
        key = (kind, str(linear.weight.device), linear.weight.dtype)
        if key not in problems:
            problems[key] = kernel_problem(kind, linear.weight.device, linear.weight.dtype)
        return problems[key]

    def layer_kind(precision: str, linear: torch.nn.Linear) -> str | None:
        """The best layer kind for ``precision`` that takes this layer and works on its device."""
        return next((k for k in _kinds(precision, linear.weight.device, block_kernels)
                     if _fits(k, linear) and problem(k, linear) is None), None)

    def cached_state(path: str, linear: torch.nn.Linear) -> tuple[str, str, dict[str, Any]] | None:
        """The cached layer for ``path`` when it is one this load would choose: a cache is written
        by this function on the same weights, kernels and torch, so its kinds are the choices a fresh
        pass makes, and trusting them skips scanning every weight (``_fits``) at each warm load."""
        state = (cached or {}).get(path)
        precision = _PRECISION.get(state.get("kind", "")) if state is not None else None
        if state is None or precision is None or (linear is head and precision != "int8"):
            return None
        if precision not in (mode, "int8") or _state_shape(state) != (linear.in_features, linear.out_features):
            return None
        # The kind a fresh pass would pick first (the block kernels where they run): a file written
        # where they did not (ATen's layers) is not taken for one where they do.
        best = next((k for k in _kinds(precision, linear.weight.device, block_kernels) if problem(k, linear) is None),
                    None)
        return (precision, best, state) if state["kind"] == best else None

    for _, _, linear in linears[:1]:
        reason = problem(mode, linear)
        if reason is not None and layer_kind(mode, linear) is None:
            raise InvalidArgumentError(
                f"quantize={mode!r} cannot run on {linear.weight.device.type} here ({reason}); use "
                f"quantize={'int8' if mode == 'int4' else None!r} or quantize=None"
            )
    names = {id(module): name for name, module in model.named_modules()}
    with torch.no_grad():
        for parent, name, linear in linears:
            path = f"{names[id(parent)]}.{name}".lstrip(".")
            hit = cached_state(path, linear)
            if hit is not None:
                precision, kind, state = hit
                replacement = layer_from_state(state)
                if isinstance(replacement, (Q4Linear, Q8Linear)):
                    replacement.activations = acts
                report.states[path] = state
                setattr(parent, name, replacement)
                report.by_kind[precision] = report.by_kind.get(precision, 0) + 1
                report.kernels[kind] = report.kernels.get(kind, 0) + 1
                report.layers += 1
                continue
            # The LM head stays int8 in int4 mode: GGUF files keep it at 6-8 bits too, and int4
            # (groups of 32) flips the embedded model's greedy choice from the first tokens.
            precisions = ("int8",) if linear is head else dict.fromkeys((mode, "int8"))
            found = next(((p, k) for p in precisions if (k := layer_kind(p, linear)) is not None), None)
            if found is None:
                report.by_kind["kept"] = report.by_kind.get("kept", 0) + 1
                continue
            precision, kind = found
            state = (cached or {}).get(path)
            if state is not None and state.get("kind") == kind:
                replacement = layer_from_state(state)
                if isinstance(replacement, (Q4Linear, Q8Linear)):
                    replacement.activations = acts
            else:
                replacement = _make(kind, linear, kernel_dtype(kind, linear.weight.device, linear.weight.dtype), acts)
            report.states[path] = layer_state(replacement)
            setattr(parent, name, replacement)
            report.by_kind[precision] = report.by_kind.get(precision, 0) + 1
            report.kernels[kind] = report.kernels.get(kind, 0) + 1
            report.layers += 1
    report.mode = mode if report.layers else None
    report.fused = fuse_projections(model, cached=cached, states=report.states)
    report.native_layers = attach_native_layers(model)
    if report.mode is not None:
        # Quantized layers round their input to bf16, which makes padding's last-bit noise visible:
        # attend row by row so a stream in a batch still equals its output alone (_row_attention).
        use_row_attention(model)
    report.bytes_before, report.bytes_after = before, _size(model)
    return report
