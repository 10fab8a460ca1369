"""The image family: diffusers pipelines that stream denoising previews.

One public face over private modules: `ImageModel` and `load_image_model` (the model),
`ImageOptions` and `parse_image_options` (the one definition of every ``ImageModel.stream()``
option, shared by the server, the Ray ingress and the scripted fakes), image checkpoints, preview
decoders and frame encoding.

Example:
    >>> from multistream.image import parse_image_options
    >>> parse_image_options("a red circle", steps=4).steps
    4
    >>> from multistream.image import load_image_model
    >>> sd = load_image_model()                                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes
from ..diffusion._sizes import EMBEDDED_IMAGE_SIZES, ImageSizes
from ._options import (
    IMAGE_STREAM_ARGS,
    PREVIEW_MODES,
    ImageOptions,
    PreviewPlan,
    PreviewThrottle,
    check_size_multiple,
    parse_image_options,
    parse_preview,
    refuse_pipeline_argument,
)

# The model modules import torch, diffusers, numpy and Pillow; they load when first asked for, so
# the options (used by the server and the fakes) stay light.
_LAZY = {
    "EMBEDDED_MODEL_DIR": "._loading",
    "load_image_model": "._loading",
    "ImageModel": "._model",
    "ImageCheckpoint": "..diffusion._checkpoint",
    "EncodedFrame": "._frames",
    "encode_frame": "._frames",
    "to_pil": "._frames",
    "fit_latent_rgb": "..diffusion._latent_rgb",
    "fit_preview_decoder": "..diffusion._preview_decoder",
}

if TYPE_CHECKING:
    from ..diffusion._checkpoint import ImageCheckpoint
    from ..diffusion._latent_rgb import fit_latent_rgb
    from ..diffusion._preview_decoder import fit_preview_decoder
    from ._frames import EncodedFrame, encode_frame, to_pil
    from ._loading import EMBEDDED_MODEL_DIR, load_image_model
    from ._model import ImageModel


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "EMBEDDED_IMAGE_SIZES",
    "EMBEDDED_MODEL_DIR",
    "IMAGE_STREAM_ARGS",
    "EncodedFrame",
    "ImageCheckpoint",
    "ImageModel",
    "ImageOptions",
    "ImageSizes",
    "PREVIEW_MODES",
    "PreviewPlan",
    "PreviewThrottle",
    "check_size_multiple",
    "encode_frame",
    "fit_latent_rgb",
    "fit_preview_decoder",
    "load_image_model",
    "parse_image_options",
    "parse_preview",
    "refuse_pipeline_argument",
    "to_pil",
]
