"""encode_frame: formats, sizes, pixel conventions and errors (Pillow and numpy; torch optional)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import multistream as ms
from multistream.image._frames import EncodedFrame, check_format, encode_frame, fit_size, to_pil


def _decode(frame: EncodedFrame) -> Image.Image:
    img = Image.open(io.BytesIO(frame.data))
    img.load()
    return img


@pytest.mark.parametrize(
    ("fmt", "mime", "pil_format"),
    [("jpeg", "image/jpeg", "JPEG"), ("jpg", "image/jpeg", "JPEG"), ("webp", "image/webp", "WEBP"), ("png", "image/png", "PNG")],
)
def test_formats_and_mime(fmt: str, mime: str, pil_format: str) -> None:
    frame = encode_frame(Image.new("RGB", (40, 30), (200, 10, 10)), format=fmt)
    assert frame.mime == mime
    assert (frame.width, frame.height) == (40, 30)
    assert frame.nbytes == len(frame.data) > 0
    img = _decode(frame)
    assert img.format == pil_format and img.size == (40, 30)


def test_downscale_only_keeps_aspect() -> None:
    big = encode_frame(np.zeros((300, 600, 3), dtype=np.uint8), format="png", max_side=128)
    assert (big.width, big.height) == (128, 64)
    assert _decode(big).size == (128, 64)
    small = encode_frame(np.zeros((30, 60, 3), dtype=np.uint8), format="png", max_side=128)
    assert (small.width, small.height) == (60, 30)  # never scaled up
    assert fit_size(1000, 10, 100) == (100, 1)


def test_png_is_lossless() -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(17, 23, 3), dtype=np.uint8)
    frame = encode_frame(pixels, format="png")
    assert np.array_equal(np.asarray(_decode(frame)), pixels)


def test_quality_changes_jpeg_size() -> None:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    low = encode_frame(pixels, format="jpeg", quality=10)
    high = encode_frame(pixels, format="jpeg", quality=95)
    assert low.nbytes < high.nbytes


def test_float_ranges_and_layouts() -> None:
    torch = pytest.importorskip("torch")
    chw01 = torch.zeros(3, 8, 12)
    chw01[0] = 1.0  # pure red in [0, 1]
    assert to_pil(chw01).getpixel((0, 0)) == (255, 0, 0)
    chw11 = chw01 * 2 - 1  # the same in [-1, 1]
    assert to_pil(chw11, value_range=(-1, 1)).getpixel((0, 0)) == (255, 0, 0)
    hwc = np.zeros((8, 12, 3), dtype=np.float32)
    hwc[..., 2] = 1.0
    assert to_pil(hwc).getpixel((0, 0)) == (0, 0, 255)
    assert to_pil(hwc).size == (12, 8)
    batched = torch.ones(1, 3, 4, 5) * 0.5
    assert to_pil(batched).getpixel((0, 0)) == (128, 128, 128)
    grey = to_pil(np.full((4, 4), 255, dtype=np.uint8))
    assert grey.mode == "L"
    clipped = to_pil(np.full((2, 2, 3), 7.0, dtype=np.float32))
    assert clipped.getpixel((0, 0)) == (255, 255, 255)


def test_rgba_becomes_rgb_for_jpeg() -> None:
    frame = encode_frame(Image.new("RGBA", (10, 10), (1, 2, 3, 4)), format="jpeg")
    assert _decode(frame).mode == "RGB"
    assert _decode(encode_frame(Image.new("RGBA", (10, 10)), format="png")).mode == "RGBA"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"format": "gif"}, "unknown format"),
        ({"quality": 0}, "quality must be an integer from 1 to 100"),
        ({"quality": 101}, "quality must be"),
        ({"max_side": 0}, "max_side must be a positive integer"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ms.InvalidArgumentError, match=match):
        encode_frame(np.zeros((4, 4, 3), dtype=np.uint8), **kwargs)


def test_bad_images() -> None:
    with pytest.raises(ms.InvalidArgumentError, match="batch of 2"):
        encode_frame(np.zeros((2, 4, 4, 3), dtype=np.uint8))
    with pytest.raises(ms.InvalidArgumentError, match="channel axis"):
        encode_frame(np.zeros((5, 4, 7), dtype=np.uint8))
    assert check_format("JPG") == "jpeg"


def test_public_name() -> None:
    assert ms.encode_frame is encode_frame
