"""Linear latent -> RGB maps: previews that cost one tiny matrix product per step.

A latent diffusion model denoises in the VAE's latent space. Each latent pixel is a short vector
(4 channels for SD 1.x/2.x and SDXL, 16 for SD3 and Flux) whose colour is, to a good first
approximation, a linear function of it. `LatentRGB` holds that map, ``rgb = latent @ matrix + bias``,
for *scaled* latents (the ones the denoiser sees, i.e. after the VAE's ``scaling_factor`` and
``shift_factor``), giving RGB in [-1, 1].

Where a map comes from, in order of preference (see `latent_rgb_for`):

1. a ``latent_rgb.json`` file in the model folder (``{"matrix": [[r, g, b], ...C rows], "bias": [r, g, b]}``);
2. the published map of a known family (SD 1.x/2.x, SDXL, SD3, Flux), used only when the
   pipeline's class *and* its VAE (latent channels, scaling and shift factors) match that family;
3. `fit_latent_rgb`: a least-squares fit against the VAE's own decoder, so any other model (a
   fine-tuned VAE, a new family, a random-weight test pipeline) still gets cheap previews. Fits
   are cached per VAE object.

The published values are those of ComfyUI's ``comfy/latent_formats.py`` (``latent_rgb_factors`` and
``latent_rgb_factors_bias``), which map the same scaled latents to [-1, 1].

Example:
    >>> import torch
    >>> m = PUBLISHED["sd15"]
    >>> latents_to_rgb(torch.zeros(1, 4, 8, 8), m).shape
    torch.Size([1, 3, 8, 8])
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidArgumentError, ModelLoadError

__all__ = [
    "PUBLISHED",
    "LatentRGB",
    "detect_family",
    "fit_latent_rgb",
    "latent_rgb_for",
    "latents_to_rgb",
    "latents_from_vae_space",
    "latents_to_vae_space",
    "solve_latent_rgb",
]

LATENT_RGB_FILE = "latent_rgb.json"


@dataclass(frozen=True)
class LatentRGB:
    """A linear map from ``C`` latent channels to RGB in [-1, 1]: ``rgb = latent @ matrix + bias``.

    ``source`` says where it came from (``"published:sd15"``, ``"fitted"``, ``"file:<path>"``, ...).

    Example:
        >>> LatentRGB(((1.0, 0.0, 0.0), (0.0, 1.0, 0.0)), (0.0, 0.0, 0.1)).channels
        2
    """

    matrix: tuple[tuple[float, float, float], ...]
    bias: tuple[float, float, float] = (0.0, 0.0, 0.0)
    source: str = field(default="custom", compare=False)
    _device_cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        rows = tuple(tuple(float(v) for v in row) for row in self.matrix)
        if not rows or any(len(r) != 3 for r in rows):
            raise InvalidArgumentError(f"a latent->RGB matrix must be C rows of 3 numbers, got {self.matrix!r}")
        bias = tuple(float(v) for v in self.bias)
        if len(bias) != 3:
            raise InvalidArgumentError(f"a latent->RGB bias must be 3 numbers, got {self.bias!r}")
        if not all(math.isfinite(v) for v in (*bias, *(v for r in rows for v in r))):
            raise InvalidArgumentError("a latent->RGB map must hold finite numbers only")
        object.__setattr__(self, "matrix", rows)
        object.__setattr__(self, "bias", bias)

    @property
    def channels(self) -> int:
        """Number of latent channels the map takes."""
        return len(self.matrix)

    def to_dict(self) -> dict[str, Any]:
        """The ``latent_rgb.json`` form: ``{"matrix": [[r, g, b], ...], "bias": [r, g, b]}``."""
        return {"matrix": [list(r) for r in self.matrix], "bias": list(self.bias)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "custom") -> LatentRGB:
        """Read the ``latent_rgb.json`` form (``bias`` may be left out)."""
        if not isinstance(data, dict) or "matrix" not in data:
            raise InvalidArgumentError('a latent->RGB map must be a dict with "matrix" (C x 3) and optional "bias" (3)')
        return cls(tuple(tuple(r) for r in data["matrix"]), tuple(data.get("bias") or (0.0, 0.0, 0.0)), source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LatentRGB:
        """Read a ``latent_rgb.json`` file."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read the latent->RGB map {os.fspath(path)!r}: {exc}") from exc
        return cls.from_dict(data, source=f"file:{os.fspath(path)}")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the map as a ``latent_rgb.json`` file (e.g. next to a model, to skip fitting)."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)

    def tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The matrix ``(C, 3)`` and bias ``(3,)`` as float32 tensors on ``device`` (cached)."""
        key = str(device)
        cached = self._device_cache.get(key)
        if cached is None:
            cached = (
                torch.tensor(self.matrix, dtype=torch.float32, device=device),
                torch.tensor(self.bias, dtype=torch.float32, device=device),
            )
            self._device_cache[key] = cached
        return cached


def latents_to_rgb(latents: torch.Tensor, latent_rgb: LatentRGB) -> torch.Tensor:
    """Map scaled latents ``(B, C, H, W)`` to RGB ``(B, 3, H, W)`` float32 in [0, 1], on their device.

    Example:
        >>> latents_to_rgb(torch.zeros(2, 4, 3, 5), PUBLISHED["sd15"]).shape
        torch.Size([2, 3, 3, 5])
    """
    if latents.ndim != 4 or latents.shape[1] != latent_rgb.channels:
        raise InvalidArgumentError(
            f"latents of shape {tuple(latents.shape)} do not fit a latent->RGB map of {latent_rgb.channels} channels"
        )
    matrix, bias = latent_rgb.tensors(latents.device)
    rgb = torch.einsum("bchw,cd->bdhw", latents.float(), matrix) + bias.view(1, 3, 1, 1)
    return rgb.add_(1.0).mul_(0.5).clamp_(0.0, 1.0)


# --- the VAE's latent convention -------------------------------------------------------------


def _vae_stats(config: Any, channels: int, like: torch.Tensor) -> tuple[float, float, torch.Tensor | None, torch.Tensor | None]:
    scale = float(getattr(config, "scaling_factor", None) or 1.0)
    shift = float(getattr(config, "shift_factor", None) or 0.0)
    mean = getattr(config, "latents_mean", None)
    std = getattr(config, "latents_std", None)
    if mean is not None and std is not None and len(mean) == channels and len(std) == channels:
        view = (1, channels) + (1,) * (like.ndim - 2)
        return scale, shift, (
            torch.tensor(mean, dtype=like.dtype, device=like.device).view(view)
        ), torch.tensor(std, dtype=like.dtype, device=like.device).view(view)
    return scale, shift, None, None


def latents_to_vae_space(latents: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """Undo the pipeline's latent scaling: what ``vae.decode`` takes (as diffusers pipelines do it).

    ``latents / scaling_factor + shift_factor``, or with ``latents_mean``/``latents_std`` in the
    VAE config (SDXL variants), ``latents * std / scaling_factor + mean``.
    """
    scale, shift, mean, std = _vae_stats(vae_config, latents.shape[1], latents)
    if mean is not None and std is not None:
        return latents * std / scale + mean
    return latents / scale + shift


def latents_from_vae_space(raw: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """The inverse of `latents_to_vae_space`: from ``vae.encode`` output to the denoiser's latents."""
    scale, shift, mean, std = _vae_stats(vae_config, raw.shape[1], raw)
    if mean is not None and std is not None:
        return (raw - mean) * scale / std
    return (raw - shift) * scale


