"""OpenAI's Responses API on the server's streams and event log (the official SDK and the Agents
SDK work unchanged):

- ``POST /v1/responses``: `ResponsesRequest` (``input``, ``instructions``, ``max_output_tokens``,
  ``temperature``, ``top_p``, function ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
  ``text.format`` json_schema / json_object, ``store``, ``metadata``, ``previous_response_id``,
  ``background``, ``stream``). Streamed: the typed events (``response.created``,
  ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` / ``.done``, ``response.function_call_arguments.delta`` / ``.done``,
  ``response.output_item.done``, then ``response.completed`` / ``response.incomplete`` /
  ``response.failed``), each with its ``sequence_number`` (also the SSE ``id:``).
- ``GET /v1/responses/{id}`` (the response object now), with ``?stream=true&starting_after=N``:
  the typed events after N, replayed from the stream's log, then live.
- ``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``,
  ``GET /v1/responses/{id}/input_items`` (``order``, ``limit``, ``after``).

A response is one text stream (``resp_{stream id}``; the ``X-Stream-Id`` header names it, so the
native edit routes reach it too). Nothing but the stream's event log and the request's few fields
(kept with it: in memory, and in the stream's Redis hash with ``--event-log``) is stored: the typed
events and the response object are folded from the log again on every read (`ResponseBuilder`).
Stored responses live as long as their stream is retained (``retention_s``).

Who may read one: the API key that created it (keyed server), whoever sends its
``X-Resume-Token`` (returned on creation), or on an open server the same client address (a
response id alone is not a credential). A background response keeps generating with nobody
reading; a foreground one whose client went away gets the server's grace period, as every stream.

Example:
    >>> from openai import OpenAI                                              # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")   # doctest: +SKIP
    >>> r = client.responses.create(model="default", input="Say hi", background=True)  # doctest: +SKIP
    >>> for ev in client.responses.retrieve(r.id, stream=True, starting_after=2):   # doctest: +SKIP
    ...     print(ev.type)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import APIRouter, Depends
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....events import Event, event_from_dict
from ...access.keys import Principal
from ...durable.continuation import CONTINUED_HOOKS
from ...http.bodies import read_body, require_object
from ...http.disconnect import until_done_or_gone
from ...http.errors import json_body
from ...http.event_stream import EventStream
from ...http.problems import Problem
from ...http.sse import event_source, json_event
from ...state import ServerState, get_principal, get_state
from .._common import ERRORS, owner_allows
from .protocol import ResponsesRequest, parse_responses_body, request_view
from .serving import ResponseBuilder, output_messages

__all__ = ["ResponseEntry", "ResponseStore", "router"]

logger = logging.getLogger("multistream.server")

_PREFIX = "resp_"

router = APIRouter(tags=["openai"])


@dataclass
class ResponseEntry:
    """What a stored response keeps besides its stream's events."""

    id: str
    stream_id: str
    view: dict[str, Any]  # `request_view` + created_at: the fields the response object repeats
    messages: list[dict[str, Any]]  # the conversation it answered (history + input, no instructions)
    input_items: list[dict[str, Any]]
    owner: str | None
    owner_keyed: bool
    tools: bool
    token: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ResponseEntry:
        return cls(**json.loads(raw))


@dataclass
class ResponseStore:
    """Stored responses by id: memory (bounded like the registry), and the stream's Redis hash
    (field ``resp``) with a shared event log, so another process or a restarted server finds them."""

    state: ServerState
    entries: OrderedDict[str, ResponseEntry] = field(default_factory=OrderedDict)
    deleted: set[str] = field(default_factory=set)
    keepers: set[asyncio.Task[None]] = field(default_factory=set)

    async def put(self, entry: ResponseEntry) -> None:
        self.entries[entry.id] = entry
        while len(self.entries) > max(64, self.state.settings.max_retained_streams * 2):
            self.entries.popitem(last=False)
        log = self.state.registry.log
        if log is not None:
            try:
                await log.set_meta(entry.stream_id, "resp", entry.to_json())
            except Exception as exc:  # noqa: BLE001 - the response still works here
                logger.warning("response %s: storing it in the event log failed: %s", entry.id, exc)

    async def get(self, response_id: str) -> ResponseEntry | None:
        if not response_id.startswith(_PREFIX) or len(response_id) > 140 or response_id in self.deleted:
            return None
        entry = self.entries.get(response_id)
        log = self.state.registry.log
        if entry is None and log is not None:
            try:
                raw = await log.get_meta(response_id[len(_PREFIX):], "resp")
            except Exception as exc:  # noqa: BLE001
                from ...durable.event_log import unavailable

                raise unavailable("read stored responses", exc) from None
            if raw:
                entry = ResponseEntry.from_json(raw)
        return entry

    async def delete(self, entry: ResponseEntry) -> None:
        self.entries.pop(entry.id, None)
        self.deleted.add(entry.id)
        log = self.state.registry.log
        if log is not None:
            try:
                await log.delete_meta(entry.stream_id, "resp")
            except Exception as exc:  # noqa: BLE001
                logger.warning("response %s: deleting it from the event log failed: %s", entry.id, exc)

    def keep_running(self, record: Any) -> None:
        """A background response: one subscriber reads it to the end, so the grace period (which
        cancels a stream nobody reads) leaves it alone."""
        async def keep() -> None:
            async for _ in record.subscribe():
                pass

        task = asyncio.get_running_loop().create_task(keep(), name=f"multistream-background-{record.stream_id[:8]}")
        self.keepers.add(task)
        task.add_done_callback(self.keepers.discard)


