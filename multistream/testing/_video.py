"""`ScriptedVideoModel`: a fake video model whose previews turn noise into a moving shape.

Every step it emits the current estimate of **every** frame (a real animated WebP, or a JPEG
contact sheet with ``preview_format="sheet"``), then the final clip, a real WebM (VP9) or MP4
(H.264), encoded by the video family's own encoders (PyAV for the clip); a cancelled stream ends,
as the real model's does, on its newest preview. No torch, no weights: for fast tests of what is
built on video streams (the command line, the notebook view, the demo's Video tab, the server,
composed streams).

Example:
    >>> from multistream.testing import ScriptedVideoModel
    >>> vm = ScriptedVideoModel(steps=2, num_frames=4, size=32)
    >>> final = vm.generate("a red circle moving right on a blue background")
    >>> final.mime, final.num_frames, len(final.frames)
    ('video/webm', 4, 4)
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from .._checks import is_int, is_number
from .._eta import StepEta
from ..events import VideoEvent
from ..image import ImageSizes
from ..stream import Stream, StreamWriter
from ..video import parse_video_options, refuse_pipeline_argument
from ._scripted import Counters, ScriptedDenoiser, SteerQueue, pause, require, start_stream

__all__ = ["ScriptedVideoModel"]


class ScriptedVideoModel(ScriptedDenoiser):
    """A fake video model: noisy frames that turn into the shape, colours and motion the prompt says.

    ``stream()`` checks its arguments with `parse_video_options`, as `VideoModel` does, so it
    refuses the same values with the same messages (and, as the fake's own rule, sides that are
    not among `sizes`: multiples of 8); the previews and the clip are encoded by the video
    family's own encoders. Each step (``delay_s`` apart) emits the estimate of every frame
    (unless ``preview="none"``; every preview mode draws the same blend), at steps 1, 1+k, ...
    for ``preview_every=k``; the final event is the clip at full size. It honours ``cancel()``
    and ``finish_early()`` within one step, and ``steer(prompt=...)`` (keywords, as the real
    model takes them) changes the shape, colours and motion from the next step.

    Example:
        >>> vm = ScriptedVideoModel(steps=3, num_frames=4, size=32)
        >>> [ev.mime for ev in vm.stream("a red circle moving left", preview_format="sheet")][-1]
        'video/webm'
    """

    #: What ``preview=None`` means (the real model's default).
    default_preview = "tiny"

    def __init__(self, steps: int = 8, num_frames: int = 8, size: int = 32, fps: float = 8.0, delay_s: float = 0.0, *,
                 name: str = "scripted-video", fail_at_step: int | None = None) -> None:
        require(is_int(steps) and steps >= 1, f"steps must be an integer >= 1, got {steps!r}")
        require(is_int(num_frames) and num_frames >= 1, f"num_frames must be an integer >= 1, got {num_frames!r}")
        require(is_int(size) and size >= 8 and size % 8 == 0, f"size must be a multiple of 8, got {size!r}")
        self.default_steps, self.default_num_frames, self.default_fps = steps, num_frames, float(fps)
        self.default_size = (size, size)
        #: The sides it makes, as a real model declares them (the server maps OpenAI's ``size`` onto them).
        self.sizes = ImageSizes(multiple=8, min_side=8, max_side=4 * size, native=(size, size), why="the fake's grid")
        self.delay_s = float(delay_s)
        self.fail_at_step = fail_at_step
        self.name = name
        self.device = "cpu"
        self.pipeline: Any = None
        self.calls: list[dict[str, Any]] = []
        self._counters = Counters()

    def stream(self, prompt: str, **options: Any) -> Stream:
        """Check the arguments now (with `parse_video_options`, as the real model does), then
        stream every frame's preview per step and the final clip."""
        o = parse_video_options(prompt, **options)
        for key in o.pipeline_kwargs:
            refuse_pipeline_argument(key, None)  # the real model hands these to its pipeline; the fake has none
        height, width = self.sizes.native_or(o.height, o.width)
        args = {
            "prompt": o.prompt, "negative_prompt": o.negative_prompt,
            "num_frames": self.default_num_frames if o.num_frames is None else o.num_frames,
            "fps": self.default_fps if o.fps is None else float(o.fps),
            "steps": self.default_steps if o.steps is None else o.steps, "seed": o.seed,
            "guidance_scale": o.guidance_scale, "height": height, "width": width,
            "preview": o.preview, "preview_every": o.preview_every, "preview_format": o.preview_format,
            "preview_max_side": o.preview_max_side, "priority": o.priority, "video_format": o.video_format,
        }  # fmt: skip
        self.calls.append(args)
        self._counters.enter()
        steering = _VideoSteers()
        return start_stream("video", lambda w: self._produce(w, args, steering), steering.handle)

    def _run(self, w: StreamWriter, a: dict[str, Any], steering: _VideoSteers) -> str:
        from PIL import Image

        from ..video import encode_clip, encode_preview

        width, height, steps, n, fps = a["width"], a["height"], a["steps"], a["num_frames"], a["fps"]
        scene = _Scene.of(a["prompt"])
        for prompt in steering.take():
            scene = scene.steered(prompt)
        target = scene.draw(width, height, n)
        rng = random.Random(a["seed"] if a["seed"] is not None else 0)
        noise = [Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)) for _ in range(n)]
        started = w.elapsed()
        eta = StepEta()
        first_preview: float | None = None
        previews = 0
        preview_bytes = 0
        step_ms: list[float] = []
        frames = noise
        step, stopped = 0, None
        for step in range(1, steps + 1):
            step_started = w.elapsed()
            pause(w, self.delay_s)
            if w.cancelled:
                stopped = "cancelled"
                break
            if w.finish_early_requested:
                stopped = "finished_early"
                break
            if self.fail_at_step is not None and step >= self.fail_at_step:
                raise RuntimeError(f"scripted failure at step {step}")
            for prompt in steering.take():
                scene = scene.steered(prompt)
                target = scene.draw(width, height, n)
            frames = [Image.blend(z, x, step / steps) for z, x in zip(noise, target)]
            eta.step(step, w.elapsed())
            if a["preview"] != "none" and (step - 1) % a["preview_every"] == 0:
                shown = _fit(frames, a["preview_max_side"])
                data, mime = encode_preview(_array(shown), a["preview_format"], fps=fps)
                pw, ph = shown[0].size
                # A preview: a slow reader gets only the newest one.
                w.emit(VideoEvent, step=step, total_steps=steps, num_frames=n, fps=fps, width=pw, height=ph,
                       mime=mime, data=data, eta_s=eta.eta(steps - step))
                first_preview = first_preview if first_preview is not None else w.elapsed()
                previews += 1
                preview_bytes += len(data)
            step_ms.append((w.elapsed() - step_started) * 1000)
            if step == steps:
                steering.close()
        if stopped is not None:
            step -= 1  # the step that was asked to stop did not run
        if stopped == "cancelled":
            # As the real model does: the newest preview of every frame, no clip (no VAE work to wait for).
            shown = _fit(frames, a["preview_max_side"])
            data, mime = encode_preview(_array(shown), a["preview_format"], fps=fps)
            w.emit(VideoEvent, step=step, total_steps=steps, num_frames=n, fps=fps, width=shown[0].width,
                   height=shown[0].height, mime=mime, data=data, is_final=True, finish_reason="cancelled", eta_s=0.0,
                   metrics={"steps": float(step), "steers": float(steering.applied),
                            "duration_ms": round((w.elapsed() - started) * 1000, 3)})
            return "cancelled"
        encoding = w.elapsed()
        data, mime = encode_clip(_array(frames), a["video_format"], fps=fps)
        # The real model's metric names, for the work the fake does too (it has no VAE to time).
        metrics = {"duration_ms": round((w.elapsed() - started) * 1000, 3), "previews": float(previews),
                   "steps": float(step), "seed": float(a["seed"] if a["seed"] is not None else 0),
                   "encode_ms": round((w.elapsed() - encoding) * 1000, 3), "bytes": float(len(data)),
                   "steers": float(steering.applied)}
        if step_ms:
            metrics["step_ms_median"] = round(statistics.median(step_ms), 3)
        if first_preview is not None:
            metrics["ttfp_ms"] = round(first_preview * 1000, 3)
            metrics["preview_bytes_mean"] = round(preview_bytes / previews, 1)
        w.emit(VideoEvent, step=step, total_steps=steps, num_frames=n, fps=fps, width=width, height=height, mime=mime,
               data=data, is_final=True, finish_reason=stopped or "stop", metrics=metrics, eta_s=0.0)
        return stopped or "stop"


