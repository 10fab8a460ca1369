"""`ScriptedImageModel`: a fake image model whose previews turn noise into a red circle on blue.

Example:
    >>> from multistream.testing import ScriptedImageModel
    >>> ScriptedImageModel(steps=2, size=16).generate("a red circle").step
    2
"""

from __future__ import annotations

import math
import random
from typing import Any

from .._checks import is_int, is_number
from .._eta import StepEta
from ..errors import InvalidArgumentError
from ..events import ImageEvent
from ..image import (
    PreviewThrottle,
    check_size_multiple,
    encode_frame,
    parse_image_options,
    parse_preview,
    refuse_pipeline_argument,
)
from ..stream import Stream, StreamWriter
from ._scripted import Counters, ScriptedDenoiser, SteerQueue, pause, require, start_stream

__all__ = ["ScriptedImageModel"]


class ScriptedImageModel(ScriptedDenoiser):
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
        require(is_int(steps) and steps >= 1, f"steps must be an integer >= 1, got {steps!r}")
        w, h = (size, size) if is_int(size) else size  # type: ignore[misc]
        require(is_int(w) and is_int(h) and w >= 1 and h >= 1, f"size must be an int or (width, height), got {size!r}")
        self.default_steps = steps
        self.width, self.height = int(w), int(h)
        self.delay_s = float(delay_s)
        self.fail_at_step = fail_at_step
        self.name = name
        self.device = "cpu"
        self.pipeline: Any = None
        self.calls: list[dict[str, Any]] = []
        self._counters = Counters()

    def stream(self, prompt: str, **options: Any) -> Stream:
        """Validate the arguments now (with `parse_image_options`, as the real model does), then
        stream previews and the final image."""
        options = parse_image_options(prompt, **options)
        for key in options.pipeline_kwargs:
            refuse_pipeline_argument(key, None)  # the real model hands these to its pipeline; the fake has none
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
        return start_stream("image", lambda w: self._produce(w, args, steering), steering.handle)

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
        eta = StepEta()  # the real model's estimator, fed the fake's own step times
        first_frame: float | None = None
        previews = 0
        frame = target
        for index in range(n_images):
            noise = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
            step = 0
            stopped: str | None = None
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
                for prompt in steering.take():
                    colors = _scene_colors(prompt, colors)
                    target = _scene(width, height, colors)
                frame = Image.blend(noise, target, step / steps)
                eta.step(index * steps + step, w.elapsed())
                if a["preview"] != "none" and throttle.should_preview(step):
                    data, mime, pw, ph = _encode(frame, a["preview_format"], a["preview_quality"], a["preview_max_side"])
                    left = (n_images - index) * steps - step  # the images come one after another
                    w.image(step=step, total_steps=steps, width=pw, height=ph, mime=mime, data=data, index=index,
                            eta_s=eta.eta(left))
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
                              finish_reason=stopped or "stop", metrics=metrics,
                              eta_s=0.0 if last else eta.eta((n_images - index - 1) * steps))
            # forward() keeps finish_reason on a non-final frame and never merges it away.
            w.forward(done, is_final=last)
            if last:
                return stopped or "stop"
        return "stop"  # pragma: no cover - the loop always returns


def _scene_colors(prompt: str, current: tuple[tuple[int, int, int], tuple[int, int, int]]
                  ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(shape colour, background colour) a prompt names, e.g. "a red circle on a yellow background"."""
    from .._shapes import COLORS, parse_prompt

    _, color, background = parse_prompt(prompt)
    return (COLORS[color] if color else current[0], COLORS[background] if background else current[1])


def _scene(width: int, height: int, colors: tuple[tuple[int, int, int], tuple[int, int, int]]) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), colors[1])
    ImageDraw.Draw(img).ellipse((width * 0.2, height * 0.2, width * 0.8, height * 0.8), fill=colors[0])
    return img


class _ImageSteers(SteerQueue):
    """Steer commands of one scripted image stream: the same checks as the real model's."""

    finished_message = "the image has finished denoising, so it cannot be steered; start a new stream"

    def __init__(self, guidance_scale: float | None) -> None:
        super().__init__()
        self.guidance_scale = guidance_scale

    def check(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if name == "rewind":
            raise InvalidArgumentError(
                "image streams cannot rewind (there is no text to cut); use steer(prompt=...) to change "
                "the conditioning from the next step, or start a new stream")
        require(name == "steer", f"image streams do not support {name}()")
        changes = dict(kwargs)
        if args:
            require(len(args) == 1 and "prompt" not in changes,
                     "steer() on an image stream takes one prompt: steer(prompt='...')")
            changes["prompt"] = args[0]
        unknown = sorted(set(changes) - {"prompt", "negative_prompt", "guidance_scale"})
        require(not unknown, "image steer() takes prompt=, negative_prompt= and guidance_scale=; "
                              f"got unknown {', '.join(unknown)}")
        changes = {k: v for k, v in changes.items() if v is not None}
        require(bool(changes), "steer() needs at least one of prompt=, negative_prompt=, guidance_scale=")
        for key in ("prompt", "negative_prompt"):
            if key in changes:
                require(isinstance(changes[key], str), f"{key} must be a string, got {type(changes[key]).__name__}")
        if "prompt" in changes:
            require(changes["prompt"].strip() != "",
                     "prompt must not be empty; pass the new prompt, e.g. steer(prompt='a red circle')")
        if "guidance_scale" in changes:
            g = changes["guidance_scale"]
            require(is_number(g) and math.isfinite(g) and g >= 0,
                     f"guidance_scale must be a finite number >= 0, got {g!r}")
        return str(changes.get("prompt", ""))


def _encode(img: Any, fmt: str, quality: int, max_side: int | None) -> tuple[bytes, str, int, int]:
    frame = encode_frame(img, fmt, quality, max_side)
    return frame.data, frame.mime, frame.width, frame.height
