"""`ScriptedVideoModel`: a fake video model whose previews turn noise into a moving shape.

Every step it emits the current estimate of **every** frame (a real animated WebP, or a JPEG
contact sheet with ``preview_format="sheet"``), then the final clip, a real WebM (VP9) or MP4
(H.264) made by PyAV. No torch, no weights: for fast tests of what is built on video streams
(the command line, the notebook view, the demo's Video tab, composed streams).

Example:
    >>> from multistream.testing import ScriptedVideoModel
    >>> vm = ScriptedVideoModel(steps=2, num_frames=4, size=32)
    >>> final = vm.generate("a red circle moving right on a blue background")
    >>> final.mime, final.num_frames, len(final.frames)
    ('video/webm', 4, 4)
"""

from __future__ import annotations

import io
import math
import random
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from .._checks import is_int, is_number
from .._eta import StepEta
from ..errors import StreamFinishedError
from ..events import Event, VideoEvent
from ..stream import Stream, StreamWriter
from ._scripted import CountedModel, Counters, pause, require, start_stream

__all__ = ["ScriptedVideoModel", "encode_clip", "encode_preview"]

_PREVIEWS = ("tiny", "latent", "x0", "vae", "none")
_PREVIEW_FORMATS = ("webp", "sheet")
_VIDEO_FORMATS = {"webm": ("webm", "libvpx-vp9", "video/webm"), "mp4": ("mp4", "libx264", "video/mp4")}
_MOTION = re.compile(r"\bmoving (left|right|up|down)\b")
# Where the shape's centre goes over the clip, as (dx, dy) per unit of clip time, in image sides.
_DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0), None: (0.0, 0.0)}


def encode_preview(frames: list[Any], fps: float, fmt: str, max_side: int | None,
                   quality: int = 75) -> tuple[bytes, str, int, int]:
    """Every frame as one animated WebP (``fmt="webp"``) or one JPEG contact sheet (``"sheet"``:
    ``ceil(sqrt(n))`` frames per row), scaled down to ``max_side``; ``(data, mime, width, height)``
    with one frame's size.

    Example:
        >>> from PIL import Image
        >>> data, mime, w, h = encode_preview([Image.new("RGB", (64, 64))] * 4, 8, "sheet", 32)
        >>> mime, w, h
        ('image/jpeg', 32, 32)
    """
    from PIL import Image

    first = frames[0]
    scale = min(1.0, max_side / max(first.size)) if max_side else 1.0
    size = (max(1, round(first.width * scale)), max(1, round(first.height * scale)))
    if size != first.size:
        frames = [f.resize(size, Image.Resampling.LANCZOS) for f in frames]
    out = io.BytesIO()
    if fmt == "webp":
        frames[0].save(out, format="WEBP", save_all=True, append_images=frames[1:], loop=0,
                       duration=max(1, round(1000 / fps)), quality=quality)
        return out.getvalue(), "image/webp", size[0], size[1]
    columns = math.ceil(math.sqrt(len(frames)))
    rows = math.ceil(len(frames) / columns)
    sheet = Image.new("RGB", (columns * size[0], rows * size[1]), (0, 0, 0))
    for i, frame in enumerate(frames):
        r, c = divmod(i, columns)
        sheet.paste(frame, (c * size[0], r * size[1]))
    sheet.save(out, format="JPEG", quality=quality)
    return out.getvalue(), "image/jpeg", size[0], size[1]


