"""OpenAI image generations from image events: `ImageGenerations` turns a stream's events into the
``image_generation.partial_image`` / ``image_generation.completed`` SSE payloads (streaming) or
the one response body (not); a pure translator, testable with hand-made events.

Partial images: of ``partial`` asked, the k-th goes out at the first preview at or past step
``ceil(k * total_steps / (partial + 1))`` of that image, so they spread over the run.

Example:
    >>> from multistream.events import ImageEvent
    >>> gen = ImageGenerations(num_images=1, partial=1, fmt="png")
    >>> ev = ImageEvent(stream_id="s", seq=0, t=0.0, is_final=False, step=2, total_steps=4, width=8, height=8,
    ...                 mime="image/png", data=b"x", index=0)
    >>> [name for name, _ in gen.feed(ev)]
    ['image_generation.partial_image']
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Iterable
from typing import Any

from ....events import ErrorEvent, Event, ImageEvent
from .._common import error_body

__all__ = ["ImageGenerations"]

_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
          "output_tokens": 0, "total_tokens": 0}


def _is_done(ev: ImageEvent) -> bool:
    # A finished image: the final event, or an image that ended early within a batch.
    return ev.is_final or ev.finish_reason is not None


class ImageGenerations:
    """The payloads of one image generation of ``num_images`` images as ``fmt``, with up to
    ``partial`` previews of each when streaming."""

    def __init__(self, num_images: int, partial: int, fmt: str) -> None:
        self.num_images, self.partial = num_images, partial
        self.common = {"background": "opaque", "output_format": fmt, "quality": "auto"}
        self.failed = False  # an error event came: nothing follows it
        self._sent = [0] * num_images

    def feed(self, ev: Event) -> list[tuple[str, dict[str, Any]]]:
        """``(SSE event name, payload)`` pairs for ``ev`` (an error: ``("error", body)``, and `failed` is set)."""
        if isinstance(ev, ErrorEvent):
            self.failed = True
            return [("error", error_body(ev))]
        assert isinstance(ev, ImageEvent)
        base = {**self.common, "created_at": int(time.time()), "size": f"{ev.width}x{ev.height}",
                "b64_json": base64.b64encode(ev.data).decode("ascii")}
        if _is_done(ev):
            return [("image_generation.completed", {"type": "image_generation.completed", **base, "usage": _USAGE})]
        sent = self._sent
        if ev.index < self.num_images and sent[ev.index] < self.partial and \
                ev.step >= math.ceil((sent[ev.index] + 1) * ev.total_steps / (self.partial + 1)):
            payload = {"type": "image_generation.partial_image", **base, "partial_image_index": sent[ev.index]}
            sent[ev.index] += 1
            return [("image_generation.partial_image", payload)]
        return []

    def response(self, events: Iterable[Event]) -> tuple[dict[str, Any], int]:
        """The whole response body of a run's ``events`` and its status (500 with an error's body)."""
        images: dict[int, ImageEvent] = {}
        error = None
        for ev in events:
            if isinstance(ev, ErrorEvent):
                error = ev
            elif isinstance(ev, ImageEvent) and _is_done(ev):
                images[ev.index] = ev
        if error is not None:
            return error_body(error), 500
        first = next(iter(images.values()), None)
        return {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(images[i].data).decode("ascii")} for i in sorted(images)],
            **self.common, "size": f"{first.width}x{first.height}" if first else "auto", "usage": _USAGE,
        }, 200