# --- published maps ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    latent_rgb: LatentRGB
    channels: int
    scaling_factor: float
    shift_factor: float


def _published(name: str, matrix: list[list[float]], bias: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> LatentRGB:
    return LatentRGB(tuple(tuple(r) for r in matrix), bias, f"published:{name}")  # type: ignore[arg-type]


# Values as published in ComfyUI's comfy/latent_formats.py (latent_rgb_factors[_bias]).
_FAMILIES: dict[str, _Family] = {
    "sd15": _Family(
        _published(
            "sd15",
            [
                [0.3512, 0.2297, 0.3227],
                [0.3250, 0.4974, 0.2350],
                [-0.2829, 0.1762, 0.2721],
                [-0.2120, -0.2616, -0.7177],
            ],
        ),
        4,
        0.18215,
        0.0,
    ),
    "sdxl": _Family(
        _published(
            "sdxl",
            [
                [0.3651, 0.4232, 0.4341],
                [-0.2533, -0.0042, 0.1068],
                [0.1076, 0.1111, -0.0362],
                [-0.3165, -0.2492, -0.2188],
            ],
            (0.1084, -0.0175, -0.0011),
        ),
        4,
        0.13025,
        0.0,
    ),
    "sd3": _Family(
        _published(
            "sd3",
            [
                [-0.0922, -0.0175, 0.0749],
                [0.0311, 0.0633, 0.0954],
                [0.1994, 0.0927, 0.0458],
                [0.0856, 0.0339, 0.0902],
                [0.0587, 0.0272, -0.0496],
                [-0.0006, 0.1104, 0.0309],
                [0.0978, 0.0306, 0.0427],
                [-0.0042, 0.1038, 0.1358],
                [-0.0194, 0.0020, 0.0669],
                [-0.0488, 0.0130, -0.0268],
                [0.0922, 0.0988, 0.0951],
                [-0.0278, 0.0524, -0.0542],
                [0.0332, 0.0456, 0.0895],
                [-0.0069, -0.0030, -0.0810],
                [-0.0596, -0.0465, -0.0293],
                [-0.1448, -0.1463, -0.1189],
            ],
            (0.2394, 0.2135, 0.1925),
        ),
        16,
        1.5305,
        0.0609,
    ),
    "flux": _Family(
        _published(
            "flux",
            [
                [-0.0346, 0.0244, 0.0681],
                [0.0034, 0.0210, 0.0687],
                [0.0275, -0.0668, -0.0433],
                [-0.0174, 0.0160, 0.0617],
                [0.0859, 0.0721, 0.0329],
                [0.0004, 0.0383, 0.0115],
                [0.0405, 0.0861, 0.0915],
                [-0.0236, -0.0185, -0.0259],
                [-0.0245, 0.0250, 0.1180],
                [0.1008, 0.0755, -0.0421],
                [-0.0515, 0.0201, 0.0011],
                [0.0428, -0.0012, -0.0036],
                [0.0817, 0.0765, 0.0749],
                [-0.1264, -0.0522, -0.1103],
                [-0.0280, -0.0881, -0.0499],
                [-0.1262, -0.0982, -0.0778],
            ],
            (-0.0329, -0.0718, -0.0851),
        ),
        16,
        0.3611,
        0.1159,
    ),
}

#: The published maps by family name: ``"sd15"`` (SD 1.x and 2.x), ``"sdxl"``, ``"sd3"``, ``"flux"``.
PUBLISHED: dict[str, LatentRGB] = {name: fam.latent_rgb for name, fam in _FAMILIES.items()}


def _family_from_class(pipeline: Any) -> str | None:
    names = [cls.__name__ for cls in type(pipeline).__mro__]
    for name in names:
        if name.startswith("Flux") and not name.startswith("Flux2"):
            return "flux"
        if name.startswith("StableDiffusion3"):
            return "sd3"
        if name.startswith("StableDiffusionXL"):
            return "sdxl"
        if name.startswith("StableDiffusion") and not name.startswith("StableDiffusionUpscale"):
            return "sd15"
    return None


def detect_family(pipeline: Any) -> str | None:
    """The pipeline's family (a key of `PUBLISHED`) if its class and its VAE both match one, else None.

    The VAE check (latent channels, ``scaling_factor``, ``shift_factor``) keeps a published map off
    pipelines whose latent space differs from the family's (a custom VAE, a tiny test model).
    """
    family = _family_from_class(pipeline)
    vae = getattr(pipeline, "vae", None)
    if family is None or vae is None:
        return None
    spec = _FAMILIES[family]
    cfg = vae.config
    channels = getattr(cfg, "latent_channels", None)
    scale = float(getattr(cfg, "scaling_factor", None) or 1.0)
    shift = float(getattr(cfg, "shift_factor", None) or 0.0)
    if channels != spec.channels or abs(scale - spec.scaling_factor) > 1e-3 or abs(shift - spec.shift_factor) > 1e-3:
        return None
    if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
        return None  # e.g. Playground v2.5: SDXL-shaped but a differently normalized latent space
    return family


# --- fitting ---------------------------------------------------------------------------------

_fit_cache: weakref.WeakKeyDictionary[Any, LatentRGB] = weakref.WeakKeyDictionary()
_fit_lock = threading.Lock()


def _cached_fit(vae: Any) -> LatentRGB | None:
    with _fit_lock:
        try:
            return _fit_cache.get(vae)
        except TypeError:  # not weak-referenceable: never cached
            return None


def synthetic_images(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """Colours everywhere in the cube, in the two looks images have: smooth fields (every other
    image) or flat backgrounds, each with a few flat discs and squares with hard edges."""
    coarse = torch.rand(n, 3, 4, 4, generator=generator) * 2 - 1
    images = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False).clamp(-1, 1)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(n):
        if i % 2 == 0:
            images[i] = torch.rand(3, 1, 1, generator=generator) * 2 - 1
        for k in range(3):
            cx, cy = (torch.rand(2, generator=generator) * size).tolist()
            r = float(torch.rand(1, generator=generator)) * size / 3 + size / 10
            color = torch.rand(3, 1, 1, generator=generator) * 2 - 1
            if k % 2:
                mask = ((xx - cx).abs() < r) & ((yy - cy).abs() < r)
            else:
                mask = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
            images[i] = torch.where(mask, color, images[i])
    return images


def _decode(vae: Any, raw: torch.Tensor) -> torch.Tensor:
    out = vae.decode(raw)
    return (out.sample if hasattr(out, "sample") else out[0]).float()


def _encode(vae: Any, images: torch.Tensor) -> torch.Tensor | None:
    if getattr(vae, "encoder", None) is None or not hasattr(vae, "encode"):
        return None
    try:
        out = vae.encode(images)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError):
        return None
    dist = getattr(out, "latent_dist", None)
    if dist is not None:
        return dist.mode()  # type: ignore[no-any-return]
    latents = getattr(out, "latents", None)
    return latents if latents is not None else out[0]