def encode_clip(frames: list[Any], fps: float, video_format: str = "webm") -> tuple[bytes, str]:
    """The frames as a clip through PyAV: ``"webm"`` (VP9) or ``"mp4"`` (H.264); ``(data, mime)``.

    Example:
        >>> from PIL import Image
        >>> data, mime = encode_clip([Image.new("RGB", (32, 32))] * 3, 8)
        >>> mime, data[:4] == b"\\x1aE\\xdf\\xa3"       # an EBML (Matroska/WebM) header
        ('video/webm', True)
    """
    import av

    container_format, codec, mime = _VIDEO_FORMATS[video_format]
    out = io.BytesIO()
    with av.open(out, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue(), mime


class ScriptedVideoModel(CountedModel):
    """A fake video model: noisy frames that turn into a shape moving as the prompt says.

    ``stream()`` takes `VideoModel.stream`'s arguments and refuses bad ones with an
    `InvalidArgumentError`. Each step (``delay_s`` apart) emits the estimate of every frame
    (unless ``preview="none"``; every preview mode draws the same blend), at steps 1, 1+k, ...
    for ``preview_every=k``; the final event is the clip at full size. It honours ``cancel()``
    and ``finish_early()`` within one step, and ``steer(prompt=...)`` recolours and redirects the
    shape from the next step.

    Example:
        >>> vm = ScriptedVideoModel(steps=3, num_frames=4, size=32)
        >>> [ev.mime for ev in vm.stream("a red circle moving left", preview_format="sheet")][-1]
        'video/webm'
    """

    #: What ``preview=None`` means (the real model's default).
    default_preview = "tiny"

    def __init__(self, steps: int = 8, num_frames: int = 16, fps: float = 8.0, size: int | tuple[int, int] = 64,
                 delay_s: float = 0.0, *, name: str = "scripted-video", fail_at_step: int | None = None) -> None:
        require(is_int(steps) and steps >= 1, f"steps must be an integer >= 1, got {steps!r}")
        require(is_int(num_frames) and num_frames >= 1, f"num_frames must be an integer >= 1, got {num_frames!r}")
        w, h = (size, size) if is_int(size) else size  # type: ignore[misc]
        require(is_int(w) and is_int(h) and w >= 2 and h >= 2 and w % 2 == 0 and h % 2 == 0,
                f"size must be an even int or (width, height) of even ints, got {size!r}")
        self.default_steps = steps
        self.default_num_frames = num_frames
        self.default_fps = float(fps)
        self.width, self.height = int(w), int(h)
        self.delay_s = float(delay_s)
        self.fail_at_step = fail_at_step
        self.name = name
        self.device = "cpu"
        self.pipeline: Any = None
        self.calls: list[dict[str, Any]] = []
        self._counters = Counters()

    def stream(self, prompt: str, *, num_frames: int | None = None, fps: float | None = None,
               steps: int | None = None, seed: int | None = None, guidance_scale: float | None = None,
               negative_prompt: str | None = None, preview: str | None = "tiny", preview_every: int = 1,
               preview_format: str = "webp", preview_max_side: int | None = 256, priority: int = 0,
               video_format: str = "webm") -> Stream:
        """Check the arguments now, then stream every frame's preview per step and the final clip."""
        require(isinstance(prompt, str) and prompt.strip() != "",
                "prompt must be a non-empty string, e.g. 'a red circle moving right on a blue background'")
        for key, value, minimum in (("num_frames", num_frames, 1), ("steps", steps, 1)):
            require(value is None or (is_int(value) and value >= minimum),
                    f"{key} must be an integer >= {minimum} or None, got {value!r}")
        require(fps is None or (is_number(fps) and math.isfinite(fps) and fps > 0),
                f"fps must be a number > 0 or None, got {fps!r}")
        require(seed is None or (is_int(seed) and 0 <= seed < 2**63), f"seed must be an integer in [0, 2**63), got {seed!r}")
        require(guidance_scale is None or (is_number(guidance_scale) and guidance_scale >= 0),
                f"guidance_scale must be a number >= 0, got {guidance_scale!r}")
        require(negative_prompt is None or isinstance(negative_prompt, str),
                f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}")
        mode = self.default_preview if preview is None else preview
        require(mode in _PREVIEWS, f"preview must be one of {', '.join(_PREVIEWS)}, got {preview!r}")
        require(is_int(preview_every) and preview_every >= 1, f"preview_every must be an integer >= 1, got {preview_every!r}")
        require(preview_format in _PREVIEW_FORMATS,
                f"preview_format must be 'webp' (animated) or 'sheet' (a JPEG contact sheet), got {preview_format!r}")
        require(preview_max_side is None or (is_int(preview_max_side) and preview_max_side >= 1),
                f"preview_max_side must be an integer >= 1 or None, got {preview_max_side!r}")
        require(is_int(priority), f"priority must be an integer, got {priority!r}")
        require(video_format in _VIDEO_FORMATS, f"video_format must be 'webm' or 'mp4', got {video_format!r}")
        args = {
            "prompt": prompt, "negative_prompt": negative_prompt,
            "num_frames": self.default_num_frames if num_frames is None else num_frames,
            "fps": self.default_fps if fps is None else float(fps),
            "steps": self.default_steps if steps is None else steps, "seed": seed, "guidance_scale": guidance_scale,
            "preview": mode, "preview_every": preview_every, "preview_format": preview_format,
            "preview_max_side": preview_max_side, "priority": priority, "video_format": video_format,
        }  # fmt: skip
        self.calls.append(args)
        self._counters.enter()
        steering = _VideoSteers()
        return start_stream("video", lambda w: self._produce(w, args, steering), steering.handle)

    def generate(self, prompt: str, on_event: Callable[[Event], Any] | None = None, **kwargs: Any) -> Event:
        """Stream to the end, calling ``on_event`` for each event; return the final event."""
        return self.stream(prompt, **kwargs).wait(on_event)

    def _produce(self, w: StreamWriter, a: dict[str, Any], steering: _VideoSteers) -> None:
        reason = "error"
        try:
            reason = self._run(w, a, steering)
        finally:
            steering.close()
            self._counters.leave(reason)

    def _run(self, w: StreamWriter, a: dict[str, Any], steering: _VideoSteers) -> str:
        from PIL import Image

        width, height, steps, n, fps = self.width, self.height, a["steps"], a["num_frames"], a["fps"]
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
        frames = noise
        step, stopped = 0, None
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
                scene = scene.steered(prompt)
                target = scene.draw(width, height, n)
            frames = [Image.blend(z, x, step / steps) for z, x in zip(noise, target)]
            eta.step(step, w.elapsed())
            if a["preview"] != "none" and (step - 1) % a["preview_every"] == 0:
                data, mime, pw, ph = encode_preview(frames, fps, a["preview_format"], a["preview_max_side"])
                w.forward(VideoEvent(stream_id="", seq=0, t=0.0, step=step, total_steps=steps, num_frames=n, fps=fps,
                                     width=pw, height=ph, mime=mime, data=data, eta_s=eta.eta(steps - step)))
                first_preview = first_preview if first_preview is not None else w.elapsed()
                previews += 1
            if step == steps:
                steering.close()
        if stopped is not None:
            step -= 1  # the step that was asked to stop did not run
        data, mime = encode_clip(frames, fps, a["video_format"])
        metrics = {"duration_ms": round((w.elapsed() - started) * 1000, 3), "previews": float(previews),
                   "steps": float(step), "seed": float(a["seed"] if a["seed"] is not None else 0)}
        if first_preview is not None:
            metrics["time_to_first_preview_ms"] = round(first_preview * 1000, 3)
        if steering.applied:
            metrics["steers"] = float(steering.applied)
        w.forward(VideoEvent(stream_id="", seq=0, t=0.0, step=step, total_steps=steps, num_frames=n, fps=fps,
                             width=width, height=height, mime=mime, data=data, finish_reason=stopped or "stop",
                             metrics=metrics, eta_s=0.0), is_final=True)
        return stopped or "stop"


class _Scene:
    """What the fake draws: a shape's colour on a background, moving one way over the clip."""

    def __init__(self, color: tuple[int, int, int], background: tuple[int, int, int], motion: str | None) -> None:
        self.color, self.background, self.motion = color, background, motion

    @classmethod
    def of(cls, prompt: str) -> _Scene:
        return cls((220, 30, 30), (30, 60, 200), None).steered(prompt)

    def steered(self, prompt: str) -> _Scene:
        from .._shapes import COLORS, parse_prompt

        _, color, background = parse_prompt(prompt)
        motion = _MOTION.search(prompt.lower())
        return _Scene(COLORS[color] if color else self.color, COLORS[background] if background else self.background,
                      motion.group(1) if motion else self.motion)

    def draw(self, width: int, height: int, n: int) -> list[Any]:
        from PIL import Image, ImageDraw

        dx, dy = _DIRECTIONS[self.motion]
        out = []
        for i in range(n):
            progress = i / max(1, n - 1) - 0.5  # -0.5 .. 0.5 over the clip
            cx, cy = width * (0.5 + 0.5 * dx * progress), height * (0.5 + 0.5 * dy * progress)
            r = min(width, height) * 0.2
            img = Image.new("RGB", (width, height), self.background)
            ImageDraw.Draw(img).ellipse((cx - r, cy - r, cx + r, cy + r), fill=self.color)
            out.append(img)
        return out


class _VideoSteers:
    """Steer commands of one scripted video stream: ``steer(prompt=...)`` from the next step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[str] = []
        self.applied = 0
        self.closed = False

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        require(name == "steer", f"video streams do not support {name}(); use steer(prompt=...) or start a new stream")
        changes = dict(kwargs)
        if args:
            require(len(args) == 1 and "prompt" not in changes, "steer() on a video stream takes one prompt: steer(prompt='...')")
            changes["prompt"] = args[0]
        unknown = sorted(set(changes) - {"prompt", "negative_prompt", "guidance_scale"})
        require(not unknown, f"video steer() takes prompt=, negative_prompt= and guidance_scale=; got unknown {', '.join(unknown)}")
        prompt = changes.get("prompt")
        require(prompt is None or (isinstance(prompt, str) and prompt.strip() != ""),
                "prompt must be a non-empty string, e.g. steer(prompt='a red circle moving left')")
        with self._lock:
            if self.closed:
                raise StreamFinishedError("the clip has finished denoising, so it cannot be steered; start a new stream")
            self._queue.append(prompt or "")

    def take(self) -> list[str]:
        with self._lock:
            taken, self._queue = self._queue, []
        self.applied += len(taken)
        return [p for p in taken if p]

    def close(self) -> None:
        with self._lock:
            self.closed = True