def _fit(frames: list[Any], max_side: int | None) -> list[Any]:
    """The frames scaled down so their longer side is at most ``max_side`` (as the real previews are)."""
    from PIL import Image

    w, h = frames[0].size
    scale = min(1.0, max_side / max(w, h)) if max_side else 1.0
    if scale == 1.0:
        return frames
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return [f.resize(size, Image.Resampling.LANCZOS) for f in frames]


def _array(frames: list[Any]) -> Any:
    """``(F, H, W, 3)`` uint8, what the video family's encoders take."""
    import numpy as np

    return np.stack([np.asarray(f.convert("RGB")) for f in frames])


class _Scene:
    """What the fake films: one shape of the shapes vocabulary (`multistream._shapes`) on a
    background, moving as the prompt says ("moving left", ...; still when it says none), drawn as
    the embedded model's training clips are, so `multistream._shapes.judge_clip` judges it right."""

    def __init__(self, shape: str, color: str, background: str, motion: str | None) -> None:
        self.shape, self.color, self.background, self.motion = shape, color, background, motion

    @classmethod
    def of(cls, prompt: str) -> _Scene:
        return cls("circle", "red", "blue", None).steered(prompt)

    def steered(self, prompt: str) -> _Scene:
        from .._shapes import parse_video_prompt

        shape, color, background, motion = parse_video_prompt(prompt)
        return _Scene(shape or self.shape, color or self.color, background or self.background, motion or self.motion)

    def draw(self, width: int, height: int, n: int) -> list[Any]:
        from PIL import Image

        from .._shapes import MOTIONS, Scene, draw_scene

        dx, dy = MOTIONS.get(self.motion or "", (0, 0))
        travel = 0.4  # of the image side, over the whole clip: centred on the middle
        side = max(width, height)
        frames = []
        for i in range(n):
            t = i / max(1, n - 1) - 0.5
            scene = Scene(self.shape, self.color, self.background, cx=0.5 + dx * travel * t, cy=0.5 + dy * travel * t,
                          r=0.2)
            img = draw_scene(scene, side)
            frames.append(img if img.size == (width, height) else img.resize((width, height), Image.Resampling.LANCZOS))
        return frames


class _VideoSteers(SteerQueue):
    """Steer commands of one scripted video stream: ``steer(prompt=...)`` from the next step."""

    finished_message = "the clip has finished denoising; it can no longer be steered"

    def check(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        require(name == "steer", f"a video stream does not support {name}(); it takes steer(prompt=...)")
        require(not args, "a video stream's steer() takes keywords: steer(prompt='...', negative_prompt=..., "
                          "guidance_scale=...)")
        unknown = sorted(set(kwargs) - {"prompt", "negative_prompt", "guidance_scale"})
        require(not unknown, f"steer() takes prompt, negative_prompt and guidance_scale, not {unknown}")
        require(bool(kwargs), "steer() needs prompt=, negative_prompt= or guidance_scale=")
        prompt, g = kwargs.get("prompt"), kwargs.get("guidance_scale")
        require(prompt is None or (isinstance(prompt, str) and prompt.strip() != ""),
                "prompt must be a non-empty string, e.g. steer(prompt='a red circle moving left')")
        require(g is None or (is_number(g) and g >= 0), f"steer(guidance_scale=...) must be a number >= 0, got {g!r}")
        return prompt or ""
