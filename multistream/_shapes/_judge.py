"""Judge a generated shapes clip against its prompt, from the frames' colour masks (numpy only).

Every pixel is given the nearest palette colour (:data:`~multistream._shapes.COLORS`). The
background is the commonest colour on the frames' borders, the shape's colour the commonest of
the rest; the shape's mask in each frame gives its centroid (the track, whose displacement from
the first frames to the last is the motion) and its fill ratio (mask area over bounding-box
area: square ~1.0, circle ~0.78, triangle ~0.52, star ~0.41), which names the shape::

    >>> import numpy as np
    >>> clip = sample_clip(np.random.default_rng(0), shape="star", motion="moving up")
    >>> verdict = judge_clip(draw_clip(clip), clip_caption(clip))
    >>> verdict.ok
    True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from . import COLORS
from ._motion import MOTIONS, parse_video_prompt

__all__ = ["ClipVerdict", "classify_shape", "judge_clip", "to_frames"]

_PALETTE_NAMES = list(COLORS)
_PALETTE = np.array([COLORS[c] for c in _PALETTE_NAMES], dtype=np.float32)
# A frame shows the shape when at least this fraction of its pixels has the shape's colour
# (the smallest shape, radius 0.16 star, covers about 2.5% of the frame).
_MIN_AREA = 0.005
# The track must move at least this fraction of the frame side from the first quarter of the
# clip to the last (training clips travel 0.2 to 0.5 over the whole clip).
_MIN_TRAVEL = 0.06


@dataclass(frozen=True)
class ClipVerdict:
    """What :func:`judge_clip` saw and whether it matches the prompt.

    ``*_ok`` is ``None`` where the prompt does not name that attribute. Example:
    ``judge_clip(frames, "a red circle moving up on a blue background").motion_ok``.
    """

    color_ok: bool | None
    shape_ok: bool | None
    motion_ok: bool | None
    background_ok: bool | None
    color: str | None
    shape: str | None
    motion: str | None
    background: str
    displacement: tuple[float, float]
    visible: float
    fill: float
    track: list[tuple[float, float] | None] = field(repr=False, default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every attribute the prompt names matches."""
        checks = (self.color_ok, self.shape_ok, self.motion_ok, self.background_ok)
        return all(c is not False for c in checks)


def to_frames(frames: Sequence[Image.Image] | np.ndarray) -> np.ndarray:
    """Frames as a uint8 ``(F, H, W, 3)`` array, from PIL images or an array.

    Float arrays are read as [0, 1] (diffusers' ``output_type="np"``). Example:
    ``to_frames([Image.new("RGB", (8, 8))]).shape == (1, 8, 8, 3)``.
    """
    if isinstance(frames, np.ndarray):
        arr = frames
        if arr.ndim == 5 and arr.shape[0] == 1:
            arr = arr[0]
    else:
        arr = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"frames must be (F, H, W, 3) or a list of RGB images, got shape {arr.shape}")
    if arr.dtype != np.uint8:
        arr = (np.clip(arr.astype(np.float32), 0.0, 1.0) * 255 + 0.5).astype(np.uint8)
    return arr


def _labels(arr: np.ndarray) -> np.ndarray:
    """Index of the nearest palette colour of every pixel: ``(F, H, W)`` ints."""
    px = arr.reshape(-1, 3).astype(np.float32)
    # |p - c|^2 without the per-pixel |p|^2 term, which does not change the argmin.
    d = (_PALETTE**2).sum(1)[None, :] - 2.0 * (px @ _PALETTE.T)
    return d.argmin(1).reshape(arr.shape[:3])


