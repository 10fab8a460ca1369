"""Encode images (PIL, torch tensors, numpy arrays) into small compressed frames.

`encode_frame` is what turns a denoising preview or a finished image into the bytes an ``image``
event carries. Only Pillow and numpy are needed; torch tensors are accepted when torch is there.

Pixel conventions (the one place they are defined):

* a PIL image is used as it is (modes other than RGB/RGBA/L are converted to RGB);
* an integer array (``uint8``) holds 0..255;
* a float array or tensor holds values in ``value_range``, ``(0, 1)`` by default; pass
  ``value_range=(-1, 1)`` for what VAEs output. Values outside the range are clipped;
* the layout is ``HWC`` or ``CHW`` with 1, 3 or 4 channels, or ``HW`` (grey), with an optional
  leading batch axis of size 1. When both readings fit (say a 3x3x3 array), torch tensors are
  taken as ``CHW`` (torch's convention) and numpy arrays as ``HWC`` (PIL's).

Frames are only ever scaled down, keeping the aspect ratio, so that the longer side is at most
``max_side``.

Example:
    >>> import numpy as np
    >>> frame = encode_frame(np.zeros((64, 96, 3), dtype=np.uint8), format="jpeg", max_side=48)
    >>> frame.mime, frame.width, frame.height
    ('image/jpeg', 48, 32)
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["FORMATS", "EncodedFrame", "check_format", "check_quality", "encode_frame", "fit_size", "to_pil"]

#: format name -> (PIL format, MIME type); "jpg" is accepted as a synonym of "jpeg".
FORMATS: dict[str, tuple[str, str]] = {
    "jpeg": ("JPEG", "image/jpeg"),
    "webp": ("WEBP", "image/webp"),
    "png": ("PNG", "image/png"),
}
_ALIASES = {"jpg": "jpeg"}


@dataclass(frozen=True)
class EncodedFrame:
    """One encoded image: its bytes, MIME type and pixel size.

    ``encode_ms`` is how long the encoding took (downscaling included).

    Example:
        >>> f = EncodedFrame(b"abc", "image/png", 1, 1)
        >>> f.nbytes
        3
    """

    data: bytes = field(repr=False)
    mime: str
    width: int
    height: int
    encode_ms: float = 0.0

    @property
    def nbytes(self) -> int:
        """Size of the encoded data in bytes."""
        return len(self.data)


def check_format(fmt: str, what: str = "format") -> str:
    """Normalize a format name (``"JPG"`` -> ``"jpeg"``), or raise `InvalidArgumentError`."""
    if not isinstance(fmt, str):
        raise InvalidArgumentError(f"{what} must be one of {sorted(FORMATS)}, got {fmt!r}")
    name = _ALIASES.get(fmt.lower(), fmt.lower())
    if name not in FORMATS:
        raise InvalidArgumentError(f"unknown {what} {fmt!r}; use one of {sorted(FORMATS)}")
    return name


def check_quality(quality: int, what: str = "quality") -> int:
    """Check that a JPEG/WebP quality is an integer in 1..100, or raise `InvalidArgumentError`."""
    if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) or not 1 <= int(quality) <= 100:
        raise InvalidArgumentError(f"{what} must be an integer from 1 to 100, got {quality!r}")
    return int(quality)


def _is_torch_tensor(obj: Any) -> bool:
    mod = type(obj).__module__
    return mod.startswith("torch") and hasattr(obj, "detach")


def _to_hwc(arr: np.ndarray, channels_first: bool) -> np.ndarray:
    if arr.ndim == 4:
        if arr.shape[0] != 1:
            raise InvalidArgumentError(f"encode_frame takes one image, got a batch of {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim == 2:
        return arr[:, :, None]
    if arr.ndim != 3:
        raise InvalidArgumentError(f"an image must be HW, HWC or CHW, got shape {tuple(arr.shape)}")
    first, last = arr.shape[0] in (1, 3, 4), arr.shape[-1] in (1, 3, 4)
    if first and (channels_first or not last):
        return np.transpose(arr, (1, 2, 0))
    if last:
        return arr
    raise InvalidArgumentError(f"cannot tell the channel axis of an image of shape {tuple(arr.shape)}; use 1, 3 or 4 channels")


def to_pil(image: Any, value_range: Sequence[float] = (0.0, 1.0)) -> Image.Image:
    """Convert a PIL image, tensor or array (see the module's pixel conventions) to a PIL image."""
    if isinstance(image, Image.Image):
        if image.mode not in ("RGB", "RGBA", "L"):
            image = image.convert("RGB")
        return image
    channels_first = False
    if _is_torch_tensor(image):
        channels_first = True
        image = image.detach()
        if image.dtype.is_floating_point:
            image = image.float()
        image = image.cpu().numpy()
    arr = np.asarray(image)
    if arr.dtype == np.bool_:
        arr = arr.astype(np.uint8) * 255
    arr = _to_hwc(arr, channels_first)
    if arr.dtype != np.uint8:
        if np.issubdtype(arr.dtype, np.integer):
            arr = np.clip(arr, 0, 255).astype(np.uint8)
        else:
            lo, hi = float(value_range[0]), float(value_range[1])
            if not hi > lo:
                raise InvalidArgumentError(f"value_range must be (low, high) with high > low, got {tuple(value_range)}")
            scaled = (np.nan_to_num(arr.astype(np.float32), nan=lo) - lo) * (255.0 / (hi - lo))
            arr = np.clip(scaled + 0.5, 0, 255).astype(np.uint8)
    if arr.shape[2] == 1:
        return Image.fromarray(np.ascontiguousarray(arr[:, :, 0]), "L")
    return Image.fromarray(np.ascontiguousarray(arr), "RGBA" if arr.shape[2] == 4 else "RGB")


def fit_size(width: int, height: int, max_side: int | None) -> tuple[int, int]:
    """The size after scaling down (never up) so the longer side is at most ``max_side``."""
    if not max_side or max(width, height) <= max_side:
        return width, height
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def encode_frame(
    image: Any,
    format: str = "jpeg",
    quality: int = 75,
    max_side: int | None = None,
    *,
    value_range: Sequence[float] = (0.0, 1.0),
) -> EncodedFrame:
    """Encode one image to JPEG, WebP or PNG bytes, scaling it down to ``max_side`` if larger.

    ``image`` is a PIL image, a torch tensor or a numpy array (see the module docstring for the
    pixel conventions; floats are in ``value_range``, ``(0, 1)`` by default). ``quality`` (1..100)
    applies to JPEG and WebP; PNG is lossless and ignores it. Alpha is dropped for JPEG.

    Example:
        >>> from PIL import Image
        >>> f = encode_frame(Image.new("RGB", (512, 256)), format="webp", quality=60, max_side=128)
        >>> (f.mime, f.width, f.height, f.nbytes > 0)
        ('image/webp', 128, 64, True)
    """
    name = check_format(format)
    quality = check_quality(quality)
    if max_side is not None and (isinstance(max_side, bool) or not isinstance(max_side, int) or max_side < 1):
        raise InvalidArgumentError(f"max_side must be a positive integer or None, got {max_side!r}")
    started = time.perf_counter()
    pil = to_pil(image, value_range)
    size = fit_size(pil.width, pil.height, max_side)
    if size != pil.size:
        # reducing_gap makes Pillow shrink by whole factors first: several times faster, same look.
        pil = pil.resize(size, Image.Resampling.LANCZOS, reducing_gap=2.0)
    pil_format, mime = FORMATS[name]
    if name == "jpeg" and pil.mode == "RGBA":
        pil = pil.convert("RGB")
    buf = io.BytesIO()
    if name == "jpeg":
        pil.save(buf, pil_format, quality=quality)
    elif name == "webp":
        # method 2 encodes several times faster than the default 4 for nearly the same size.
        pil.save(buf, pil_format, quality=quality, method=2)
    else:
        pil.save(buf, pil_format, compress_level=6)
    return EncodedFrame(buf.getvalue(), mime, pil.width, pil.height, (time.perf_counter() - started) * 1e3)
