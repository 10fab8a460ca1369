"""Moving shapes: the clips the embedded text-to-video model is trained on.

A clip is one :class:`~multistream._shapes.Scene` (shape, colors, size, start position) plus a
motion and the distance the shape travels over the clip, at constant velocity, staying wholly
inside the frame::

    >>> import numpy as np
    >>> clip = sample_clip(np.random.default_rng(0), motion="moving right")
    >>> frames = draw_clip(clip, num_frames=16)      # 16 PIL images, 64x64 RGB
    >>> clip_caption(clip, detail=0)                 # e.g. 'a red circle moving right on a blue background'

Pure numpy/Pillow like the image data, so the judge, tests and training share one definition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image

from . import COLORS, SHAPES, Scene, all_words, draw_scene, parse_prompt, sample_scene

__all__ = [
    "MOTIONS",
    "Clip",
    "all_video_words",
    "clip_caption",
    "draw_clip",
    "judged_video_prompts",
    "make_clip_dataset",
    "parse_video_prompt",
    "sample_clip",
]

# Motion phrase -> unit direction (dx, dy) in image coordinates (y grows downwards).
MOTIONS: dict[str, tuple[int, int]] = {
    "moving left": (-1, 0),
    "moving right": (1, 0),
    "moving up": (0, -1),
    "moving down": (0, 1),
}
# Travel over the whole clip, as a fraction of the image side: at least 0.2 (13 px at 64 px)
# so the direction is unmistakable, at most 0.5, and never more than the room the shape has.
_MIN_TRAVEL, _MAX_TRAVEL = 0.2, 0.5
_MARGIN = 0.03  # same margin as sample_scene: the shape never touches the border


@dataclass(frozen=True)
class Clip:
    """A scene that moves: ``scene`` is the first frame, ``travel`` the distance to the last.

    Example: ``Clip(Scene("star", "yellow", "black", 0.3, 0.5, 0.15), "moving right", 0.4)``.
    """

    scene: Scene
    motion: str
    travel: float

    def __post_init__(self) -> None:
        if self.motion not in MOTIONS:
            raise ValueError(f"unknown motion {self.motion!r}; expected one of {tuple(MOTIONS)}")

    def at(self, t: float) -> Scene:
        """The scene at time ``t`` in [0, 1] (0 = first frame, 1 = last)."""
        dx, dy = MOTIONS[self.motion]
        s = self.scene
        return replace(s, cx=s.cx + dx * self.travel * t, cy=s.cy + dy * self.travel * t)


def sample_clip(
    rng: np.random.Generator,
    shape: str | None = None,
    color: str | None = None,
    background: str | None = None,
    motion: str | None = None,
) -> Clip:
    """Draw a random clip; any of shape/color/background/motion may be fixed.

    Example: ``sample_clip(np.random.default_rng(1), motion="moving up").motion == "moving up"``.
    """
    scene = sample_scene(rng, shape=shape, color=color, background=background)
    motion = motion or list(MOTIONS)[int(rng.integers(len(MOTIONS)))]
    if motion not in MOTIONS:
        raise ValueError(f"unknown motion {motion!r}; expected one of {tuple(MOTIONS)}")
    dx, dy = MOTIONS[motion]
    lo, hi = scene.r + _MARGIN, 1 - scene.r - _MARGIN
    room = hi - lo  # >= 0.22 for the largest radius sample_scene draws
    travel = float(rng.uniform(min(_MIN_TRAVEL, room), min(_MAX_TRAVEL, room)))
    # Start so that the whole path lies in [lo, hi] along the axis of motion.
    start = float(rng.uniform(lo, hi - travel))
    if dx:
        cx = start if dx > 0 else 1 - start
        scene = replace(scene, cx=cx)
    else:
        cy = start if dy > 0 else 1 - start
        scene = replace(scene, cy=cy)
    return Clip(scene, motion, travel)


def draw_clip(clip: Clip, num_frames: int = 16, size: int = 64) -> list[Image.Image]:
    """Render a clip to ``num_frames`` RGB images, the shape moving at constant velocity.

    Example: ``len(draw_clip(sample_clip(np.random.default_rng(0)), num_frames=16)) == 16``.
    """
    if num_frames < 2:
        raise ValueError(f"num_frames must be at least 2 to show motion, got {num_frames}")
    return [draw_scene(clip.at(i / (num_frames - 1)), size) for i in range(num_frames)]


def clip_caption(clip: Clip, rng: np.random.Generator | None = None, detail: int | None = None) -> str:
    """Describe a clip: ``detail`` 0 is color, shape, motion and background; 1 adds the size.

    No position words: the position changes over the clip. With ``detail=None`` it is drawn
    from ``rng``. Example: ``"a small red circle moving right on a blue background"``.
    """
    if detail is None:
        detail = int((rng or np.random.default_rng()).integers(2))
    s = clip.scene
    size = f"{s.size_word} " if detail >= 1 else ""
    return f"a {size}{s.color} {s.shape} {clip.motion} on a {s.background} background"


def all_video_words() -> list[str]:
    """Every word a clip caption or an image caption can contain (the video tokenizer's vocabulary)."""
    words = set(all_words())
    for m in MOTIONS:
        words.update(m.split())
    return sorted(words)


_WORD = re.compile(r"[a-z]+")


def parse_video_prompt(
    prompt: str,
) -> tuple[str | None, str | None, str | None, str | None]:
    """Return ``(shape, color, background, motion)`` a prompt asks for; ``None`` where it is silent.

    The motion is "moving" followed by a direction word.

    Example: ``parse_video_prompt("a red circle moving up on a blue background")``
    ``== ("circle", "red", "blue", "moving up")``.
    """
    shape, color, background = parse_prompt(prompt)
    words = _WORD.findall(prompt.lower())
    motion = None
    for a, b in zip(words, words[1:]):
        if a == "moving" and f"moving {b}" in MOTIONS:
            motion = f"moving {b}"
            break
    return shape, color, background, motion


def make_clip_dataset(n: int, seed: int = 0, num_frames: int = 16, size: int = 64) -> tuple[np.ndarray, list[Clip]]:
    """Render ``n`` random clips: uint8 ``(n, num_frames, size, size, 3)`` and their clips.

    Deterministic from ``seed``. Example: ``frames, clips = make_clip_dataset(4, seed=0)``.
    """
    rng = np.random.default_rng(seed)
    out = np.empty((n, num_frames, size, size, 3), dtype=np.uint8)
    clips: list[Clip] = []
    for i in range(n):
        c = sample_clip(rng)
        out[i] = np.stack([np.asarray(f) for f in draw_clip(c, num_frames, size)])
        clips.append(c)
    return out, clips


def judged_video_prompts() -> list[str]:
    """The 24 prompts the embedded video model is judged on (its test, the preview benchmark):
    every colour three times, every shape and every motion six times, never a shape on its own colour.

    Example:
        >>> judged_video_prompts()[0]
        'a red circle moving left on a yellow background'
    """
    names = list(COLORS)
    motions = list(MOTIONS)
    prompts = []
    for i in range(24):
        color = names[i % 8]
        shape = SHAPES[(i + i // 8) % 4]
        motion = motions[(i // 2 + i // 8) % 4]
        background = names[(i % 8 + 3 + i // 8) % 8]
        prompts.append(f"a {color} {shape} {motion} on a {background} background")
    return prompts
