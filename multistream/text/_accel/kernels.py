"""The native CPU kernels (``kernels.c``): built with the system's C compiler at first use, called
through one validating wrapper each.

``kernels.c`` holds block-quantized matrix products for GGUF's Q4_1 and Q8_0 weights (blocks of 32
input channels, fp16 scales) and the Llama decoder layer built on them. Activations are fp32: each
weight block is dequantized in registers and multiplied with FMA, so a product is the fp32 product
with the same 4- or 8-bit weights to float rounding (``Activations.FP32``, the default).
``Activations.INT8`` is llama.cpp's arithmetic instead (activations rounded to int8 per block,
products summed in int32), an opt-in (`multistream.text._accel.block_layers`).

Every token is computed by the same code in the same order whether it is decoded alone, in a batch,
or prefilled with others, on any number of threads (the C file's header says how): that is what
lets a re-prefill after an edit, a failover or ``llm.score`` land on the logits the stream had.

Building: once per machine and source with ``cc -O3 -march=native -pthread -ffp-contract=off``
(``$CC`` if set; about a second), into ``<cache_dir>/kernels`` when that folder belongs to this
user and nobody else can write to it, else into a private temporary folder (loading a library from
a path others can write is running their code). Loaded with ctypes; no torch headers are needed.

Threads: each call uses ``torch.get_num_threads()`` threads of the C file's own team (pthreads),
not OpenMP: libgomp stops spinning at its barriers once a process has more OpenMP threads than
CPUs (torch's pool on the loading thread plus the engine thread's are already more than two CPUs
have), and a decode step's barriers then each cost a sleep and a wake-up (2 threads ran slower
than one). The team spins at its barriers, and its idle workers wait up to 3 ms for the next call
(yielding the CPU to any other runnable thread) before they sleep. When another busy process
shares the cores, a teammate is preempted for whole scheduler time slices and every barrier waits
for it (one ``while True`` process beside a 2-thread decode on 2 cores cut it to a third); so a
call whose barriers stall sends the next calls to the caller's thread alone, a spell that grows
while the stalls go on and shrinks once they stop (`NativeKernels.contention` counts both; the
values do not depend on the thread count). So the library loads no
OpenMP runtime of its own (`openmp_runtimes` lists what is mapped: torch's only). Without a
compiler, or if the build fails, `native_kernels()` is None, `native_problem()` says why, and
quantized layers use ATen's kernels.

Example:
    >>> kernels = native_kernels()
    >>> kernels is None or kernels.isa in ("avx512", "avx2", "portable C")
    True
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..._cache import cache_dir

__all__ = [
    "BLOCK",
    "SOURCE",
    "Activations",
    "KVBuffers",
    "LayerWeights",
    "NativeKernels",
    "QuantizedMatrix",
    "Tokens",
    "check_buffers",
    "layer_qkv",
    "layer_rest",
    "matmul",
    "native_kernels",
    "native_problem",
    "openmp_runtimes",
    "rms_norm",
]

logger = logging.getLogger("multistream")

BLOCK = 32  # values per quantization block, as in GGUF's Q4_1, Q8_0 and Q8_1
SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: the compiler may not fuse a multiply and an add in one copy of the arithmetic
# and not in another (the C file's "one arithmetic").
_FLAG_SETS = (["-O3", "-march=native", "-pthread", "-ffp-contract=off"], ["-O3", "-pthread", "-ffp-contract=off"],
              ["-O3", "-ffp-contract=off"])


class Activations(enum.IntEnum):
    """How a block-quantized product treats its input: fp32 (the default: the fp32 product of the
    same weights) or int8 per block of 32 (llama.cpp's arithmetic, an opt-in)."""

    FP32 = 0
    INT8 = 1


# -- the C structures -------------------------------------------------------------------------


class _QMat(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("kind", ctypes.c_int32), ("acts", ctypes.c_int32)]


class _KV(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("ks", ctypes.c_int64 * 3),
                ("vs", ctypes.c_int64 * 3)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1_w", ctypes.c_void_p), ("norm2_w", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("qkv", _QMat), ("o", _QMat), ("gate_up", _QMat), ("down", _QMat),
                ("kv", _KV)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("scaling", ctypes.c_float)]


class _Tokens(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("kv_row", ctypes.c_void_p), ("first", ctypes.c_void_p), ("column", ctypes.c_void_p)]


class _Points(ctypes.Structure):
    _fields_ = [("pending", ctypes.c_void_p), ("stop_before", ctypes.c_void_p)]


@dataclass(frozen=True)
class NativeKernels:
    """The loaded kernels (``cdll``): ``isa`` is what they were built for (``"avx512"``, ``"avx2"``
    or ``"portable C"``)."""

    cdll: ctypes.CDLL
    path: Path
    isa: str

    def row_group(self) -> int:
        """How many activation rows share one pass over a weight matrix (12 with AVX2, 8 with
        AVX-512, 1 in portable C): a step's positions past a multiple of it cost another pass."""
        return int(self.cdll.ms_row_group())

    def contention(self) -> tuple[int, int]:
        """(calls whose barriers stalled on a preempted teammate, calls run on the caller alone
        because of it) so far in this process: see "Threads" in the module docstring."""
        out = (ctypes.c_int64 * 2)()
        self.cdll.ms_team_contention(out)
        return int(out[0]), int(out[1])


# -- building and loading ---------------------------------------------------------------------

_lock = threading.Lock()
_loaded: NativeKernels | None = None
_problem: str | None = None
_tried = False


def _cpu_key() -> str:
    """What a build depends on besides the source: the machine, its CPU flags, the compiler."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{flags}|{os.environ.get('CC', 'cc')}|{_FLAG_SETS[0]}"


def _private(folder: Path) -> bool:
    """Whether ``folder`` (and every folder above it up to one owned by root or this user) is this
    user's and not writable by others: only then is a library in it ours to load."""
    try:
        info = folder.stat()
    except OSError:
        return False
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return info.st_uid == uid and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and stat.S_ISDIR(info.st_mode)


def _kernel_folder() -> Path:
    """``<cache_dir>/kernels`` if it is private to this user (made so when new), else a private
    temporary folder (a build per process: slower, never someone else's code)."""
    folder = cache_dir() / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass
    if _private(folder):
        return folder
    logger.warning("%s is not private to this user (owner or permissions); building the CPU kernels in a private "
                   "temporary folder instead", folder)
    return Path(tempfile.mkdtemp(prefix="multistream-kernels-"))


def _build(target: Path) -> str | None:
    """Compile the source into ``target`` (atomically: concurrent processes may build it too);
    None on success, else the compiler's complaint."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    complaint = "the build failed"
    for flags in _FLAG_SETS:
        fd, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, "-fPIC", "-shared", str(SOURCE), "-o", staging, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.chmod(staging, 0o700)
                os.replace(staging, target)
                return None
            complaint = (done.stderr.strip().splitlines() or ["no message"])[-1]
        except (OSError, subprocess.SubprocessError) as exc:
            complaint = f"{type(exc).__name__}: {exc}"
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    return f"{compiler} could not build {SOURCE.name}: {complaint}"


def _declare(cdll: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.POINTER, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    vp = ctypes.c_void_p
    cdll.ms_matmul.argtypes = [vp, i64, p(_QMat), vp, i32]
    cdll.ms_layer_qkv.argtypes = [p(_Layer), p(_Shape), p(_Tokens), vp, vp, vp, vp, i32]
    cdll.ms_layer_rest.argtypes = [p(_Layer), p(_Shape), p(_Tokens), vp, vp, p(_KV), vp, i32]
    cdll.ms_layers_forward.argtypes = [vp, i64, p(_Shape), p(_Tokens), vp, i32, p(_Points),
                                       ctypes.POINTER(ctypes.c_int64)]
    cdll.ms_rms_norm.argtypes = [vp, i64, i64, vp, f32, vp]
    for name in ("ms_matmul", "ms_layer_qkv", "ms_layer_rest", "ms_layers_forward", "ms_rms_norm"):
        getattr(cdll, name).restype = ctypes.c_int
    cdll.ms_kernel_isa.restype = ctypes.c_char_p
    cdll.ms_team_contention.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    cdll.ms_team_contention.restype = None
    cdll.ms_row_group.restype = ctypes.c_int


def _load() -> tuple[NativeKernels | None, str | None]:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + _cpu_key().encode()).hexdigest()[:16]
    target = _kernel_folder() / f"kernels-{key}.so"
    if target.is_file() and not _private_file(target):
        target.unlink()  # someone else's file in our folder: never load it
    if not target.is_file():
        problem = _build(target)
        if problem is not None:
            return None, problem
    try:
        cdll = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"could not load {target}: {exc}"
    _declare(cdll)
    return NativeKernels(cdll, target, cdll.ms_kernel_isa().decode()), None


def _private_file(path: Path) -> bool:
    info = path.stat()
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return info.st_uid == uid and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime libraries mapped into this process (one, torch's, when all is well)."""
    try:
        maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    except OSError:
        return []
    names = {line.split()[-1] for line in maps.splitlines() if line.split()[-1:]}
    return sorted(n for n in names if os.path.basename(n).startswith(("libgomp", "libiomp", "libomp")))


def native_kernels() -> NativeKernels | None:
    """The kernels, built and loaded at the first call (None if they cannot be: see `native_problem`)."""
    global _loaded, _problem, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded, _problem = _load()
            except OSError as exc:  # an unwritable cache folder, a missing source file
                _loaded, _problem = None, f"{type(exc).__name__}: {exc}"
            if _problem is not None:
                logger.warning("the block-quantized CPU kernels are unavailable (%s); quantized layers use ATen's "
                               "kernels", _problem)
        return _loaded


def native_problem() -> str | None:
    """Why `native_kernels()` is None (None once they loaded)."""
    native_kernels()
    return _problem


def _cdll() -> ctypes.CDLL:
    kernels = native_kernels()
    if kernels is None:
        raise RuntimeError(f"the block-quantized kernels are unavailable: {_problem}")
    return kernels.cdll


# -- what the kernels read --------------------------------------------------------------------


def check_buffers(weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Raise if a block-quantized layer's buffers are not what the kernels read (``model.half()`` or
    ``.to(torch.bfloat16)`` after quantizing casts the fp16 scales and the fp32 bias; ``.to("cuda")``
    moves them where the kernels cannot go)."""
    bad_bias = bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"
                                     or not bias.is_contiguous())
    if scales.dtype != torch.float16 or weight.dtype not in (torch.uint8, torch.int8) or bad_bias \
            or weight.device.type != "cpu" or not (weight.is_contiguous() and scales.is_contiguous()):
        raise RuntimeError(
            f"a block-quantized layer's buffers were changed after quantizing (scales {scales.dtype} on "
            f"{scales.device.type}{'' if bias is None else f', bias {bias.dtype}'}; the kernels read fp16 scales "
            "and an fp32 bias on the CPU): change the model's dtype or device before load_text_model(quantize=...) "
            "quantizes it, or load it with quantize=None")


@dataclass(frozen=True)
class QuantizedMatrix:
    """A block-quantized weight as the kernels read it: ``kind`` 4 (Q4_1: ``weight`` uint8
    ``[n, k/2]``, ``scales`` fp16 ``[n, k/32, 2]``) or 8 (Q8_0: int8 ``[n, k]``, fp16 ``[n, k/32]``),
    an optional fp32 ``bias`` ``[n]`` and the activations' treatment.

    Example:
        >>> from multistream.text._accel.block_layers import Q4Linear
        >>> w, s = Q4Linear.quantize_weight(torch.randn(16, 64))
        >>> matmul(torch.randn(2, 64), QuantizedMatrix(4, w, s)).shape  # doctest: +SKIP
        torch.Size([2, 16])
    """

    kind: int
    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None
    activations: Activations = Activations.FP32

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1]) * (2 if self.kind == 4 else 1)

    def struct(self) -> _QMat:
        """The C description, checked (the tensors must stay alive while it is used)."""
        if self.kind not in (4, 8):
            raise ValueError(f"kind must be 4 (Q4_1) or 8 (Q8_0), got {self.kind}")
        check_buffers(self.weight, self.scales, self.bias)
        n, k = self.out_features, self.in_features
        if k % BLOCK:
            raise RuntimeError(f"in_features {k} must be a multiple of {BLOCK} for the block kernels")
        blocks = k // BLOCK
        expected = (n, blocks, 2) if self.kind == 4 else (n, blocks)
        if tuple(self.scales.shape) != expected or (self.bias is not None and tuple(self.bias.shape) != (n,)):
            raise RuntimeError(f"a Q{self.kind} matrix [{n}, {k}] needs scales {expected} and a bias ({n},), got "
                               f"{tuple(self.scales.shape)}")
        bias = None if self.bias is None else self.bias.data_ptr()
        return _QMat(self.weight.data_ptr(), self.scales.data_ptr(), bias, n, k, self.kind, int(self.activations))


def _check_status(status: int, what: str) -> None:
    if status == -2:
        raise MemoryError(f"{what}: the native kernels could not allocate their scratch memory")
    if status != 0:
        raise RuntimeError(f"{what} failed (status {status}: a shape or argument the native kernels do not take)")


def _fp32_rows(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    if x.device.type != "cpu" or x.shape[-1] != width:
        raise RuntimeError(f"{what} takes CPU rows of width {width}, got {tuple(x.shape)} on {x.device.type}")
    flat = x.reshape(-1, width)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    return flat


def matmul(x: torch.Tensor, matrix: QuantizedMatrix, threads: int | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a block-quantized ``W``: ``x`` ``[..., k]`` (any float dtype, read as
    fp32) -> fp32 ``[..., n]``. Each row is computed as if alone."""
    qmat = matrix.struct()
    flat = _fp32_rows(x, matrix.in_features, "a block-quantized matmul")
    out = torch.empty(flat.shape[0], matrix.out_features, dtype=torch.float32)
    status = _cdll().ms_matmul(flat.data_ptr(), flat.shape[0], ctypes.byref(qmat), out.data_ptr(),
                               threads or torch.get_num_threads())
    _check_status(status, "a block-quantized matmul")
    return out.reshape(*x.shape[:-1], matrix.out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of the rows of ``x`` (fp32, CPU) in the kernels' arithmetic: the model's final
    norm goes through here on every path, so decode and prefill agree on it too."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 1:
        raise RuntimeError("a native RMS norm needs an fp32 CPU weight vector (was the model cast after quantizing?)")
    width = int(weight.shape[0])
    flat = _fp32_rows(x, width, "a native RMS norm")
    out = torch.empty_like(flat)
    weight = weight.contiguous()
    _check_status(_cdll().ms_rms_norm(flat.data_ptr(), flat.shape[0], width, weight.data_ptr(), float(eps),
                                      out.data_ptr()), "a native RMS norm")
    return out.reshape(x.shape)


# -- decoder layers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    """The sizes of a Llama decoder layer."""

    hidden: int
    heads: int
    kv_heads: int
    dim: int
    intermediate: int
    scaling: float

    def struct(self) -> _Shape:
        return _Shape(self.hidden, self.heads, self.kv_heads, self.dim, self.intermediate, self.scaling)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights: its two RMS norms and four block-quantized projections (fused
    q/k/v, output, fused gate/up, down)."""

    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    qkv: QuantizedMatrix
    o: QuantizedMatrix
    gate_up: QuantizedMatrix
    down: QuantizedMatrix

    def struct(self, shape: LayerShape, kv: _KV | None = None) -> _Layer:
        """The C description, checked against ``shape``."""
        for norm in (self.norm1, self.norm2):
            if norm.dtype != torch.float32 or norm.device.type != "cpu" or not norm.is_contiguous() \
                    or tuple(norm.shape) != (shape.hidden,):
                raise RuntimeError("a native decoder layer's norm weights were cast or moved after quantizing (they "
                                   "must stay fp32 on the CPU): quantize the model after changing its dtype or device")
        width = (shape.heads + 2 * shape.kv_heads) * shape.dim
        sizes = {"qkv": (self.qkv, width, shape.hidden), "o": (self.o, shape.hidden, shape.heads * shape.dim),
                 "gate_up": (self.gate_up, 2 * shape.intermediate, shape.hidden),
                 "down": (self.down, shape.hidden, shape.intermediate)}
        for name, (matrix, n, k) in sizes.items():
            if (matrix.out_features, matrix.in_features) != (n, k):
                raise RuntimeError(f"a native decoder layer's {name} projection is {matrix.out_features}x"
                                   f"{matrix.in_features}, its shape needs {n}x{k}")
        return _Layer(self.norm1.data_ptr(), self.norm2.data_ptr(), self.eps1, self.eps2, self.qkv.struct(),
                      self.o.struct(), self.gate_up.struct(), self.down.struct(), kv or _KV())


@dataclass(frozen=True)
class KVBuffers:
    """Keys and values ``[rows, kv_heads, columns, dim]`` (fp32, CPU, ``dim`` contiguous)."""

    keys: torch.Tensor
    values: torch.Tensor

    def struct(self, shape: LayerShape, tokens: Tokens) -> _KV:
        """Checked against the rows and columns ``tokens`` read and write."""
        for buf in (self.keys, self.values):
            if buf.dtype != torch.float32 or buf.device.type != "cpu" or buf.dim() != 4 or buf.stride(3) != 1 \
                    or buf.shape[1] != shape.kv_heads or buf.shape[3] != shape.dim:
                raise RuntimeError(f"native attention needs fp32 CPU keys/values [rows, {shape.kv_heads}, columns, "
                                   f"{shape.dim}], got {buf.dtype} {tuple(buf.shape)}")
        rows, columns = self.keys.shape[0], min(self.keys.shape[2], self.values.shape[2])
        if tokens.count and (tokens.max_row >= min(rows, self.values.shape[0]) or tokens.max_column >= columns):
            raise RuntimeError(f"tokens read row {tokens.max_row}, column {tokens.max_column} of KV buffers "
                               f"{tuple(self.keys.shape)}")
        return _KV(self.keys.data_ptr(), self.values.data_ptr(), (ctypes.c_int64 * 3)(*self.keys.stride()[:3]),
                   (ctypes.c_int64 * 3)(*self.values.stride()[:3]))


class Tokens:
    """The tokens of one call: each one's rotary embedding (``cos``/``sin`` ``[count, dim]``), its
    row of the KV buffers, the first column it attends to and its own column (it attends up to it).

    Example:
        >>> t = Tokens.of_rows(torch.ones(2, 8), torch.zeros(2, 8), rows=2, tokens=1, past=5, starts=[0, 3])
        >>> t.column.tolist(), t.first.tolist()
        ([5, 5], [0, 3])
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, kv_row: torch.Tensor, first: torch.Tensor,
                 column: torch.Tensor) -> None:
        count = int(kv_row.shape[0])
        self.cos = cos.reshape(count, -1).to(torch.float32).contiguous()
        self.sin = sin.reshape(count, -1).to(torch.float32).contiguous()
        self.kv_row, self.first, self.column = (t.to(torch.int64).contiguous() for t in (kv_row, first, column))
        if not all(t.shape == (count,) for t in (self.first, self.column)) or self.sin.shape != self.cos.shape:
            raise RuntimeError("each token needs one kv row, first column, column and rotary row")
        self.count = count
        self.max_row = int(self.kv_row.max()) if count else 0
        self.max_column = int(self.column.max()) if count else 0
        if count and min(int(self.kv_row.min()), int(self.first.min()), int(self.column.min())) < 0:
            raise RuntimeError("token rows and columns must not be negative")

    @classmethod
    def of_rows(cls, cos: torch.Tensor, sin: torch.Tensor, *, rows: int, tokens: int, past: int,
                starts: list[int] | None) -> Tokens:
        """``tokens`` new tokens on each of ``rows`` rows whose caches hold ``past`` columns; row ``r``
        attends from column ``starts[r]`` (its left padding ends there; None: 0)."""
        kv_row = torch.arange(rows).repeat_interleave(tokens)
        column = (torch.arange(tokens) + past).repeat(rows)
        first = torch.tensor(starts if starts is not None else [0] * rows).repeat_interleave(tokens)
        return cls(cos, sin, kv_row, first, column)

    def struct(self, dim: int) -> _Tokens:
        if self.cos.shape != (self.count, dim):
            raise RuntimeError(f"each token needs a rotary row of {dim} values, got {tuple(self.cos.shape)}")
        return _Tokens(self.count, self.cos.data_ptr(), self.sin.data_ptr(), self.kv_row.data_ptr(),
                       self.first.data_ptr(), self.column.data_ptr())


def layer_qkv(weights: LayerWeights, shape: LayerShape, tokens: Tokens, x: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of a layer for ``x`` ``[count, hidden]``: q ``[count, heads, dim]``, k and v
    ``[count, kv_heads, dim]`` (normed, projected, rotated)."""
    layer, dims = weights.struct(shape), shape.struct()
    flat = _fp32_rows(x, shape.hidden, "a native decoder layer")
    count = flat.shape[0]
    if count != tokens.count:
        raise RuntimeError(f"{count} rows of hidden states for {tokens.count} tokens")
    q = flat.new_empty(count, shape.heads, shape.dim)
    k = flat.new_empty(count, shape.kv_heads, shape.dim)
    v = flat.new_empty(count, shape.kv_heads, shape.dim)
    status = _cdll().ms_layer_qkv(ctypes.byref(layer), ctypes.byref(dims), ctypes.byref(tokens.struct(shape.dim)),
                                  flat.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads())
    _check_status(status, "a native decoder layer (q/k/v)")
    return q, k, v


def layer_rest(weights: LayerWeights, shape: LayerShape, tokens: Tokens, x: torch.Tensor, q: torch.Tensor,
               kv: KVBuffers) -> torch.Tensor:
    """The second half: attention of each token on its columns of ``kv`` (which holds the tokens' own
    k and v), the output projection, the residual, the MLP: the layer's output ``[count, hidden]``."""
    layer, dims = weights.struct(shape), shape.struct()
    flat = _fp32_rows(x, shape.hidden, "a native decoder layer")
    if flat.shape[0] != tokens.count or q.shape != (tokens.count, shape.heads, shape.dim) or not q.is_contiguous():
        raise RuntimeError("a native decoder layer's q must be layer_qkv's, for the same tokens")
    kv_struct = kv.struct(shape, tokens)
    out = torch.empty_like(flat)
    status = _cdll().ms_layer_rest(ctypes.byref(layer), ctypes.byref(dims), ctypes.byref(tokens.struct(shape.dim)),
                                   flat.data_ptr(), q.data_ptr(), ctypes.byref(kv_struct), out.data_ptr(),
                                   torch.get_num_threads())
    _check_status(status, "a native decoder layer (attention and MLP)")
    return out


class LayerRun:
    """Consecutive layers decoded in one C call (`ms_layers_forward`): their C descriptions are kept and
    rebuilt only when a layer's weights or KV buffers change."""

    def __init__(self, shape: LayerShape, count: int) -> None:
        self.shape = shape
        self.array = (_Layer * count)()
        self._keys: list[Any] = [None] * count
        self._shape_struct = shape.struct()

    def set(self, i: int, weights: LayerWeights, kv: KVBuffers, tokens: Tokens) -> None:
        key = (id(weights), kv.keys.data_ptr(), kv.values.data_ptr(), kv.keys.shape, kv.values.shape,
               kv.keys.stride(), kv.values.stride())
        if key != self._keys[i]:
            self.array[i] = weights.struct(self.shape, kv.struct(self.shape, tokens))
            self._keys[i] = key
        else:  # the same buffers: check only what these tokens touch
            if tokens.count and (tokens.max_row >= kv.keys.shape[0] or tokens.max_column >= kv.keys.shape[2]):
                raise RuntimeError(f"tokens write row {tokens.max_row}, column {tokens.max_column} of KV buffers "
                                   f"{tuple(kv.keys.shape)}")

    def forward(self, start: int, end: int, tokens: Tokens, x: torch.Tensor,
                stops: StopPoints | None = None) -> tuple[torch.Tensor, int]:
        """Layers ``start``..``end - 1`` (each `set` for these tokens) on ``x`` ``[count, hidden]``:
        ``(out, done)``, ``done`` the first layer not run (``end``, or a stop point of ``stops`` that
        found its flag set; the caller goes on from there)."""
        out = _fp32_rows(x, self.shape.hidden, "native decoder layers").clone()
        if out.shape[0] != tokens.count:
            raise RuntimeError(f"{out.shape[0]} rows of hidden states for {tokens.count} tokens")
        done = ctypes.c_int64(0)
        points = stops.struct(start, end) if stops is not None else None
        status = _cdll().ms_layers_forward(ctypes.addressof(self.array) + start * ctypes.sizeof(_Layer), end - start,
                                           ctypes.byref(self._shape_struct),
                                           ctypes.byref(tokens.struct(self.shape.dim)), out.data_ptr(),
                                           torch.get_num_threads(), ctypes.byref(points) if points else None,
                                           ctypes.byref(done))
        _check_status(status, "native decoder layers")
        return out, start + done.value


class StopPoints:
    """Where a `LayerRun` may stop early: before each layer in ``layers`` when ``flag`` (a
    ``ctypes.c_int32`` that another thread sets) is nonzero as the run gets there. The engine's
    prefill points, checked inside one C call instead of one call per run of layers.

    Example:
        >>> flag = ctypes.c_int32(0)
        >>> stops = StopPoints(frozenset({5, 10}), 30, flag)
        >>> stops.struct(0, 30).stop_before != 0
        True
    """

    def __init__(self, layers: frozenset[int], count: int, flag: ctypes.c_int32) -> None:
        if not isinstance(flag, ctypes.c_int32):
            raise TypeError(f"the stop flag must be a ctypes.c_int32, got {type(flag).__name__}")
        self.flag = flag
        self.layers = frozenset(layers)
        self._mask = (ctypes.c_uint8 * max(count, 1))(*(1 if i in self.layers else 0 for i in range(count)))

    def struct(self, start: int, end: int) -> _Points:
        if not 0 <= start <= end <= len(self._mask):
            raise ValueError(f"layers {start}..{end} are outside the {len(self._mask)} these stop points cover")
        return _Points(ctypes.addressof(self.flag), ctypes.addressof(self._mask) + start)
