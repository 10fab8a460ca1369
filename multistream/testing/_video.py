"""A scripted stand-in for the video model: real ``video`` events without a pipeline.

Example:
    >>> from multistream.testing import ScriptedVideoModel
    >>> vm = ScriptedVideoModel(steps=3, num_frames=4, size=16)
    >>> events = list(vm.stream("a red circle moving right on a blue background", preview="none"))
    >>> events[-1].mime, len(events[-1].frames)
    ('video/webm', 4)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from .._checks import is_int, is_number
from .._eta import StepEta
from ..errors import InvalidArgumentError, StreamFinishedError
from ..events import Event, VideoEvent
from ..image import ImageSizes
from ..stream import Stream, StreamWriter
from ..video import encode_clip, encode_preview, parse_video_options
from ._scripted import CountedModel, Counters, pause, require, start_stream

__all__ = ["ScriptedVideoModel"]

_MOTIONS = {"moving left": (-1, 0), "moving right": (1, 0), "moving up": (0, -1), "moving down": (0, 1)}


class ScriptedVideoModel(CountedModel):
    """Same ``.stream()`` / ``.generate()`` as `multistream.video.VideoModel`; each step (``delay_s``
    apart) emits every frame's preview (a blend from noise to a disc of the prompt's colours that
    moves as the prompt says: "moving left|right|up|down"), then the clip (WebM or MP4).

    Arguments are checked with `parse_video_options`, as the real model does; the fake's own
    rules: sides must be among `sizes`, pipeline keywords are refused. ``cancel()``,
    ``finish_early()`` and ``steer(prompt=...)`` (recolours from the next step) work within a step.
    """

    def __init__(self, steps: int = 8, num_frames: int = 8, size: int = 32, fps: float = 8.0, delay_s: float = 0.0, *,
                 name: str = "scripted-video", fail_at_step: int | None = None) -> None:
        require(is_int(steps) and steps >= 1, f"steps must be an integer >= 1, got {steps!r}")
        require(is_int(num_frames) and num_frames >= 1, f"num_frames must be an integer >= 1, got {num_frames!r}")
        require(is_int(size) and size >= 8 and size % 8 == 0, f"size must be a multiple of 8, got {size!r}")
        self.default_steps, self.default_num_frames, self.default_fps = steps, num_frames, float(fps)
        self.default_size = (size, size)
        self.sizes = ImageSizes(multiple=8, min_side=8, max_side=4 * size, native=(size, size), why="the fake's grid")
        self.delay_s = float(delay_s)
        self.fail_at_step = fail_at_step
        self.name = name
        self.device = "cpu"
        self.pipeline: Any = None
        self.calls: list[dict[str, Any]] = []
        self._counters = Counters()

    def stream(self, prompt: str, **options: Any) -> Stream:
        opts = parse_video_options(prompt, **options)
        for key in opts.pipeline_kwargs:
            raise InvalidArgumentError(f"{type(self).__name__} takes no {key!r} argument (it has no pipeline)")
        height, width = self.sizes.native_or(opts.height, opts.width)
        args = {
            "prompt": opts.prompt, "steps": opts.steps or self.default_steps,
            "num_frames": opts.num_frames or self.default_num_frames, "fps": opts.fps or self.default_fps,
            "height": height, "width": width, "seed": opts.seed, "preview": opts.preview,
            "throttle": opts.throttle, "preview_format": opts.preview_format, "preview_max_side": opts.preview_max_side,
            "video_format": opts.video_format, "priority": opts.priority,
        }  # fmt: skip
        self.calls.append(args)
        self._counters.enter()
        steers = _VideoSteers()
        return start_stream("video", lambda w: self._produce(w, args, steers), steers.handle)

    def generate(self, prompt: str, on_event: Callable[[Event], Any] | None = None, **kwargs: Any) -> Event:
        return self.stream(prompt, **kwargs).wait(on_event)

    def _produce(self, w: StreamWriter, a: dict[str, Any], steers: _VideoSteers) -> None:
        reason = "error"
        try:
            reason = self._run(w, a, steers)
        finally:
            steers.close()
            self._counters.leave(reason)

    def _run(self, w: StreamWriter, a: dict[str, Any], steers: _VideoSteers) -> str:
        import numpy as np

        steps, n, fps = a["steps"], a["num_frames"], a["fps"]
        prompt = a["prompt"]
        rng = np.random.default_rng(a["seed"] or 0)
        noise = rng.integers(0, 256, (n, a["height"], a["width"], 3)).astype(np.float32)
        clip = _clip(prompt, n, a["height"], a["width"])
        eta = StepEta()
        frames = noise.astype(np.uint8)
        stopped: str | None = None
        step = 0
        for step in range(1, steps + 1):
            pause(w, self.delay_s)
            if w.cancelled:
                stopped = "cancelled"
                break
            if w.finish_early_requested:
                stopped = "finished_early"
                break
            if self.fail_at_step is not None and step >= self.fail_at_step:
                raise RuntimeError(f"scripted failure at step {step}")
            for new in steers.take():
                prompt = new
                clip = _clip(prompt, n, a["height"], a["width"])
            k = step / steps
            frames = (noise * (1 - k) + clip * k).round().astype(np.uint8)
            eta.step(step, w.elapsed())
            if a["preview"] != "none" and a["throttle"].should_preview(step):
                shown = _shrink(frames, a["preview_max_side"])
                data, mime = encode_preview(shown, a["preview_format"], fps=fps)
                w.emit(VideoEvent, step=step, total_steps=steps, num_frames=n, fps=fps, width=shown.shape[2],
                       height=shown.shape[1], mime=mime, data=data, eta_s=eta.eta(steps - step))
            if step == steps:
                steers.close()
        if stopped is not None:
            step -= 1
        if stopped == "cancelled":
            data, mime = encode_preview(_shrink(frames, a["preview_max_side"]), a["preview_format"], fps=fps)
        else:
            data, mime = encode_clip(frames, a["video_format"], fps=fps)
        h, w_ = frames.shape[1:3] if stopped != "cancelled" else _shrink(frames, a["preview_max_side"]).shape[1:3]
        w.emit(VideoEvent, step=step, total_steps=steps, num_frames=n, fps=fps, width=int(w_), height=int(h), mime=mime,
               data=data, is_final=True, finish_reason=stopped or "stop", eta_s=0.0,
               metrics={"steps": float(step), "steers": float(steers.applied), "duration_ms": w.elapsed() * 1e3})
        return stopped or "stop"


def _clip(prompt: str, n: int, height: int, width: int) -> Any:
    """A disc of the prompt's colour on its background colour, moving as the prompt says."""
    import numpy as np

    from .._shapes import COLORS, parse_prompt

    _, color, background = parse_prompt(prompt)
    fg = np.array(COLORS[color] if color else (220, 30, 30), np.float32)
    bg = np.array(COLORS[background] if background else (30, 60, 200), np.float32)
    dx, dy = next((v for k, v in _MOTIONS.items() if k in prompt.lower()), (0, 0))
    yy, xx = np.mgrid[0:height, 0:width]
    r = min(height, width) / 5
    out = np.empty((n, height, width, 3), np.float32)
    for f in range(n):
        t = f / max(1, n - 1) - 0.5
        cx, cy = width / 2 + dx * t * width / 2, height / 2 + dy * t * height / 2
        mask = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
        out[f] = np.where(mask[..., None], fg, bg)
    return out


