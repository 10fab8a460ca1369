"""The video family: diffusers text-to-video pipelines that stream every frame's preview per step.

One public face over private modules: `VideoModel` and `load_video_model` (the model),
`VideoOptions` and `parse_video_options` (the one definition of every ``VideoModel.stream()``
option, for the server and any fake), `VideoLatents` (the three latent layouts in one place) and
`fit_preview_decoder` (a tiny preview decoder for any VAE: the video one for a 3D video VAE, the
image one otherwise).

Example:
    >>> from multistream.video import parse_video_options
    >>> parse_video_options("a red circle moving right", num_frames=16).num_frames
    16
    >>> from multistream.video import load_video_model
    >>> vm = load_video_model()                                           # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._lazy import lazy_attributes
from ..diffusion._sizes import EMBEDDED_VIDEO_MAX_FRAMES, EMBEDDED_VIDEO_SIZES
from ._options import (
    PREVIEW_FORMATS,
    VIDEO_FORMATS,
    VIDEO_PREVIEW_MODES,
    VIDEO_STREAM_ARGS,
    VideoOptions,
    parse_video_options,
    refuse_pipeline_argument,
)

# The model modules import torch and diffusers; they load when first asked for, so the options
# (used by the server) stay light.
_LAZY = {
    "EMBEDDED_VIDEO_DIR": "._loading",
    "load_video_model": "._loading",
    "VideoModel": "._model",
    "VideoLatents": "._layout",
    "VideoPreviewNet": "._tiny",
    "fit_video_preview_decoder": "._tiny",
    "encode_clip": "._encode",
    "encode_preview": "._encode",
    "encode_sheet": "._encode",
}

if TYPE_CHECKING:
    from ._encode import encode_clip, encode_preview, encode_sheet
    from ._layout import VideoLatents
    from ._loading import EMBEDDED_VIDEO_DIR, load_video_model
    from ._model import VideoModel
    from ._tiny import VideoPreviewNet, fit_video_preview_decoder


def fit_preview_decoder(vae: Any, **options: Any) -> Any:
    """A tiny preview decoder fitted to ``vae``, cached per VAE: for a 3D video VAE (Wan, CogVideoX,
    LTX-Video) a `VideoPreviewNet` (``(B, C, F', h, w)`` latents -> ``(B, 3, F, H, W)`` in [0, 1]);
    for a 2D image VAE (Stable Diffusion's, AnimateDiff's) the image family's decoder
    (`multistream.image.fit_preview_decoder`). ``options`` go to the fitter.

    Example:
        >>> import multistream as ms
        >>> net = ms.fit_preview_decoder(pipe.vae)                         # doctest: +SKIP
    """
    from ._layout import VideoLatents
    from ._tiny import fit_video_preview_decoder

    try:
        is_video = not VideoLatents.for_vae(vae).per_frame
    except Exception:  # noqa: BLE001 - a VAE the video family does not know is the image family's
        is_video = False
    if is_video:
        return fit_video_preview_decoder(vae, **options)
    from ..diffusion._preview_decoder import fit_preview_decoder as fit_image

    return fit_image(vae, **options)


__getattr__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = [
    "EMBEDDED_VIDEO_DIR",
    "EMBEDDED_VIDEO_MAX_FRAMES",
    "EMBEDDED_VIDEO_SIZES",
    "PREVIEW_FORMATS",
    "VIDEO_FORMATS",
    "VIDEO_PREVIEW_MODES",
    "VIDEO_STREAM_ARGS",
    "VideoLatents",
    "VideoModel",
    "VideoOptions",
    "VideoPreviewNet",
    "encode_clip",
    "encode_preview",
    "encode_sheet",
    "fit_preview_decoder",
    "fit_video_preview_decoder",
    "load_video_model",
    "parse_video_options",
    "refuse_pipeline_argument",
]
