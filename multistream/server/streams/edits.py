"""Edits of a running stream (finish, steer, rewind), wherever it runs: here, in another server
process (through the shared event log's control channel) or on a Ray model replica.

Used by the HTTP routes, the WebSocket and the owner side of a forwarded edit alike; it takes the
server's settings and event log, not the whole server state.

Example:
    >>> from multistream.server import ServerSettings
    >>> parse_edit("rewind", {"offset": 3, "instruction": "shorter"}, ServerSettings())
    ([3], {'instruction': 'shorter'})
"""

from __future__ import annotations

from typing import Any

from ..bodies import parse_rewind_body, parse_steer_body
from ..durable.event_log import CONTROL_WAIT_S, apply_command
from ..families import family
from ..http.problems import Problem
from ..settings import ServerSettings
from .filtering import STOP

__all__ = ["apply_edit", "apply_parsed_edit", "parse_edit"]


def parse_edit(command: str, body: Any, settings: ServerSettings) -> tuple[list[Any], dict[str, Any]]:
    """Check an edit's body here (400 at once): ``(args, kwargs)`` for `Stream.steer`/`rewind`."""
    if command == "finish":
        if body not in (None, {}):
            raise Problem(400, "invalid_argument", "finish takes no arguments; send an empty body or {}")
        return [], {}
    if command == "steer":
        args, kwargs = parse_steer_body(body if body is not None else {}, settings)
        return list(args), kwargs
    if command == "rewind":
        offset, kwargs = parse_rewind_body(body if body is not None else {}, settings)
        return [offset], kwargs
    raise Problem(400, "invalid_message", f"unknown command {command!r}")  # pragma: no cover


def _filter_edit(record: Any, command: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """An edit's new text (a steer's or rewind's instruction, an image steer's prompts) goes
    through the stream's content filter, as its first input did: redacted, or a 400."""
    run = getattr(record, "input_filter", None)
    if run is None or command not in ("steer", "rewind"):
        return args, kwargs

    def filtered(text: Any, name: str) -> Any:
        if not isinstance(text, str):
            return text
        out = run(text)
        if out is STOP:
            raise Problem(400, "content_filter", f"the {command}'s {name!r} was rejected by the content filter",
                          param=name)
        return out if isinstance(out, str) else text

    if command == "steer" and args:
        args = [filtered(args[0], "instruction"), *args[1:]]
    kwargs = {k: filtered(v, k) if k in ("instruction", "prompt", "negative_prompt") else v for k, v in kwargs.items()}
    return args, kwargs


def _finished_problem(record: Any, command: str) -> Problem:
    return Problem(409, "stream_finished", f"stream {record.stream_id} has already ended, so it cannot {command}; "
                   + family(record.kind).after_end)


_PENDING_NOTE = ("forwarded to the process that runs this stream, which did not confirm within {wait:g} s; "
                 "the edit applies when it gets there (watch the stream's events: revision, offset, "
                 "finish_reason); a refusal there is not reported back")


async def apply_edit(record: Any, command: str, body: Any, settings: ServerSettings, log: Any) -> tuple[int, dict[str, Any]]:
    """Apply an edit wherever the stream runs: here, in another server process (through the
    shared event log's control channel) or on a Ray model replica. Returns ``(status, body)``:
    200 with `EditResult`, or 202 with ``pending: true`` and a ``note`` when the owner did not
    answer within ``CONTROL_WAIT_S``. Raises `Problem` (400 bad input, checked here first; 409
    ended; the owner's own 4xx verdict)."""
    args, kwargs = parse_edit(command, body, settings)
    return await apply_parsed_edit(record, command, args, kwargs, log)


async def apply_parsed_edit(record: Any, command: str, args: list[Any], kwargs: dict[str, Any],
                            log: Any) -> tuple[int, dict[str, Any]]:
    """`apply_edit` after the body was checked (the owner side of a forwarded edit starts here).
    ``log`` is the server's event log (it forwards edits of streams that run in another process)."""
    sid = record.stream_id
    args, kwargs = _filter_edit(record, command, args, kwargs)
    if record.done:
        if command == "finish":
            return 200, {"stream_id": sid, "command": command, "accepted": False}
        raise _finished_problem(record, command)
    forward = getattr(record.stream, "forward_edit", None) if not getattr(record, "remote", False) else None
    if getattr(record, "remote", False):
        answer = await log.forward_edit(record, command, args, kwargs)
        wait = CONTROL_WAIT_S
    elif forward is not None:  # a Ray ingress: the model runs on a replica
        answer = await forward(command, args, kwargs)
        wait = CONTROL_WAIT_S
    else:
        accepted = apply_command(record.stream, command, args, kwargs)
        return 200, {"stream_id": sid, "command": command, "accepted": accepted}
    if answer is None:
        return 202, {"stream_id": sid, "command": command, "accepted": True, "pending": True,
                     "note": _PENDING_NOTE.format(wait=wait)}
    if answer.get("gone"):
        if command == "finish":
            return 200, {"stream_id": sid, "command": command, "accepted": False}
        raise Problem(409, "stream_finished", f"stream {sid} is not running anywhere any more (it ended, or the "
                      f"process that ran it went away), so it cannot {command}")
    status = int(answer.get("status", 500))
    if status >= 400:
        raise Problem(status, str(answer.get("type", "error")), str(answer.get("message", "")))
    result: dict[str, Any] = {"stream_id": sid, "command": command, "accepted": bool(answer.get("accepted", True))}
    if status == 202:
        result.update(pending=True, note=_PENDING_NOTE.format(wait=wait))
    return status, result
