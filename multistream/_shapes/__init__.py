"""Procedural "shapes" scenes: the data the embedded text-to-image model is trained on.

Each scene is one flat-colored shape (circle, square, triangle or star) on a flat, differently
colored background, at a random position and size, with a caption that says what is drawn::

    >>> import numpy as np
    >>> scene = sample_scene(np.random.default_rng(0))
    >>> image = draw_scene(scene)          # PIL.Image, 64x64 RGB
    >>> caption(scene)                     # e.g. 'a red circle on a blue background'

Only Pillow and numpy are needed (no torch), so tests, the benchmark and the training script
share exactly one definition of the data.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "COLORS",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "MOTIONS",
    "Clip",
    "Scene",
    "all_video_words",
    "all_words",
    "clip_caption",
    "draw_clip",
    "judged_video_prompts",
    "make_clip_dataset",
    "parse_video_prompt",
    "sample_clip",
    "caption",
    "draw_scene",
    "make_dataset",
    "parse_prompt",
    "sample_scene",
]

# Colors are far apart in RGB so that "orange" and "yellow" stay distinguishable after a small
# latent-diffusion model has blurred them a little.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 30, 35),
    "green": (35, 170, 60),
    "blue": (35, 70, 220),
    "yellow": (245, 215, 35),
    "orange": (245, 135, 25),
    "purple": (140, 45, 175),
    "white": (240, 240, 240),
    "black": (20, 20, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
SIZES: tuple[str, ...] = ("small", "large")
# Position words for the 3x3 grid of shape centers; "center" is the middle cell.
POSITIONS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip

# Radius (half the bounding box side) as a fraction of the image side.
_SMALL = (0.16, 0.24)
_LARGE = (0.26, 0.36)
_JITTER = 10  # per-channel color noise, so judges do not rely on exact palette values


@dataclass(frozen=True)
class Scene:
    """One drawable scene; coordinates are fractions of the image side so any size renders it.

    Example: ``Scene("star", "yellow", "black", cx=0.3, cy=0.3, r=0.2)``.
    """

    shape: str
    color: str
    background: str
    cx: float
    cy: float
    r: float
    color_rgb: tuple[int, int, int] | None = None
    background_rgb: tuple[int, int, int] | None = None

    @property
    def size_word(self) -> str:
        """``"small"`` or ``"large"``, from the radius."""
        return "small" if self.r < (_SMALL[1] + _LARGE[0]) / 2 else "large"

    @property
    def position_word(self) -> str:
        """Where the center lies on a 3x3 grid, e.g. ``"top left"``."""
        col = min(int(self.cx * 3), 2)
        row = min(int(self.cy * 3), 2)
        return POSITIONS[row * 3 + col]


def _jitter(
    rgb: tuple[int, int, int], rng: np.random.Generator
) -> tuple[int, int, int]:
    noise = rng.integers(-_JITTER, _JITTER + 1, size=3)
    return tuple(int(v) for v in np.clip(np.array(rgb) + noise, 0, 255))  # type: ignore[return-value]


def sample_scene(
    rng: np.random.Generator,
    shape: str | None = None,
    color: str | None = None,
    background: str | None = None,
) -> Scene:
    """Draw a random scene; any of shape/color/background may be fixed.

    Example: ``sample_scene(np.random.default_rng(1), shape="star")``.
    """
    names = list(COLORS)
    shape = shape or SHAPES[int(rng.integers(len(SHAPES)))]
    color = color or names[int(rng.integers(len(names)))]
    if background is None:
        others = [c for c in names if c != color]
        background = others[int(rng.integers(len(others)))]
    if background == color:
        raise ValueError(f"background and shape color must differ, both are {color!r}")
    lo, hi = _SMALL if rng.random() < 0.5 else _LARGE
    r = float(rng.uniform(lo, hi))
    # Keep the whole shape inside the image, with a small margin.
    m = r + 0.03
    cx = float(rng.uniform(m, 1 - m))
    cy = float(rng.uniform(m, 1 - m))
    return Scene(
        shape, color, background, cx, cy, r,
        color_rgb=_jitter(COLORS[color], rng),
        background_rgb=_jitter(COLORS[background], rng),
    )  # fmt: skip


def _polygon(scene: Scene, side: float) -> list[tuple[float, float]]:
    cx, cy, r = scene.cx * side, scene.cy * side, scene.r * side
    if scene.shape == "triangle":
        # Equilateral, pointing up, centered on its bounding box rather than its centroid so it
        # fills the same box as the other shapes.
        h = 2 * r
        half = h / math.sqrt(3)
        return [(cx, cy - r), (cx + half, cy + r), (cx - half, cy + r)]
    if scene.shape == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.45
            a = -math.pi / 2 + i * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a) + 0.08 * r))
        return pts
    raise ValueError(f"unknown shape {scene.shape!r}; expected one of {SHAPES}")


def draw_scene(scene: Scene, size: int = 64, supersample: int = 4) -> Image.Image:
    """Render a scene to an RGB image (antialiased by supersampling).

    Example: ``draw_scene(sample_scene(np.random.default_rng(0)), size=64).size == (64, 64)``.
    """
    side = size * supersample
    fg = scene.color_rgb or COLORS[scene.color]
    bg = scene.background_rgb or COLORS[scene.background]
    img = Image.new("RGB", (side, side), bg)
    d = ImageDraw.Draw(img)
    cx, cy, r = scene.cx * side, scene.cy * side, scene.r * side
    if scene.shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif scene.shape == "square":
        s = (
            r * 0.9
        )  # a square of the same "radius" looks larger than a circle; even them out
        d.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fg)
    else:
        d.polygon(_polygon(scene, side), fill=fg)
    if supersample > 1:
        img = img.resize((size, size), Image.Resampling.BOX)
    return img


def caption(
    scene: Scene, rng: np.random.Generator | None = None, detail: int | None = None
) -> str:
    """Describe a scene in words.

    ``detail`` 0 gives color, shape and background only; 1 adds the size; 2 the position;
    3 both. With ``detail=None`` it is drawn from ``rng`` (training uses all forms so that
    short and long prompts both work).

    Example: ``caption(scene, detail=3) == "a small yellow star in the top left on a black background"``.
    """
    if detail is None:
        detail = int((rng or np.random.default_rng()).integers(4))
    size = f"{scene.size_word} " if detail in (1, 3) else ""
    pos = ""
    if detail in (2, 3):
        pos = (
            " in the center"
            if scene.position_word == "center"
            else f" in the {scene.position_word}"
        )
    return (
        f"a {size}{scene.color} {scene.shape}{pos} on a {scene.background} background"
    )


def all_words() -> list[str]:
    """Every word a caption can contain (the tokenizer's vocabulary is built from it)."""
    words = {"a", "in", "the", "on", "background"}
    words.update(COLORS, SHAPES, SIZES)
    for p in POSITIONS:
        words.update(p.split())
    return sorted(words)


_WORD = re.compile(r"[a-z]+")


def parse_prompt(prompt: str) -> tuple[str | None, str | None, str | None]:
    """Return the ``(shape, color, background)`` a prompt asks for; ``None`` where it is silent.

    The first color word is the shape's; a color followed (later) by "background" is the
    background's.

    Example: ``parse_prompt("a red circle on a blue background") == ("circle", "red", "blue")``.
    """
    words = _WORD.findall(prompt.lower())
    shape = next((w for w in words if w in SHAPES), None)
    color = background = None
    for i, w in enumerate(words):
        if w not in COLORS:
            continue
        if "background" in words[i + 1 : i + 3]:
            background = background or w
        elif color is None:
            color = w
    return shape, color, background


def make_dataset(
    n: int, seed: int = 0, size: int = 64
) -> tuple[np.ndarray, list[Scene]]:
    """Render ``n`` random scenes: a uint8 array ``(n, size, size, 3)`` and their scenes.

    Deterministic from ``seed``. Example: ``images, scenes = make_dataset(8, seed=0)``.
    """
    rng = np.random.default_rng(seed)
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    scenes: list[Scene] = []
    for i in range(n):
        s = sample_scene(rng)
        images[i] = np.asarray(draw_scene(s, size))
        scenes.append(s)
    return images, scenes


# The moving-shapes clips build on the scenes above, so they are imported last.
from ._motion import (  # noqa: E402
    MOTIONS,
    Clip,
    all_video_words,
    clip_caption,
    draw_clip,
    judged_video_prompts,
    make_clip_dataset,
    parse_video_prompt,
    sample_clip,
)