def solve_latent_rgb(latents: torch.Tensor, rgb: torch.Tensor) -> LatentRGB:
    """The least-squares `LatentRGB` from latent pixels ``(N, channels)`` to RGB in [-1, 1]
    ``(N, 3)`` (rows with a non-finite value left out); what `fit_latent_rgb` and the video
    family's fit solve once they have their samples.

    Example:
        >>> lat = torch.randn(64, 4)
        >>> m = solve_latent_rgb(lat, lat[:, :3] * 0.5 + 0.1)
        >>> round(m.matrix[0][0], 3), round(m.bias[0], 3)
        (0.5, 0.1)
    """
    x, y = latents.double(), rgb.double()
    finite = torch.isfinite(x).all(1) & torch.isfinite(y).all(1)
    x, y = x[finite], y[finite]
    channels = x.shape[1]
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    # A small ridge keeps the solve stable for VAEs whose channels are nearly collinear.
    gram = design.T @ design + 1e-6 * len(x) * torch.eye(channels + 1, dtype=x.dtype)
    weights = torch.linalg.solve(gram, design.T @ y)
    return LatentRGB(
        tuple(tuple(float(v) for v in row) for row in weights[:channels].tolist()),  # type: ignore[arg-type]
        tuple(float(v) for v in weights[channels].tolist()),  # type: ignore[arg-type]
        "fitted",
    )


