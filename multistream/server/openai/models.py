"""OpenAI's ``GET /v1/models`` and ``GET /v1/models/{model}``: one entry per served model, with
its family as ``kind`` and the other ``model`` names the OpenAI routes take for it (``aliases``).

Example:
    >>> httpx.get(f"{url}/v1/models").json()["data"][0]["id"]   # doctest: +SKIP
    'multistream-embedded-text'
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from starlette.responses import JSONResponse, Response

from ..families import family, served_model_names
from ..http.problems import Problem
from ..state import ServerState, get_state
from ._common import ERRORS

router = APIRouter(tags=["openai"])


def _model_entries(state: ServerState) -> list[dict[str, Any]]:
    """One entry per served model: its name as ``id``, its family as ``kind``, and the other
    ``model`` names the OpenAI routes take for it (``aliases``: "default", the family, ``tts-1``...)."""
    return [{"id": slot.name, "object": "model", "created": int(state.started_at), "owned_by": "multistream",
             "kind": kind, "state": slot.state,
             "aliases": [n for n in served_model_names(family(kind), slot.name) if n != slot.name]}
            for kind, slot in state.models.items() if slot.state != "disabled"]


@router.get("/v1/models", responses=ERRORS)
async def models(state: ServerState = Depends(get_state)) -> Response:
    return JSONResponse({"object": "list", "data": _model_entries(state)})


@router.get("/v1/models/{model:path}", responses=ERRORS)
async def model(model: str, state: ServerState = Depends(get_state)) -> Response:
    """One served model, by its name or an alias; 404 ``model_not_found`` otherwise."""
    for entry in _model_entries(state):
        if model == entry["id"] or model in entry["aliases"]:
            return JSONResponse(entry)
    served = ", ".join(repr(e["id"]) for e in _model_entries(state))
    raise Problem(404, "model_not_found", f"the model {model[:200]!r} does not exist on this server; it serves "
                  f"{served or 'no model'} (GET /v1/models lists them with their aliases)", param="model")