def classify_shape(mask: np.ndarray) -> tuple[str | None, float]:
    """Name the shape a boolean mask shows; returns ``(shape, fill)``, ``(None, 0.0)`` if empty.

    Two features of the mask in its bounding box: the fill ratio (square ~1.0, circle ~0.78,
    triangle ~0.52, star ~0.41) and where its widest rows lie, top 0 to bottom 1 (a triangle's
    base ~1.0; a star's arms ~0.4; circle and square ~0.5). The second keeps a blurred star,
    whose fill creeps up towards a triangle's, apart from one.

    Example: ``classify_shape(np.ones((10, 10), bool))[0] == "square"``.
    """
    ys, xs = np.nonzero(mask)
    if len(ys) == 0:
        return None, 0.0
    box = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    fill = float(box.mean())
    widths = box.sum(axis=1)
    wide = np.nonzero(widths >= 0.9 * widths.max())[0]
    widest = float(wide.mean() / max(1, len(widths) - 1))
    if fill >= _SQUARE_MIN:
        return "square", fill
    if widest >= _TRIANGLE_BASE:
        return "triangle", fill
    if fill >= _CIRCLE_MIN:
        return "circle", fill
    return "star", fill


# Measured on 300 drawn clips: fill square 0.997-1.0, circle 0.75-0.80, triangle 0.51-0.55,
# star 0.40-0.45; thresholds lie between them.
_SQUARE_MIN = 0.86
_CIRCLE_MIN = 0.65
_TRIANGLE_BASE = 0.7


def judge_clip(frames: Sequence[Image.Image] | np.ndarray, prompt: str) -> ClipVerdict:
    """Judge colour, shape, background and direction of motion of a clip against ``prompt``.

    Example: ``judge_clip(pipe_output.frames[0], "a red circle moving up on a blue background").ok``.
    """
    arr = to_frames(frames)
    n, h, w = arr.shape[:3]
    want_shape, want_color, want_bg, want_motion = parse_video_prompt(prompt)
    labels = _labels(arr)
    border = np.concatenate([labels[:, 0, :], labels[:, -1, :], labels[:, :, 0], labels[:, :, -1]], axis=1)
    bg = int(np.bincount(border.ravel(), minlength=len(_PALETTE)).argmax())
    rest = labels[labels != bg]
    counts = np.bincount(rest, minlength=len(_PALETTE))
    fg = int(counts.argmax()) if counts.max() >= _MIN_AREA * h * w * n else None

    track: list[tuple[float, float] | None] = []
    shapes: list[str] = []
    fills: list[float] = []
    if fg is not None:
        for i in range(n):
            mask = labels[i] == fg
            if mask.sum() < _MIN_AREA * h * w:
                track.append(None)
                continue
            ys, xs = np.nonzero(mask)
            track.append((float(xs.mean()), float(ys.mean())))
            s, f = classify_shape(mask)
            if s is not None:
                shapes.append(s)
                fills.append(f)
    seen = [p for p in track if p is not None]
    visible = len(seen) / n

    # Direction: mean centroid of the last quarter minus that of the first quarter of the
    # frames where the shape is visible; the motion whose direction it points along, if it
    # moved far enough and mostly along that axis.
    dx = dy = 0.0
    motion = None
    if len(seen) >= 2:
        k = max(1, len(seen) // 4)
        a = np.mean(seen[:k], axis=0)
        b = np.mean(seen[-k:], axis=0)
        dx, dy = float((b[0] - a[0]) / w), float((b[1] - a[1]) / h)
        best = max(MOTIONS, key=lambda m: MOTIONS[m][0] * dx + MOTIONS[m][1] * dy)
        along = MOTIONS[best][0] * dx + MOTIONS[best][1] * dy
        across = abs(MOTIONS[best][1] * dx - MOTIONS[best][0] * dy)
        if along >= _MIN_TRAVEL and along >= 1.5 * across:
            motion = best

    color = _PALETTE_NAMES[fg] if fg is not None else None
    shape = Counter(shapes).most_common(1)[0][0] if shapes else None
    background = _PALETTE_NAMES[bg]
    return ClipVerdict(
        color_ok=None if want_color is None else color == want_color,
        shape_ok=None if want_shape is None else shape == want_shape,
        motion_ok=None if want_motion is None else motion == want_motion,
        background_ok=None if want_bg is None else background == want_bg,
        color=color,
        shape=shape,
        motion=motion,
        background=background,
        displacement=(dx, dy),
        visible=visible,
        fill=float(np.median(fills)) if fills else 0.0,
        track=track,
    )
