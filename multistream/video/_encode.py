"""Frames to bytes: an animated WebP or a JPEG contact sheet per preview, a VP9 or H.264 clip at the end.

Frames are ``(F, H, W, 3)`` uint8 arrays. Previews use Pillow; the clip uses PyAV (the ``video``
extra): ``webm`` is VP9 (libvpx, BSD-licensed), ``mp4`` is H.264 through the x264 that PyAV's
wheels bundle (GPL; see the README). The contact sheet puts ``ceil(sqrt(F))`` frames in a row,
left to right, top to bottom, as `multistream.events.VideoEvent.frames` reads it back.

Example:
    >>> import numpy as np
    >>> frames = np.zeros((4, 8, 8, 3), np.uint8)
    >>> data, mime = encode_preview(frames, "sheet", fps=8)
    >>> mime
    'image/jpeg'
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ._options import PREVIEW_FORMATS, VIDEO_FORMATS

__all__ = ["contact_sheet", "encode_clip", "encode_preview", "encode_sheet"]


def contact_sheet(frames: np.ndarray) -> np.ndarray:
    """All frames on one grid, ``ceil(sqrt(F))`` per row (unused cells black)."""
    if len(frames) == 0:
        raise ValueError("a contact sheet needs at least one frame")
    count, h, w, _ = frames.shape
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    sheet = np.zeros((rows * h, columns * w, 3), np.uint8)
    for i in range(count):
        r, c = divmod(i, columns)
        sheet[r * h : (r + 1) * h, c * w : (c + 1) * w] = frames[i]
    return sheet


def encode_sheet(frames: Sequence[Any] | np.ndarray, fmt: str = "JPEG", *, quality: int = 90) -> bytes:
    """``frames`` (PIL images of one size, or ``(F, H, W, 3)`` uint8) as one `contact_sheet` picture
    in Pillow's ``fmt``: what the CLI's ``--sheet``, OpenAI's ``spritesheet`` variant and a
    ``preview_format="sheet"`` preview all are.

    Example:
        >>> from PIL import Image
        >>> data = encode_sheet([Image.new("RGB", (8, 8))] * 5, "PNG")
        >>> Image.open(io.BytesIO(data)).size
        (24, 16)
    """
    from PIL import Image

    if not isinstance(frames, np.ndarray):
        if not frames:
            raise ValueError("a contact sheet needs at least one frame")
        frames = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    buf = io.BytesIO()
    Image.fromarray(contact_sheet(frames)).save(buf, format=fmt, **({"quality": quality} if fmt in ("JPEG", "WEBP") else {}))
    return buf.getvalue()


def encode_preview(frames: np.ndarray, fmt: str, *, fps: float, quality: int = 70) -> tuple[bytes, str]:
    """One preview of every frame: ``("webp")`` an animated WebP looping at ``fps``, or ``("sheet")``
    a JPEG contact sheet. Returns ``(data, mime)``."""
    from PIL import Image

    buf = io.BytesIO()
    if fmt == "webp":
        images = [Image.fromarray(f) for f in frames]
        images[0].save(buf, format="WEBP", save_all=True, append_images=images[1:], duration=round(1000 / fps),
                       loop=0, quality=quality, method=0)
    elif fmt == "sheet":
        buf.write(encode_sheet(frames, "JPEG", quality=quality))
    else:
        raise InvalidArgumentError(f"unknown preview_format={fmt!r}; use one of {list(PREVIEW_FORMATS)}")
    return buf.getvalue(), PREVIEW_FORMATS[fmt]


def encode_clip(frames: np.ndarray, fmt: str, *, fps: float) -> tuple[bytes, str]:
    """The finished clip: ``"webm"`` (VP9) or ``"mp4"`` (H.264, yuv420p). Returns ``(data, mime)``.

    Odd sides are padded by one pixel for the 4:2:0 codecs (a tiny model's 9-pixel-wide clip still
    encodes)."""
    try:
        import av
    except ImportError as exc:  # pragma: no cover - av ships with the video extra
        raise ImportError("encoding a video clip needs PyAV: pip install 'multistream[video]'") from exc
    if fmt not in VIDEO_FORMATS:
        raise InvalidArgumentError(f"unknown video_format={fmt!r}; use one of {list(VIDEO_FORMATS)}")
    count, h, w, _ = frames.shape
    if h % 2 or w % 2:
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
        h, w = frames.shape[1:3]
    rate = Fraction(fps).limit_denominator(1001)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream("libvpx-vp9" if fmt == "webm" else "libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        # Quality-targeted rate control: a small clip stays small, a large one stays sharp.
        stream.options = {"crf": "32", "b": "0", "deadline": "realtime", "cpu-used": "8", "row-mt": "1"} if fmt == "webm" \
            else {"crf": "20", "preset": "veryfast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue(), VIDEO_FORMATS[fmt]