async def _on_continued(state: ServerState, record: Any) -> None:
    """A stream continued after its server went away: a background response must run on here."""
    log = state.registry.log
    raw = await log.get_meta(record.stream_id, "resp") if log is not None else None
    if raw:
        entry = ResponseEntry.from_json(raw)
        store = responses_of(state)
        store.entries[entry.id] = entry
        if entry.view.get("background"):
            store.keep_running(record)


CONTINUED_HOOKS.append(_on_continued)


def responses_of(state: ServerState) -> ResponseStore:
    store = getattr(state, "responses", None)
    if store is None:
        store = ResponseStore(state)
        state.responses = store  # type: ignore[attr-defined]
    return store


def _not_found(response_id: str, state: ServerState) -> Problem:
    hint = "the API key that created it" if state.keyring.enabled else "its X-Resume-Token (or the client that made it)"
    return Problem(404, "response_not_found", f"no response {response_id[:80]!r} here for you: it never existed, was "
                   f"not stored (store: false), was deleted, finished more than {state.settings.retention_s:g} s ago "
                   f"(retention_s), or must be asked for with {hint}", param="response_id")


async def _owned(state: ServerState, response_id: str, request: Request, principal: Principal) -> ResponseEntry:
    entry = await responses_of(state).get(response_id)
    if entry is None or not owner_allows(entry, request, principal, state.keyring.enabled):
        raise _not_found(response_id, state)
    return entry


async def _record(state: ServerState, entry: ResponseEntry) -> Any:
    record = await state.registry.fetch(entry.stream_id)
    if record is None:
        raise Problem(404, "response_expired", f"response {entry.id} finished more than "
                      f"{state.settings.retention_s:g} s ago (retention_s); its events are gone", param="response_id")
    return record


def _events_so_far(record: Any) -> list[Event]:
    if getattr(record, "remote", False):
        return [event_from_dict(json.loads(record.json(s))) for s in sorted(record._wire)]
    return [ev for ev in record.events if ev is not None]


def _builder(entry: ResponseEntry) -> ResponseBuilder:
    return ResponseBuilder(entry.id, entry.stream_id, entry.view, tools=entry.tools)


def _fold(entry: ResponseEntry, events: list[Event]) -> dict[str, Any]:
    builder = _builder(entry)
    builder.start()
    for ev in events:
        builder.feed(ev)
    return builder.response()


def _stream_response(state: ServerState, entry: ResponseEntry, record: Any, after: int) -> EventStream:
    async def events() -> AsyncIterator[ServerSentEvent]:
        builder = _builder(entry)
        for payload in builder.start():
            if payload["sequence_number"] > after:
                yield json_event(payload, payload["type"], str(payload["sequence_number"]))
        async for ev in record.subscribe(-1):
            for payload in builder.feed(ev):
                if payload["sequence_number"] > after:
                    yield json_event(payload, payload["type"], str(payload["sequence_number"]))
            if ev.is_final:
                return

    return event_source(events(), state.settings, entry.stream_id, {"X-Resume-Token": entry.token})


async def _history(state: ServerState, previous: Any, request: Request, principal: Principal) -> list[dict[str, Any]]:
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise Problem(400, "invalid_type", "previous_response_id must be a string", param="previous_response_id")
    entry = await responses_of(state).get(previous)
    if entry is None or not owner_allows(entry, request, principal, state.keyring.enabled):
        raise Problem(404, "previous_response_not_found", f"previous response {previous[:80]!r} not found (it must "
                      "be stored, yours, and within retention_s)", param="previous_response_id")
    record = await _record(state, entry)
    if not record.done:
        raise Problem(400, "previous_response_in_progress", f"previous response {previous} is still in progress; "
                      "wait for it to finish", param="previous_response_id")
    return entry.messages + output_messages(_fold(entry, _events_so_far(record)))


def _input_items(raw: Any, stream_id: str) -> list[dict[str, Any]]:
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
    out = []
    for i, item in enumerate(items):
        item = dict(item)
        item.setdefault("type", "message")
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": "input_text" if item.get("role") != "assistant" else "output_text",
                                    "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", f"in_{stream_id}_{i}")
        out.append(item)
    return out


