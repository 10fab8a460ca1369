"""The OpenAI images body (``POST /v1/images/generations``) and its conversion into `ImageOptions`.

Example:
    >>> from multistream.server import ServerSettings
    >>> kwargs, priority, stream, partial, fmt = image_kwargs({"prompt": "a red circle", "size": "64x64"},
    ...                                                       ServerSettings())
    >>> kwargs["width"], kwargs["height"], fmt
    (64, 64, 'png')
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field, create_model

from ....image import ImageOptions
from ...bodies import check_family_options, check_image_limits
from ...http.bodies import LAX_BODY, validate_body
from ...http.problems import Problem
from ...settings import ServerSettings
from .._common import openai_size
from .._protocol import given_options, option_fields, unsupported


class _ImageGenerationBase(BaseModel):
    """``POST /v1/images/generations`` (OpenAI)."""

    model_config = LAX_BODY
    prompt: str = Field(description="a string describing the image")
    model: Optional[str] = Field(default=None, description="the served image model: its name, \"default\", \"image\", gpt-image-1 or dall-e-2/3; another name is 404 model_not_found")
    n: Optional[int] = Field(default=None, description="an integer >= 1: images")
    size: Optional[str] = Field(default=None, description="'WIDTHxHEIGHT' (e.g. '64x64', one the model can make: "
                                "a 400 names them); null or 'auto': the model's native size")
    stream: Optional[bool] = Field(default=None, description="true: server-sent events")
    partial_images: Optional[int] = Field(default=None, description="0..3 previews when streaming")
    response_format: Optional[str] = Field(default=None, description="only 'b64_json'")
    output_format: Optional[str] = Field(default=None, description="'png', 'jpeg' or 'webp'")
    quality: Optional[str] = Field(default=None, description="accepted and ignored")
    background: Optional[str] = Field(default=None, description="accepted and ignored")
    output_compression: Optional[int] = Field(default=None, description="accepted and ignored")
    moderation: Optional[str] = Field(default=None, description="accepted and ignored")
    user: Optional[str] = Field(default=None, description="accepted and ignored")
    style: Optional[str] = Field(default=None, description="accepted and ignored")

    def to_image_options(self, fmt: str, previews: bool, sizes: Any = None) -> dict[str, Any]:
        """``ImageModel.stream`` keyword arguments (the prompt and `ImageOptions`): OpenAI's names
        (``n``, ``size``, ``output_format``) mapped onto ours, and every field with an
        `ImageOptions` namesake passed as it is. ``previews``: stream partial images (as
        ``fmt``, full size) or none. ``sizes``: the served model's (`ImageModel.sizes`), so a
        ``size`` it cannot make is a 400 about ``size``; the model checks the other values."""
        kwargs: dict[str, Any] = {"prompt": self.prompt, "num_images": self.n if self.n is not None else 1,
                                  "final_format": fmt}
        if self.size not in (None, "auto"):
            kwargs["width"], kwargs["height"] = openai_size(self.size, sizes, "image")
        kwargs.update(given_options(self, tuple(n for n in IMAGE_OPTION_FIELDS if n != "priority")))
        if previews:
            kwargs["preview_format"] = fmt
            if "width" in kwargs:
                kwargs["preview_max_side"] = max(kwargs["width"], kwargs["height"])
        else:
            kwargs["preview"] = "none"
        return kwargs


# The OpenAI image fields that have an `ImageOptions` namesake (all extensions of OpenAI's body),
# with its type and description: declared once, in the spec. Each defaults to null (the model's own
# default), except priority, whose default is the spec's.
IMAGE_OPTION_FIELDS = ("steps", "seed", "guidance_scale", "negative_prompt", "priority")
# Our options that OpenAI's images body spells otherwise: a 400 names them as the client sent them.
OPENAI_IMAGE_NAMES = {"num_images": "n"}


ImageGenerationRequest = create_model(
    "ImageGenerationRequest", __base__=_ImageGenerationBase, __doc__=_ImageGenerationBase.__doc__,
    **option_fields(ImageOptions, IMAGE_OPTION_FIELDS, IMAGE_OPTION_FIELDS))


def image_kwargs(body: Any, settings: ServerSettings, sizes: Any = None) -> tuple[dict[str, Any], int, bool, int, str]:
    """OpenAI images body -> (ImageModel.stream kwargs, priority, stream?, partial_images, output_format);
    ``sizes``: the served model's, when it declares them."""
    req = validate_body(ImageGenerationRequest, body, "POST /v1/images/generations")
    assert isinstance(req, ImageGenerationRequest)
    if req.response_format not in (None, "b64_json"):
        raise unsupported("response_format", "only response_format 'b64_json' is supported (this server keeps no "
                           "files)")
    fmt = req.output_format or "png"
    if fmt not in ("png", "jpeg", "webp"):
        raise Problem(400, "invalid_argument", f"output_format must be png, jpeg or webp, got {fmt[:20]!r}",
                      param="output_format")
    partial = req.partial_images or 0
    if not 0 <= partial <= 3:
        raise Problem(400, "invalid_argument", f"partial_images must be 0..3, got {partial}", param="partial_images")
    stream = bool(req.stream)
    kwargs = req.to_image_options(fmt, stream and partial > 0, sizes)
    check_image_limits(kwargs, settings)
    # The family's own checks now: open_stream runs the model's only once a slot is free, so a bad
    # option (steps=0) waited in the queue for its 400.
    check_family_options("image", kwargs)
    return kwargs, req.priority, stream, partial, fmt