def _shrink(frames: Any, max_side: int | None) -> Any:
    if max_side is None or max(frames.shape[1:3]) <= max_side:
        return frames
    step = math.ceil(max(frames.shape[1:3]) / max_side)
    return frames[:, ::step, ::step]


class _VideoSteers:
    """steer(prompt=...) of one scripted video stream, checked as the real model checks it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[str] = []
        self.applied = 0
        self.closed = False

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        require(name == "steer", f"a video stream does not support {name}(); it takes steer(prompt=...)")
        require(not args, "a video stream's steer() takes keywords: steer(prompt='...', negative_prompt=..., guidance_scale=...)")
        unknown = sorted(set(kwargs) - {"prompt", "negative_prompt", "guidance_scale"})
        require(not unknown, f"steer() takes prompt, negative_prompt and guidance_scale, not {unknown}")
        require(bool(kwargs), "steer() needs prompt=, negative_prompt= or guidance_scale=")
        g = kwargs.get("guidance_scale")
        require(g is None or (is_number(g) and g >= 0), f"steer(guidance_scale=...) must be a number >= 0, got {g!r}")
        with self._lock:
            if self.closed:
                raise StreamFinishedError("the clip has finished denoising; it can no longer be steered")
            self._queue.append(kwargs.get("prompt") or "")

    def take(self) -> list[str]:
        with self._lock:
            taken, self._queue = self._queue, []
        self.applied += len(taken)
        return [p for p in taken if p]

    def close(self) -> None:
        with self._lock:
            self.closed = True
