"""Linear layers with GGUF's block-quantized weights, on the native CPU kernels (`kernels`).

`Q4Linear` holds Q4_1 weights (blocks of 32 input channels, a scale and a minimum each, in fp16:
``w = q * scale + minimum`` with q in 0..15); `Q8Linear` holds Q8_0 weights (``w = q * scale``,
q in -127..127, an fp16 scale). Their input stays fp32: each block is dequantized in registers and
multiplied with FMA, so a layer computes the fp32 product of its 4- or 8-bit weights (to float
rounding), several times faster than ATen's bf16 int4 kernel on a CPU without AMX.
``activations=Activations.INT8`` rounds the input to int8 per block of 32 instead and sums in
int32, as llama.cpp does (an opt-in: `load_text_model(activations="int8")`).

The embedded model's GGUF file stores its layers as Q4_1 and its embedding (the tied LM head) as
Q8_0, so these formats hold its weights exactly: the minimum and maximum of each block of the
dequantized weights give back the file's scale and minimum.

Example:
    >>> import torch
    >>> layer = Q4Linear.from_linear(torch.nn.Linear(64, 16))   # doctest: +SKIP
    >>> layer(torch.randn(2, 64)).shape                         # doctest: +SKIP
    torch.Size([2, 16])
"""

from __future__ import annotations

import torch

from .kernels import BLOCK, Activations, QuantizedMatrix, matmul

__all__ = ["Q4Linear", "Q8Linear", "block_fits", "buffers_generation"]

_BUFFERS = ("weight_q", "scales", "bias")
_generation = [0]  # bumped whenever a block layer's buffers may have been replaced or cast


def buffers_generation() -> int:
    """A number that changes whenever any block layer's buffers were assigned, moved or cast
    (``model.to(...)``, ``.half()``, a direct assignment): what lets a native decoder layer skip
    re-checking its weights at every step."""
    return _generation[0]


def block_fits(linear: torch.nn.Linear) -> bool:
    """Whether the block kernels take this layer: a CPU layer whose inputs come in whole blocks, with
    weights whose scales fit fp16."""
    if linear.weight.device.type != "cpu" or linear.in_features % BLOCK != 0:
        return False
    low, high = torch.aminmax(linear.weight.detach())  # one pass, no |w| copy (NaN fails both tests)
    return bool(high < 30000) and bool(low > -30000)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` as fp32 ``[N, K / 32, 32]``."""
    n, k = weight.shape
    return weight.detach().float().reshape(n, k // BLOCK, BLOCK)


def _divisor(scale: torch.Tensor) -> torch.Tensor:
    """The fp16 scales as fp32 divisors ``[..., 1]`` (1 for an all-zero block, whose q is then 0)."""
    scale = scale.float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().float().contiguous()


class _BlockLinear(torch.nn.Module):
    kind = 0
    weight_q: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 dtype: torch.dtype = torch.float32, activations: Activations = Activations.FP32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, int(weight_q.shape[0])
        self.dtype = dtype  # the model's dtype: the output is cast back to it
        self.activations = Activations(activations)
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    def __setattr__(self, name: str, value: object) -> None:
        if name in _BUFFERS:
            _generation[0] += 1
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # .to(), .half(), .cuda()
        _generation[0] += 1
        return super()._apply(fn, recurse)

    @staticmethod
    def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def dequantize(weight_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, activations: Activations = Activations.FP32) -> _BlockLinear:
        """The layer quantized from ``linear`` (its bias kept in fp32)."""
        weight_q, scales = cls.quantize_weight(linear.weight)
        return cls(weight_q, scales, _bias(linear), linear.in_features, linear.weight.dtype, activations)

    def matrix(self) -> QuantizedMatrix:
        """What the kernels read: this layer's current buffers (validated when used)."""
        return QuantizedMatrix(self.kind, self.weight_q, self.scales, self.bias, self.activations)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this layer multiplies by (tests, probes)."""
        return self.dequantize(self.weight_q, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.matrix())
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activations={self.activations.name.lower()}")


class Q4Linear(_BlockLinear):
    """A linear layer with Q4_1 weights, on the native block kernels.

    Example:
        >>> layer = Q4Linear.from_linear(torch.nn.Linear(64, 16))   # doctest: +SKIP
        >>> layer(torch.randn(2, 64)).shape                         # doctest: +SKIP
        torch.Size([2, 16])
    """

    kind = 4

    @staticmethod
    def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, scales)``: uint8 ``[N, K/2]`` (byte j of a block: value j in the low nibble, value
        j + 16 in the high one, GGUF's order) and fp16 ``[N, K/32, 2]`` (scale, minimum)."""
        n, k = weight.shape
        blocks = _blocks(weight)
        # Scale and minimum are rounded to fp16 (what the kernel reads) before q is chosen against them.
        low = blocks.amin(-1).half()
        scale = ((blocks.amax(-1) - low.float()) / 15.0).half()
        q = torch.round((blocks - low.float()[..., None]) / _divisor(scale)).clamp_(0, 15).to(torch.uint8)
        packed = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).reshape(n, k // 2).contiguous()
        return packed, torch.stack([scale, low], -1).contiguous()

    @staticmethod
    def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` that `quantize_weight`'s output stands for."""
        n = packed.shape[0]
        nibbles = packed.reshape(n, -1, BLOCK // 2)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], -1).float()
        scales = scales.float()
        return (q * scales[..., :1] + scales[..., 1:]).reshape(n, -1)



class Q8Linear(_BlockLinear):
    """A linear layer with Q8_0 weights, on the native block kernels.

    Example:
        >>> layer = Q8Linear.from_linear(torch.nn.Linear(64, 16))   # doctest: +SKIP
        >>> layer(torch.randn(2, 64)).shape                         # doctest: +SKIP
        torch.Size([2, 16])
    """

    kind = 8

    @staticmethod
    def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, scales)``: int8 ``[N, K]`` in -127..127 and fp16 ``[N, K/32]``."""
        n, k = weight.shape
        scale = (_blocks(weight).abs().amax(-1) / 127.0).half()
        q = torch.round(_blocks(weight) / _divisor(scale)).clamp_(-127, 127).to(torch.int8)
        return q.reshape(n, k).contiguous(), scale.contiguous()

    @staticmethod
    def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        return (q.float().reshape(n, k // BLOCK, BLOCK) * scales.float()[..., None]).reshape(n, k)

