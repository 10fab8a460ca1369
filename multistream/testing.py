"""Scripted stand-ins for the text and image models, for fast tests of anything built on streams.

`ScriptedTextModel` and `ScriptedImageModel` have the same ``.stream()`` / ``.generate()``
signatures as the real models and emit scripted events through a real `Stream` (so seq,
backpressure, cancel and error handling behave exactly as in production), without torch or
weights. They check their arguments with the code the real models use
(`multistream.text._options`, `multistream.image._options`), so they refuse the same mistakes with
the same messages and an image stream previews the same steps as a real one. They honour
``cancel()`` and ``finish_early()`` within one step, and take edits in a simple scripted way: text ``steer(text)``
starts a new revision and the script goes on; text ``rewind(offset)`` cuts the answer at
``offset`` and the script goes on from there; ``ScriptedTextModel.revise(final, offset)``
regenerates a finished answer from ``offset``; image ``steer(prompt=...)`` recolours the picture
to the prompt's colours from the next step.

Example:
    >>> from multistream.testing import ScriptedTextModel, ScriptedImageModel
    >>> llm = ScriptedTextModel(["Hello", ",", " world"])
    >>> "".join(ev.delta for ev in llm.stream("hi"))
    'Hello, world'
    >>> llm.generate("hi").finish_reason
    'stop'
    >>> sd = ScriptedImageModel(steps=4, size=32)
    >>> events = list(sd.stream("a red circle"))   # previews (a slow reader gets only the newest), then the final
    >>> events[-1].step, events[-1].is_final, events[-1].mime
    (4, True, 'image/png')
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._checks import is_int, is_number
from .errors import InvalidArgumentError, PromptTooLongError, StreamFinishedError
from .events import Event, ImageEvent, TextEvent
from .image import PreviewThrottle, check_size_multiple, encode_frame, parse_image_options, parse_preview
from .speech import SpeechModel
from .stream import Stream, StreamWriter, run_producer
from .text import REWIND_OPTIONS, TEXT_STREAM_ARGS, StopMatcher, check_prompt, parse_text_options

__all__ = ["DEFAULT_TOKENS", "ScriptedImageModel", "ScriptedSpeechModel", "ScriptedTextModel"]

DEFAULT_TOKENS: tuple[str, ...] = (
    "Streams", " carry", " tokens", " one", " by", " one", ",", " and", " previews",
    " step", " by", " step", ":", " the", " reader", " sees", " them", " as", " they", " come", ".",
)

def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgumentError(message)


def _sleep(writer: StreamWriter, seconds: float) -> None:
    """Sleep in small slices so a cancel is seen within one step."""
    end = time.perf_counter() + seconds
    while not writer.cancelled:
        left = end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.01))


def _start(kind: str, producer: Callable[[StreamWriter], None],
           on_command: Callable[[str, tuple[Any, ...], dict[str, Any]], Any] | None = None) -> Stream:
    """A Stream whose producer thread starts after the command handler is in place (so a steer
    right after ``stream()`` returns is never refused)."""

    def submit(writer: StreamWriter) -> None:
        if on_command is not None:
            writer.on_command(on_command)
        threading.Thread(target=run_producer, args=(producer, writer), daemon=True,
                         name=f"multistream-scripted-{kind}-{writer.stream_id[:8]}").start()

    return Stream(submit=submit, kind=kind)


class _TextEdits:
    """Queued steer/rewind commands of one scripted text stream (checked on the caller's thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[tuple[str, int | None, str | None]] = []
        self.branches: dict[int, int] = {}  # queue position -> token_id of a rewind that branches
        self.taken_branches: dict[int, int] = {}
        self.writer: StreamWriter | None = None

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name == "steer":
            _require(not kwargs, f"text steer() takes one instruction string; got unknown {', '.join(sorted(kwargs))}")
            _require(len(args) == 1 and isinstance(args[0], str) and args[0].strip() != "",
                     "steer() needs a non-empty instruction string, e.g. s.steer('make it shorter')")
            item: tuple[str, int | None, str | None] = ("steer", None, args[0])
        elif name == "rewind":
            (offset,) = args
            instruction = kwargs.pop("instruction", None)
            token_id = kwargs.pop("token_id", None)
            _require(token_id is None or (is_int(token_id) and token_id >= 0),
                     f"token_id must be a token id (an integer >= 0), got {token_id!r}")
            unknown = sorted(set(kwargs) - set(REWIND_OPTIONS))
            _require(not unknown, f"rewind() got unknown option(s) {unknown}; known ones are {list(REWIND_OPTIONS)}")
            parse_text_options(**kwargs)
            _require(instruction is None or (isinstance(instruction, str) and instruction.strip() != ""),
                     "instruction must be a non-empty string or None")
            length = self.writer.text_length if self.writer is not None else 0
            _require(is_int(offset) and 0 <= offset <= length,
                     f"offset must be an integer from 0 to {length} (the answer's length so far), got {offset!r}")
            item = ("rewind", int(offset), instruction)
        else:
            raise InvalidArgumentError(f"text streams do not support {name}()")
        with self._lock:
            if name == "rewind" and token_id is not None:
                self.branches[len(self._queue)] = int(token_id)
            self._queue.append(item)

    def take(self) -> list[tuple[str, int | None, str | None]]:
        with self._lock:
            taken, self._queue = self._queue, []
            self.taken_branches, self.branches = self.branches, {}
            return taken


def _prompt_text(prompt: str | list[dict[str, str]]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m.get("content") or "" for m in prompt)


class _Counters:
    """Thread-safe bookkeeping tests read: how many streams run now and how each one ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.started = 0
        self.finish_reasons: list[str] = []

    def enter(self) -> None:
        with self._lock:
            self.active += 1
            self.started += 1

    def leave(self, reason: str) -> None:
        with self._lock:
            self.active -= 1
            self.finish_reasons.append(reason)


class ScriptedTextModel:
    """A fake text model that streams a fixed list of tokens, ``delay_s`` apart.

    It stops after ``max_new_tokens`` tokens (``finish_reason="length"``) or at the end of the
    script (``"stop"``); a ``stop`` string ends it with ``"stop_sequence"`` (text held back as the
    real model does, so deltas never contain a stop string). ``fail_after=n`` raises after n tokens
    (the stream then ends with an ``error`` event). ``calls`` records each call's arguments;
    ``active`` counts running generations and ``finish_reasons`` lists how each one ended.

    Example:
        >>> llm = ScriptedTextModel(["a", "b", "c"], delay_s=0.0)
        >>> final = llm.generate("hi", max_new_tokens=2)
        >>> final.text, final.finish_reason
        ('ab', 'length')
        >>> llm.stream("hi", max_new_tokens=0)
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: max_new_tokens must be an integer >= 1, got 0
    """

    def __init__(
        self,
        tokens: Sequence[str] | None = None,
        delay_s: float = 0.0,
        *,
        first_delay_s: float | None = None,
        fail_after: int | None = None,
        name: str = "scripted-text",
        context_length: int = 2048,
    ) -> None:
        _require(tokens is None or (len(tokens) > 0 and all(isinstance(t, str) for t in tokens)),
                 "tokens must be a non-empty list of strings (or None for the default script)")
        _require(is_number(delay_s) and delay_s >= 0, f"delay_s must be a number >= 0, got {delay_s!r}")
        self.tokens = list(tokens) if tokens is not None else list(DEFAULT_TOKENS)
        self.delay_s = float(delay_s)
        self.first_delay_s = self.delay_s if first_delay_s is None else float(first_delay_s)
        self.fail_after = fail_after
        self.name = name
        self.device = "cpu"
        self.context_length = context_length
        self.model: Any = None
        self.tokenizer: Any = None
        self.calls: list[dict[str, Any]] = []
        self._counters = _Counters()
        self._tops: dict[str, int] = {}  # stream id -> its top_logprobs (-1: none), for revise

    @property
    def active(self) -> int:
        """Generations running right now (their producer thread has not ended)."""
        return self._counters.active

    @property
    def finish_reasons(self) -> list[str]:
        """How each generation that ended so far ended, in order."""
        return list(self._counters.finish_reasons)

    def count_tokens(self, prompt: str | list[dict[str, str]]) -> int:
        """Whitespace tokens: good enough to exercise prompt-length limits."""
        return max(1, len(_prompt_text(prompt).split()))

    def stream(self, prompt: str | list[dict[str, str]], **options: Any) -> Stream:
        """Validate the arguments now (as the real model does), then stream the script in a thread."""
        checked = parse_text_options(**options)

        prompt = check_prompt(prompt)
        prompt_tokens = self.count_tokens(prompt)
        if prompt_tokens >= self.context_length:
            raise PromptTooLongError(
                f"the prompt has {prompt_tokens} tokens but the context window is {self.context_length}; "
                "shorten the prompt"
            )
        # What the model was asked: every option (its checked default when not given) as the caller wrote it.
        self.calls.append({"prompt": prompt, **{name: getattr(checked, name) for name in TEXT_STREAM_ARGS}, **options})
        self._counters.enter()
        edits = _TextEdits()
        top = checked.top_logprobs if checked.wants_logprobs else -1
        stream = _start(
            "text",
            lambda w: self._produce(w, prompt_tokens, checked.max_new_tokens, list(checked.stop), checked.chunk_tokens or 1, edits,
                                    top=top),
            edits.handle,
        )
        self._tops[stream.stream_id] = top
        return stream

    def revise(self, final: Event, offset: int, instruction: str | None = None, *, token_id: int | None = None,
               **options: Any) -> Stream:
        """Regenerate a finished answer from character ``offset``: a new stream whose first event
        is the kept prefix (``offset`` 0, revision 0), then (revision 1) the script from its start.

        Example:
            >>> llm = ScriptedTextModel(["ab", "cd"])
            >>> llm.revise(llm.generate("x"), 2).wait().text
            'ababcd'
        """
        _require(isinstance(final, TextEvent) and final.is_final and final.text is not None,
                 "revise() needs the final text event of a finished answer")
        text = final.text or ""
        _require(is_int(offset) and 0 <= offset <= len(text),
                 f"offset must be an integer from 0 to {len(text)} (the answer's length), got {offset!r}")
        _require(instruction is None or (isinstance(instruction, str) and instruction.strip() != ""),
                 "instruction must be a non-empty string or None")
        _require(token_id is None or (is_int(token_id) and token_id >= 0),
                 f"token_id must be a token id (an integer >= 0), got {token_id!r}")
        unknown = sorted(set(options) - set(REWIND_OPTIONS) - {"max_new_tokens"})
        _require(not unknown, f"revise() got unknown option(s) {unknown}")
        parse_text_options(**options)
        max_new_tokens = options.get("max_new_tokens", 256)
        self.calls.append({"revise": True, "offset": offset, "instruction": instruction, **options})
        self._counters.enter()
        edits = _TextEdits()
        if token_id is not None:
            edits.branches[-1] = int(token_id)
        prefix = text[:offset]
        top = self._tops.get(final.stream_id, -1)  # as the real model, a revision keeps the options
        stream = _start(
            "text",
            lambda w: self._produce(w, 1, max_new_tokens, [], 1, edits, prefix=prefix, instruction=instruction, top=top),
            edits.handle,
        )
        self._tops[stream.stream_id] = top
        return stream

    def generate(self, prompt: str | list[dict[str, str]], on_event: Callable[[Event], Any] | None = None,
                 **kwargs: Any) -> Event:
        """Stream to the end, calling ``on_event`` for each event; return the final event."""
        return self.stream(prompt, **kwargs).wait(on_event)

    def logprob_entry(self, token_id: int, top: int) -> dict[str, Any]:
        """The scripted logprobs of script token ``token_id``: made-up numbers, most likely first,
        with the next script tokens as its ``top`` alternatives (their ids are script positions, so
        a branch to one continues the script from there)."""

        def one(i: int, logprob: float) -> dict[str, Any]:
            raw = list(self.tokens[i].encode("utf-8"))
            return {"token_id": i, "token": self.tokens[i], "bytes": raw, "logprob": logprob}

        chosen = -0.05 - 0.9 * (token_id % 4)
        alts = [one(token_id, chosen)] + [one((token_id + r) % len(self.tokens), chosen - 0.6 * r)
                                          for r in range(1, max(top, 0))]
        return {**one(token_id, chosen), "top_logprobs": alts[: max(top, 0)]}

    def _produce(self, w: StreamWriter, prompt_tokens: int, max_new_tokens: int, stops: list[str],
                 chunk_tokens: int, edits: _TextEdits, prefix: str = "", instruction: str | None = None,
                 top: int = -1) -> None:
        reason = "error"
        edits.writer = w
        try:
            reason = self._run(w, prompt_tokens, max_new_tokens, stops, chunk_tokens, edits, prefix, instruction, top)
        finally:
            self._counters.leave(reason)

    def _run(self, w: StreamWriter, prompt_tokens: int, max_new_tokens: int, stops: list[str],
             chunk_tokens: int, edits: _TextEdits, prefix: str = "", instruction: str | None = None,
             top: int = -1) -> str:
        emitted = ""      # text already sent
        held = ""         # text not sent yet (chunking, or a possible start of a stop string)
        held_ids: list[int] = []
        held_lps: list[dict[str, Any]] = []
        cursor = 0  # the script position of the next token (a branch moves it)
        if -1 in edits.branches:  # revise(..., token_id=)
            cursor = edits.branches.pop(-1) % len(self.tokens)
        first_index = 0   # the answer position (in tokens) of the next event's first token
        ends: list[int] = []  # where each sent token's text ends in the answer (a rewind cuts by them)
        completion = 0
        stamps: list[float] = []
        reason: str | None = None
        matcher = StopMatcher(stops)
        revisions: list[dict[str, Any]] = []
        cut: int | None = None  # after a rewind: where the next delta begins
        if prefix:
            # A revise() stream: the kept part first, then the regenerated rest as revision 1.
            w.text(prefix, [], 0)
            emitted = prefix
        if prefix or instruction is not None:
            w.new_revision()
            revisions.append({"kind": "revise", "step": 0, "offset": len(prefix), "instruction": instruction})
        for n in range(max_new_tokens):
            _sleep(w, self.first_delay_s if n == 0 else self.delay_s)
            if w.cancelled:
                reason = "cancelled"
                break
            if w.finish_early_requested:
                reason = "finished_early"
                break
            for position, (kind, offset, text) in enumerate(edits.take()):
                w.new_revision()
                if kind == "rewind":
                    assert offset is not None
                    offset = min(offset, len(emitted))
                    emitted, held, held_ids, held_lps = emitted[:offset], "", [], []
                    branch = edits.taken_branches.get(position)
                    if branch is not None:
                        cursor = branch % len(self.tokens)
                    matcher = StopMatcher(stops)
                    cut = offset
                    keep = sum(1 for e in ends if e <= offset)
                    del ends[keep:]
                    first_index = keep
                else:
                    offset = len(emitted)
                revisions.append({"kind": kind, "step": n, "offset": offset, "instruction": text})
            if self.fail_after is not None and n >= self.fail_after:
                raise RuntimeError(f"scripted failure after {n} tokens")
            if cursor >= len(self.tokens):
                reason = "stop"
                break
            completion += 1
            safe, stopped = matcher.feed(self.tokens[cursor])
            held += safe
            held_ids.append(cursor)
            if top >= 0:
                held_lps.append(self.logprob_entry(cursor, top))
            cursor += 1
            if stopped:
                reason = "stop_sequence"
                break
            if completion % chunk_tokens and completion < max_new_tokens:
                continue
            if held:
                w.text(held, held_ids, first_index, offset=cut, logprobs=held_lps if top >= 0 else None)
                cut = None
                stamps.append(w.elapsed())
                for i in held_ids:
                    ends.append((ends[-1] if ends else len(prefix)) + len(self.tokens[i]))
                emitted += held
                first_index += len(held_ids)
                held, held_ids, held_lps = "", [], []
        held += matcher.flush()
        emitted += held
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        duration = w.elapsed()
        metrics = {
            "ttft_ms": round(stamps[0] * 1000, 3) if stamps else None,
            "itl_ms_p50": round(statistics.median(gaps) * 1000, 3) if gaps else None,
            "itl_ms_p95": round(sorted(gaps)[int(0.95 * (len(gaps) - 1))] * 1000, 3) if gaps else None,
            "duration_ms": round(duration * 1000, 3),
            "tokens_per_s": round(completion / duration, 3) if duration > 0 else None,
        }
        reason = reason or "length"
        w.finish_text(held, held_ids if held else [], first_index, finish_reason=reason, text=emitted,
                      usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion},
                      metrics=metrics, revisions=revisions or None, offset=cut,  # type: ignore[arg-type]
                      logprobs=(held_lps if held else []) if top >= 0 else None)
        return reason


class ScriptedImageModel:
    """A fake image model: a noisy frame that turns into a red circle on blue, step by step.

    Each step (``delay_s`` apart) emits a real JPEG preview (unless ``preview="none"``), then the
    final image (PNG by default) ends the stream. With ``num_images > 1`` the images come one after
    another; only the last final frame has ``is_final`` (earlier ones carry ``finish_reason``).

    ``stream()`` checks its arguments with `parse_image_options`, as `ImageModel` does, so it
    refuses the same values with the same messages and previews the same steps (1, 1+k, ... for
    ``preview_every=k``; the final's ``metrics["previews"]`` counts them). Where the real checks
    need a model the fake has its own rules: every preview mode draws the same blend (so
    ``"taesd"`` needs no weights), a given height or width must be a multiple of `size_multiple`
    (the real model's multiple comes from its VAE), and keyword arguments that the real model
    passes to its pipeline are refused.

    Example:
        >>> sd = ScriptedImageModel(steps=3, size=16)
        >>> final = sd.generate("a red circle", preview="none")
        >>> final.mime, final.width, final.image.size
        ('image/png', 16, (16, 16))
    """

    #: What ``preview=None`` means here (`ImageModel.default_preview` on a real model).
    default_preview = "latent"
    #: What a given height or width must be a multiple of (Stable Diffusion's VAE factor).
    size_multiple = 8

    def __init__(self, steps: int = 8, size: int | tuple[int, int] = 64, delay_s: float = 0.0, *,
                 name: str = "scripted-image", fail_at_step: int | None = None) -> None:
        _require(is_int(steps) and steps >= 1, f"steps must be an integer >= 1, got {steps!r}")
        w, h = (size, size) if is_int(size) else size  # type: ignore[misc]
        _require(is_int(w) and is_int(h) and w >= 1 and h >= 1, f"size must be an int or (width, height), got {size!r}")
        self.default_steps = steps
        self.width, self.height = int(w), int(h)
        self.delay_s = float(delay_s)
        self.fail_at_step = fail_at_step
        self.name = name
        self.device = "cpu"
        self.pipeline: Any = None
        self.calls: list[dict[str, Any]] = []
        self._counters = _Counters()

    @property
    def active(self) -> int:
        return self._counters.active

    @property
    def finish_reasons(self) -> list[str]:
        return list(self._counters.finish_reasons)

    def stream(self, prompt: str, **options: Any) -> Stream:
        """Validate the arguments now (with `parse_image_options`, as the real model does), then
        stream previews and the final image."""
        options = parse_image_options(prompt, **options)
        for key in options.pipeline_kwargs:
            # The real model hands these to its pipeline, which refuses names it does not take.
            raise InvalidArgumentError(f"{type(self).__name__} takes no {key!r} argument (it has no pipeline)")
        plan = options.preview or parse_preview(self.default_preview)
        why = f"the fake, like a VAE, downsamples by {self.size_multiple}"
        height, width = (default if value is None else check_size_multiple(name, value, self.size_multiple, why)
                         for name, value, default in (("height", options.height, self.height),
                                                      ("width", options.width, self.width)))
        args = {
            "prompt": options.prompt, "negative_prompt": options.negative_prompt,
            "steps": self.default_steps if options.steps is None else options.steps,
            "guidance_scale": options.guidance_scale, "height": height, "width": width, "seed": options.seed, "num_images": options.num_images, "preview": plan.mode,
            "preview_every": options.preview_every, "preview_format": options.preview_format,
            "preview_quality": options.preview_quality, "preview_max_side": options.preview_max_side,
            "final_format": options.final_format, "final_quality": options.final_quality, "priority": options.priority,
        }  # fmt: skip
        self.calls.append(args)
        self._counters.enter()
        steering = _ImageSteers(options.guidance_scale)
        return _start("image", lambda w: self._produce(w, args, steering), steering.handle)

    def generate(self, prompt: str, on_event: Callable[[Event], Any] | None = None, **kwargs: Any) -> Event:
        """Stream to the end, calling ``on_event`` for each event; return the final event."""
        return self.stream(prompt, **kwargs).wait(on_event)

    def _produce(self, w: StreamWriter, a: dict[str, Any], steering: _ImageSteers) -> None:
        reason = "error"
        try:
            reason = self._run(w, a, steering)
        finally:
            steering.close()
            self._counters.leave(reason)

    def _run(self, w: StreamWriter, a: dict[str, Any], steering: _ImageSteers) -> str:
        from PIL import Image

        width, height, steps, n_images = a["width"], a["height"], a["steps"], a["num_images"]
        colors = _scene_colors(a["prompt"], ((220, 30, 30), (30, 60, 200)))
        for prompt in steering.take():  # steered before the first step: as if started with it
            colors = _scene_colors(prompt, colors)
        target = _scene(width, height, colors)
        throttle = PreviewThrottle(a["preview_every"])  # the production cadence: steps 1, 1+k, ...
        rng = random.Random(a["seed"] if a["seed"] is not None else 0)
        started = w.elapsed()
        first_frame: float | None = None
        previews = 0
        frame = target
        for index in range(n_images):
            noise = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
            step = 0
            stopped: str | None = None
            for step in range(1, steps + 1):
                _sleep(w, self.delay_s)
                if w.cancelled:
                    stopped = "cancelled"
                    break
                if w.finish_early_requested:
                    stopped = "finished_early"
                    break
                if self.fail_at_step is not None and step >= self.fail_at_step:
                    raise RuntimeError(f"scripted failure at step {step}")
                for prompt in steering.take():
                    colors = _scene_colors(prompt, colors)
                    target = _scene(width, height, colors)
                frame = Image.blend(noise, target, step / steps)
                if a["preview"] != "none" and throttle.should_preview(step):
                    data, mime, pw, ph = _encode(frame, a["preview_format"], a["preview_quality"], a["preview_max_side"])
                    w.image(step=step, total_steps=steps, width=pw, height=ph, mime=mime, data=data, index=index)
                    first_frame = first_frame if first_frame is not None else w.elapsed()
                    previews += 1
                if step == steps:
                    steering.close()
            last = index == n_images - 1 or stopped is not None
            if stopped is not None:
                step -= 1  # the step that was asked to stop did not run
            data, mime, fw, fh = _encode(frame, a["final_format"], a["final_quality"], None)
            metrics = {"duration_ms": round((w.elapsed() - started) * 1000, 3),
                       "previews": float(previews)}  # as the real model counts them: all made so far
            if first_frame is not None:  # the real model's name, absent when no preview was made
                metrics["time_to_first_preview_ms"] = round(first_frame * 1000, 3)
            if steering.applied:
                metrics["steers"] = float(steering.applied)
            done = ImageEvent(stream_id=w.stream_id, seq=0, t=0.0, step=step if stopped else steps,
                              total_steps=steps, width=fw, height=fh, mime=mime, data=data, index=index,
                              finish_reason=stopped or "stop", metrics=metrics)
            # forward() keeps finish_reason on a non-final frame and never merges it away.
            w.forward(done, is_final=last)
            if last:
                return stopped or "stop"
        return "stop"  # pragma: no cover - the loop always returns


def _scene_colors(prompt: str, current: tuple[tuple[int, int, int], tuple[int, int, int]]
                  ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(shape colour, background colour) a prompt names, e.g. "a red circle on a yellow background"."""
    from ._shapes import COLORS, parse_prompt

    _, color, background = parse_prompt(prompt)
    return (COLORS[color] if color else current[0], COLORS[background] if background else current[1])


def _scene(width: int, height: int, colors: tuple[tuple[int, int, int], tuple[int, int, int]]) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), colors[1])
    ImageDraw.Draw(img).ellipse((width * 0.2, height * 0.2, width * 0.8, height * 0.8), fill=colors[0])
    return img


class _ImageSteers:
    """Steer commands of one scripted image stream: the same checks as the real model's."""

    def __init__(self, guidance_scale: float | None) -> None:
        self._lock = threading.Lock()
        self._queue: list[str] = []
        self.applied = 0
        self.closed = False
        self.guidance_scale = guidance_scale

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name == "rewind":
            raise InvalidArgumentError(
                "image streams cannot rewind (there is no text to cut); use steer(prompt=...) to change "
                "the conditioning from the next step, or start a new stream")
        _require(name == "steer", f"image streams do not support {name}()")
        changes = dict(kwargs)
        if args:
            _require(len(args) == 1 and "prompt" not in changes,
                     "steer() on an image stream takes one prompt: steer(prompt='...')")
            changes["prompt"] = args[0]
        unknown = sorted(set(changes) - {"prompt", "negative_prompt", "guidance_scale"})
        _require(not unknown, "image steer() takes prompt=, negative_prompt= and guidance_scale=; "
                              f"got unknown {', '.join(unknown)}")
        changes = {k: v for k, v in changes.items() if v is not None}
        _require(bool(changes), "steer() needs at least one of prompt=, negative_prompt=, guidance_scale=")
        for key in ("prompt", "negative_prompt"):
            if key in changes:
                _require(isinstance(changes[key], str), f"{key} must be a string, got {type(changes[key]).__name__}")
        if "prompt" in changes:
            _require(changes["prompt"].strip() != "",
                     "prompt must not be empty; pass the new prompt, e.g. steer(prompt='a red circle')")
        if "guidance_scale" in changes:
            g = changes["guidance_scale"]
            _require(is_number(g) and math.isfinite(g) and g >= 0,
                     f"guidance_scale must be a finite number >= 0, got {g!r}")
        with self._lock:
            if self.closed:
                raise StreamFinishedError("the image has finished denoising, so it cannot be steered; start a new stream")
            self._queue.append(changes.get("prompt", ""))

    def take(self) -> list[str]:
        with self._lock:
            taken, self._queue = self._queue, []
        self.applied += len(taken)
        return [p for p in taken if p]

    def close(self) -> None:
        with self._lock:
            self.closed = True


def _encode(img: Any, fmt: str, quality: int, max_side: int | None) -> tuple[bytes, str, int, int]:
    frame = encode_frame(img, fmt, quality, max_side)
    return frame.data, frame.mime, frame.width, frame.height


class _ToneSynth:
    """A synthesizer for tests: a quiet 220 Hz tone, ``samples_per_char`` samples a character,
    ``delay_s`` a piece (no model, no voice files)."""

    def __init__(self, sample_rate: int, samples_per_char: int, delay_s: float, voices: tuple[str, ...]) -> None:
        self.sample_rate = sample_rate
        self.samples_per_char = samples_per_char
        self.delay_s = delay_s
        self.voices = voices
        self.name = "scripted-speech"
        self.device = "cpu"
        self.calls: list[str] = []

    def synthesize(self, text: str, voice: str | None, speed: float) -> Any:
        import numpy as np

        self.calls.append(text)
        if self.delay_s:
            time.sleep(self.delay_s)
        n = max(1, int(len(text.strip()) * self.samples_per_char / speed))
        t = np.arange(n, dtype=np.float32) / self.sample_rate
        return (np.sin(2 * np.pi * 220.0 * t) * 3000).astype("<i2")


class ScriptedSpeechModel(SpeechModel):
    """A speech model for tests: the real `SpeechModel` (engine, splitter, options, events) over a
    tone synthesizer (``samples_per_char`` samples of a 220 Hz tone a character, ``delay_s`` a
    sentence), so servers and clients are tested without a voice. ``model.synth.calls`` lists
    the pieces it spoke.

    Example:
        >>> tts = ScriptedSpeechModel()
        >>> final = tts.generate("Hello there. Bye.")
        >>> final.finish_reason, final.sample_rate, final.metrics["chunks"]
        ('stop', 16000, 2)
        >>> tts.close()
    """

    def __init__(self, sample_rate: int = 16000, samples_per_char: int = 400, delay_s: float = 0.0,
                 voices: Sequence[str] = ("tone",)) -> None:
        super().__init__(_ToneSynth(sample_rate, samples_per_char, delay_s, tuple(voices)))