@router.post("/v1/responses", responses=ERRORS, openapi_extra=json_body(ResponsesRequest))
async def create_response(request: Request, state: ServerState = Depends(get_state),
                          principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    body = require_object(await read_body(request, state))
    history = await _history(state, body.get("previous_response_id"), request, principal)
    req, kwargs = parse_responses_body(body, state.settings, history)
    state.check_model_name("text", req.model)
    record = await state.open_stream("text", kwargs, priority=req.priority, request=request, arrived_at=arrived,
                                     principal=principal)
    view = {**request_view(req), "created_at": int(time.time())}
    view["model"] = view["model"] or record.model_name
    with_tools = bool(kwargs.get("tools")) and kwargs.get("tool_choice") != "none"
    messages = [m for m in kwargs["prompt"] if not (req.instructions and m is kwargs["prompt"][0])]
    entry = ResponseEntry(id=_PREFIX + record.stream_id, stream_id=record.stream_id, view=view, messages=messages,
                          input_items=_input_items(req.input, record.stream_id), owner=record.owner,
                          owner_keyed=record.owner_keyed, tools=with_tools, token=record.token)
    store = responses_of(state)
    if view["store"]:
        await store.put(entry)
    headers = {"X-Stream-Id": record.stream_id, "X-Resume-Token": record.token}
    if req.background:
        store.keep_running(record)
        if not req.stream:
            return JSONResponse(_fold(entry, _events_so_far(record)), headers=headers)
    if req.stream:
        return _stream_response(state, entry, record, -1)
    events = await _collect(record, request)
    return JSONResponse(_fold(entry, [ev for ev in events if ev is not None]), headers=headers)


async def _collect(record: Any, request: Request) -> list[Event]:
    """Every event of the stream; a client that goes away meanwhile cancels the generation."""
    async def collect() -> list[Event]:
        return [ev async for ev in record.subscribe()]

    return await until_done_or_gone(collect(), request, on_gone=record.cancel)


def _starting_after(request: Request) -> int:
    raw = request.query_params.get("starting_after")
    if raw in (None, ""):
        return -1
    if len(raw) > 20 or not raw.lstrip("-").isdigit() or int(raw) < -1:
        raise Problem(400, "invalid_argument", f"starting_after must be a sequence number (an integer >= -1), got "
                      f"{raw[:40]!r}", param="starting_after")
    return int(raw)


@router.get("/v1/responses/{response_id}", responses=ERRORS)
async def retrieve_response(response_id: str, request: Request, state: ServerState = Depends(get_state),
                            principal: Principal = Depends(get_principal)) -> Response:
    after = _starting_after(request)
    stream = request.query_params.get("stream", "false").lower() in ("true", "1")
    entry = await _owned(state, response_id, request, principal)
    record = await _record(state, entry)
    if stream:
        record.check_follower_room()
        return _stream_response(state, entry, record, after)
    return JSONResponse(_fold(entry, _events_so_far(record)), headers={"X-Stream-Id": entry.stream_id})


@router.post("/v1/responses/{response_id}/cancel", responses=ERRORS)
async def cancel_response(response_id: str, request: Request, state: ServerState = Depends(get_state),
                          principal: Principal = Depends(get_principal)) -> Response:
    entry = await _owned(state, response_id, request, principal)
    record = await _record(state, entry)
    if not record.done:
        record.cancel()
        deadline = time.monotonic() + state.settings.cancel_timeout_s + 1.0
        while not record.done and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            if getattr(record, "remote", False):
                await state.registry.log.refresh(record)
    return JSONResponse(_fold(entry, _events_so_far(record)), headers={"X-Stream-Id": entry.stream_id})


@router.delete("/v1/responses/{response_id}", responses=ERRORS)
async def delete_response(response_id: str, request: Request, state: ServerState = Depends(get_state),
                          principal: Principal = Depends(get_principal)) -> Response:
    entry = await _owned(state, response_id, request, principal)
    record = await state.registry.fetch(entry.stream_id)
    if record is not None and not record.done:
        record.cancel()
    await responses_of(state).delete(entry)
    return JSONResponse({"id": entry.id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", responses=ERRORS)
async def input_items(response_id: str, request: Request, state: ServerState = Depends(get_state),
                      principal: Principal = Depends(get_principal)) -> Response:
    entry = await _owned(state, response_id, request, principal)
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise Problem(400, "invalid_argument", f"order must be 'asc' or 'desc', got {order[:20]!r}", param="order")
    raw_limit = q.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise Problem(400, "invalid_argument", f"limit must be an integer from 1 to 100, got {raw_limit[:20]!r}",
                      param="limit")
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    after = q.get("after")
    if after:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[: int(raw_limit)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


_ = ResponsesRequest  # published in /openapi.json by the app
