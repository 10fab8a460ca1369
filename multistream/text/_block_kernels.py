"""The block-quantized CPU kernels (``_block_kernels.c``): built with the system's C compiler at first use.

ATen's CPU int4 kernel multiplies in bf16 and dequantizes every weight as it goes, which makes it
compute-bound on an AVX2 CPU (a 576x3072 layer: 255 us a token on 2 cores). llama.cpp's way is
faster: quantize the activations too, per block of 32 to int8, and sum int8 x int4 products in
int32 with ``maddubs`` (the same layer: 87 us). ``_block_kernels.c`` is that arithmetic in one
plain C file (AVX2 intrinsics where the compiler targets them, portable C elsewhere), for GGUF's
Q4_1 weights (blocks of 32: a scale and a minimum each) and Q8_0 weights (a scale per block).

It is compiled once per machine with ``cc -O3 -march=native -fopenmp`` (``$CC`` if set; about a
second) into ``<cache_dir>/kernels`` and loaded with ctypes. No torch headers are involved, so a
plain C compiler suffices; without one, or if the build fails, `native_kernels()` says why and
quantized layers use ATen's kernels. OpenMP threads come from the runtime torch already loaded
(the library links ``libgomp.so.1``, which torch's CPU build bundles under that name), and each
call uses ``torch.get_num_threads()`` of them.

Example:
    >>> kernels = native_kernels()
    >>> kernels is None or kernels.isa in ("avx2", "portable C")
    True
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .._cache import cache_dir

__all__ = ["BLOCK", "NativeKernels", "block_matmul", "check_buffers", "native_kernels", "native_problem"]

logger = logging.getLogger("multistream")

BLOCK = 32  # values per quantization block, as in GGUF's Q4_1, Q8_0 and Q8_1
SOURCE = Path(__file__).with_name("_block_kernels.c")
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])


@dataclass(frozen=True)
class NativeKernels:
    """The loaded kernels (``cdll``): ``isa`` is what they were built for (``"avx2"`` or ``"portable C"``)."""

    cdll: ctypes.CDLL
    path: Path
    isa: str


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
    return f"{platform.machine()}|{flags}|{os.environ.get('CC', 'cc')}"


def _build(target: Path) -> str | None:
    """Compile the source into ``target`` (atomically: concurrent processes may build it too);
    None on success, else the compiler's complaint."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    complaint = "the build failed"
    for flags in _FLAG_SETS:
        fd, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, "-fPIC", "-shared", str(SOURCE), "-o", staging, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(staging, target)
                return None
            complaint = (done.stderr.strip().splitlines() or ["no message"])[-1]
        except (OSError, subprocess.SubprocessError) as exc:
            complaint = f"{type(exc).__name__}: {exc}"
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    return f"{compiler} could not build {SOURCE.name}: {complaint}"


def _load() -> tuple[NativeKernels | None, str | None]:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + _cpu_key().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"block_kernels-{key}.so"
    if not target.is_file():
        problem = _build(target)
        if problem is not None:
            return None, problem
    try:
        cdll = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"could not load {target}: {exc}"
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("ms_matmul_q4", "ms_matmul_q8"):
        function = getattr(cdll, name)
        function.argtypes = [pointer, pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int]
        function.restype = ctypes.c_int
    f32, i32 = ctypes.c_float, ctypes.c_int
    cdll.ms_layer_qkv.argtypes = [pointer, size, size, pointer, f32, pointer, pointer, i32, pointer, pointer,
                                     size, size, size, pointer, pointer, pointer, i32]
    cdll.ms_layer_rest.argtypes = [pointer, pointer, size, size, pointer, pointer, pointer, pointer, size, pointer,
                                      f32, size, size, size, pointer, pointer, i32, pointer, f32, pointer, pointer,
                                      i32, pointer, pointer, i32, size, pointer, i32]
    cdll.ms_layer_decode.argtypes = [pointer, size, size, pointer, f32, pointer, pointer, i32, pointer, pointer,
                                        size, size, size, pointer, pointer, pointer, pointer, size, pointer, f32,
                                        pointer, pointer, i32, pointer, f32, pointer, pointer, i32, pointer, pointer,
                                        i32, size, pointer, i32]
    cdll.ms_layers_decode.argtypes = [pointer, size, pointer, size, size, pointer, pointer, size, size, size, size,
                                         f32, size, pointer, i32]
    for function in (cdll.ms_layer_qkv, cdll.ms_layer_rest, cdll.ms_layer_decode, cdll.ms_layers_decode):
        function.restype = ctypes.c_int
    cdll.ms_kernel_isa.restype = ctypes.c_char_p
    return NativeKernels(cdll, target, cdll.ms_kernel_isa().decode()), None


def native_kernels() -> NativeKernels | None:
    """The block kernels, built and loaded at the first call (None if they cannot be: see `native_problem`)."""
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


def check_buffers(weight: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise if a block-quantized layer's buffers are not what the kernels read (a ``model.to(dtype)``
    after quantizing casts the fp16 scales; ``.to("cuda")`` moves them where the kernels cannot go)."""
    if scales.dtype != torch.float16 or weight.dtype not in (torch.uint8, torch.int8) \
            or weight.device.type != "cpu" or not (weight.is_contiguous() and scales.is_contiguous()):
        raise RuntimeError(
            f"a block-quantized layer's buffers were changed after quantizing (scales {scales.dtype} on "
            f"{scales.device.type}; the kernels read fp16 scales on the CPU): change the model's dtype or device "
            "before load_text_model(quantize=...) quantizes it, or load it with quantize=None")


def block_matmul(x: torch.Tensor, kind: int, weight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a block-quantized ``W``: ``kind`` 4 (Q4_1: ``weight`` uint8 ``[N, K/2]``,
    ``scales`` fp16 ``[N, K/32, 2]`` scale and minimum) or 8 (Q8_0: int8 ``[N, K]``, fp16 ``[N, K/32]``).

    ``x`` is fp32 ``[..., K]``; the result is fp32 ``[..., N]``.
    """
    kernels = native_kernels()
    if kernels is None:
        raise RuntimeError(f"the block-quantized kernels are unavailable: {_problem}")
    check_buffers(weight, scales)
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.float32)
    function = kernels.cdll.ms_matmul_q4 if kind == 4 else kernels.cdll.ms_matmul_q8
    status = function(flat.data_ptr(), weight.data_ptr(), scales.data_ptr(),
                      None if bias is None else bias.data_ptr(), out.data_ptr(), rows, k, out_features,
                      torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the block-quantized matmul failed (status {status}; in_features {k} must be a "
                           f"multiple of {BLOCK})")
    return out.reshape(*x.shape[:-1], out_features)
