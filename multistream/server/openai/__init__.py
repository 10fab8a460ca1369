"""The OpenAI-compatible surface, one folder per endpoint as vLLM's ``entrypoints/openai/<endpoint>``:
``protocol.py`` (the pydantic bodies and their conversion into a family's options), ``serving.py``
(a pure translator from a stream's events to the endpoint's chunks, testable without a server) and
``router.py`` (the routes). ``chat`` (with the audio chat), ``completions``, ``responses``,
``images``, ``audio`` (speech), ``videos`` and ``models``. Independent of the native surface
(`server.native`).

`router` serves them all, and `PATH_PREFIXES` are the paths that answer in OpenAI's error shape:
a new endpoint is its folder plus one entry in `ENDPOINTS`, nothing in the app.

Example:
    >>> "/v1/chat/completions" in PATH_PREFIXES
    True
"""

from fastapi import APIRouter

from . import models
from .audio import router as audio
from .chat import router as chat
from .completions import router as completions
from .images import router as images
from .responses import router as responses
from .videos import router as videos

__all__ = ["ENDPOINTS", "PATH_PREFIXES", "router"]

ENDPOINTS = (models, chat, completions, images, responses, audio, videos)

router = APIRouter()
for _endpoint in ENDPOINTS:
    router.include_router(_endpoint.router)

# Each route's path up to its first parameter ("/v1/responses/{id}" -> "/v1/responses/").
PATH_PREFIXES: tuple[str, ...] = tuple(sorted({
    route.path.split("{", 1)[0] for endpoint in ENDPOINTS for route in endpoint.router.routes}))