def fit_latent_rgb(
    vae: Any,
    *,
    num_samples: int = 6,
    latent_size: int = 16,
    noise: float = 0.35,
    seed: int = 0,
    cache: bool = True,
) -> LatentRGB:
    """Fit a latent->RGB map to a VAE by least squares on what its decoder produces.

    Synthetic colour images are encoded with ``vae`` (random latents when it has no encoder),
    their scaled latents are also perturbed with noise (``noise`` times their spread) and joined
    by unit-variance random latents (so the map holds for the noisy latents of early denoising
    steps too); all are decoded, and the decoded colours
    (averaged over each latent pixel's footprint) are regressed on the latent vectors. The result
    maps *scaled* latents (the denoiser's) to RGB in [-1, 1], like the published maps.

    Costs about ``2.5 * num_samples`` small decodes (``latent_size`` squared latents); cached per ``vae``
    object unless ``cache=False``.

    Example:
        >>> from diffusers import AutoencoderKL                                # doctest: +SKIP
        >>> m = fit_latent_rgb(AutoencoderKL.from_pretrained("path/to/vae"))   # doctest: +SKIP
        >>> m.channels                                                          # doctest: +SKIP
        4
    """
    if num_samples < 1 or latent_size < 2:
        raise InvalidArgumentError(f"fit_latent_rgb needs num_samples >= 1 and latent_size >= 2, got {num_samples}, {latent_size}")
    if cache:
        hit = _cached_fit(vae)
        if hit is not None:
            return hit
    param = next(vae.parameters())
    device, dtype = param.device, param.dtype
    channels = int(vae.config.latent_channels)
    gen = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        # The decoder's upsampling factor, measured rather than read from configs that differ per class.
        probe = _decode(vae, torch.zeros(1, channels, 2, 2, device=device, dtype=dtype))
        factor = max(1, probe.shape[-1] // 2)
        size = latent_size * factor
        images = synthetic_images(num_samples, size, gen)
        raw = _encode(vae, images.to(device=device, dtype=dtype))
        if raw is not None and raw.shape[-1] == latent_size and raw.shape[1] == channels:
            scaled = latents_from_vae_space(raw.float(), vae.config)
        else:
            scaled = torch.randn(num_samples, channels, latent_size, latent_size, generator=gen)
        scaled = scaled.cpu()
        spread = scaled.std().clamp_min(1e-3)
        noisy = scaled + noise * spread * torch.randn(scaled.shape, generator=gen)
        # Unit-variance noise too: scaling_factor exists to make the denoiser's latents about that,
        # and early steps are mostly noise; a map fitted on clean latents alone can go wild there.
        gaussian = torch.randn((max(1, num_samples // 2), *scaled.shape[1:]), generator=gen)
        samples = torch.cat([scaled, noisy, gaussian])
        decoded = _decode(vae, latents_to_vae_space(samples, vae.config).to(device=device, dtype=dtype)).cpu()
        target = F.adaptive_avg_pool2d(decoded.clamp(-1, 1), (latent_size, latent_size))
    result = solve_latent_rgb(samples.permute(0, 2, 3, 1).reshape(-1, channels),
                              target.permute(0, 2, 3, 1).reshape(-1, 3))
    if cache:
        with _fit_lock:
            _fit_cache[vae] = result
    return result


def latent_rgb_for(pipeline: Any, model_dir: str | os.PathLike[str] | None = None, *, fit: bool = True) -> LatentRGB | None:
    """Choose the latent->RGB map for a pipeline: model folder file, else published, else fitted.

    Returns None only when nothing applies and ``fit`` is False (or the pipeline has no VAE).
    """
    folders = [model_dir, getattr(getattr(pipeline, "config", None), "_name_or_path", None)]
    for folder in folders:
        if folder and os.path.isfile(os.path.join(folder, LATENT_RGB_FILE)):
            return LatentRGB.load(os.path.join(folder, LATENT_RGB_FILE))
    family = detect_family(pipeline)
    if family is not None:
        return PUBLISHED[family]
    vae = getattr(pipeline, "vae", None)
    if vae is None:
        return None
    hit = _cached_fit(vae)
    if hit is not None or not fit:
        return hit
    return fit_latent_rgb(vae)
