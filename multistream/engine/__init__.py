"""Engines: one thread per loaded model that owns all of that model's torch work.

`Engine` is the model-family-agnostic part: the thread, the inbox of new requests, closing (also
on garbage collection and interpreter exit) and fault isolation. What one step means is a
*backend*'s business: `TextBatcher` runs one batched forward for every active text request
(continuous batching), `ImageStepper` runs one denoising step of the request that comes first by
priority (step-level interleaving), together with same-priority requests whose UNet calls it
batches (`denoiser_batch`). `EngineModel` is the base of every engine-backed model class (its
``engine``, ``close()``, ``with``, closing on collection).

Example:
    >>> import multistream as ms
    >>> llm = ms.load_text_model(max_batch=16)        # doctest: +SKIP
    >>> a, b = llm.stream("Hi"), llm.stream("Hello")  # doctest: +SKIP  (share batched forwards)
    >>> llm.close()                                   # doctest: +SKIP  (ends the engine thread)
"""

from __future__ import annotations

from .core import DEFAULT_CAPACITY, Backend, Engine, capacity_of
from .model import ENGINE_CLOSE_TIMEOUT, EngineModel

__all__ = ["DEFAULT_CAPACITY", "ENGINE_CLOSE_TIMEOUT", "Backend", "Engine", "EngineModel", "capacity_of"]
