"""Tool calls: the ``tools=`` / ``tool_choice=`` checks, how tools reach the prompt, the grammar a
call is generated under, and the parser that reads calls back out of the text (incrementally, for
OpenAI's streamed ``tool_calls`` deltas, and at the end, for the final event's ``tool_calls``).

A call is written in one format whatever the model (the Hermes / Qwen one most tool-trained
templates teach)::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

and generated under a grammar: the name is one of the tools, the arguments follow that tool's
``parameters`` schema (`tools_grammar`). Models whose chat template renders ``tools`` get them
through the template; the others get `TOOLS_SYSTEM_PROMPT` (see docs/constrained.md).

Torch-free: the server reads calls with `ToolCallParser`.

Example:
    >>> parser = ToolCallParser("s1")
    >>> items = parser.feed('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    >>> [i[0] for i in items], parser.calls
    (['call', 'arguments'], [{'id': 'call_s1_0', 'name': 'f', 'arguments': '{"x": 1}'}])
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import InvalidArgumentError
from ._schemas import JSON_LAYOUT, check_schema_value

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "TOOLS_SYSTEM_PROMPT",
    "ToolCallParser",
    "check_tool_choice",
    "check_tools",
    "parse_tool_calls",
    "render_tool_messages",
    "tools_grammar",
]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

TOOLS_SYSTEM_PROMPT = """You can call these tools (function signatures in JSON Schema):
<tools>
{tools}
</tools>
To call a tool, answer with one line per call:
<tool_call>{{"name": "<tool name>", "arguments": <the arguments as a JSON object>}}</tool_call>
To answer without a tool, write the answer as plain text."""

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _loads(v: Any, what: str) -> Any:
    if isinstance(v, str):  # the canonical form TextOptions stores (and JSON text)
        try:
            return json.loads(v)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{what} is a string but not JSON: {exc}") from exc
    return v


def check_tools(v: Any) -> str | None:
    """``tools=`` checked: OpenAI's list of ``{"type": "function", "function": {"name",
    "description", "parameters"}}``; returned as canonical JSON text (None for no tools)."""
    v = _loads(v, "tools")
    if v is None or (isinstance(v, (list, tuple)) and not v):
        return None
    if not isinstance(v, (list, tuple)):
        raise InvalidArgumentError(
            'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}, '
            f"got {type(v).__name__}")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
                tool.get("function"), dict):
            raise InvalidArgumentError(
                f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}, '
                f"got {str(tool)[:120]}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in names:
            raise InvalidArgumentError(f"{where}.function.name {name!r} is used twice; tool names must be unique")
        names.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidArgumentError(f"{where}.function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        check_schema_value(parameters, f"{where}.function.parameters")
        entry: dict[str, Any] = {"name": name}
        if description:
            entry["description"] = description
        entry["parameters"] = parameters
        out.append({"type": "function", "function": entry})
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def check_tool_choice(v: Any) -> str | dict[str, Any] | None:
    """``tool_choice=``: "none", "auto", "required" or ``{"type": "function", "function": {"name"}}``."""
    if v is None or v in ("none", "auto", "required"):
        return v  # type: ignore[no-any-return]
    if isinstance(v, dict) and v.get("type", "function") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str):
        return {"type": "function", "function": {"name": v["function"]["name"]}}
    raise InvalidArgumentError(
        "tool_choice must be 'none', 'auto', 'required' or "
        f'{{"type": "function", "function": {{"name": "..."}}}}, got {str(v)[:120]}')


def tool_list(tools: str | None) -> list[dict[str, Any]]:
    return json.loads(tools) if tools else []


def chosen_name(tool_choice: Any) -> str | None:
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def tools_active(tools: str | None, tool_choice: Any) -> bool:
    """Tools are offered (rendered and allowed): some are given and the choice is not "none"."""
    return bool(tools) and tool_choice != "none"


def check_tool_options(tools: str | None, tool_choice: Any, allowed: str | None) -> None:
    """The checks that span options (called by `TextOptions`)."""
    if tool_choice not in (None, "none", "auto") and not tools:
        raise InvalidArgumentError(f"tool_choice={tool_choice!r} needs tools=[...] to choose from", param="tool_choice")
    name = chosen_name(tool_choice)
    if name is not None and name not in {t["function"]["name"] for t in tool_list(tools)}:
        known = ", ".join(t["function"]["name"] for t in tool_list(tools))
        raise InvalidArgumentError(f"tool_choice names the function {name!r}, which is not in tools ({known})",
                                   param="tool_choice")
    if allowed is not None and tools_active(tools, tool_choice):
        raise InvalidArgumentError("allowed= and tools= cannot constrain one answer together; give one of them",
                                   param="allowed")


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_LAYOUT,
    }


def tools_grammar(tools: str, tool_choice: Any, parallel: bool | None, answer_schema: str | None) -> str:
    """The Lark grammar (llguidance's dialect) of an answer given tools.

    ``"required"`` or a named function: only calls; ``"auto"`` (or None): calls, or an answer
    (free text that does not start with a call, or JSON for ``answer_schema`` when one is given).
    Each tool's arguments are its own ``%json`` schema, so its ``$ref``s stay valid.
    """
    fns = [t["function"] for t in tool_list(tools)]
    name = chosen_name(tool_choice)
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
    rules = [f"call_{i}: %json {json.dumps(_call_schema(fn), ensure_ascii=False)}" for i, fn in enumerate(fns)]
    calls = "calls: call (\"\\n\" call)*" if parallel is not False else "calls: call"
    body = " | ".join(f"call_{i}" for i in range(len(fns)))
    lines = [calls, f'call: "{CALL_OPEN}" ({body}) "{CALL_CLOSE}"', *rules]
    if tool_choice in (None, "auto"):
        if answer_schema is not None:
            schema = json.loads(answer_schema)
            schema.setdefault("x-guidance", JSON_LAYOUT)
            lines.append(f"answer: %json {json.dumps(schema, ensure_ascii=False)}")
        else:
            lines.append("answer: ANSWER")
            # Any text, except text that starts like a call (a call must follow its grammar).
            lines.append(r"ANSWER: /(?s:.+)/ & ~/<tool_call>(?s:.*)/")
        start = "start: calls | answer"
    else:
        start = "start: calls"
    return "\n".join([start, *lines]) + "\n"


def _arguments_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    arguments = _arguments_dict(fn.get("arguments", {}))
    body = {"name": fn.get("name"), "arguments": arguments}
    return f"{CALL_OPEN}{json.dumps(body, ensure_ascii=False, separators=(', ', ': '))}{CALL_CLOSE}"


def render_tool_messages(messages: list[dict[str, Any]], tools: str | None, template_has_tools: bool,
                         offered: bool) -> list[dict[str, Any]]:
    """Messages a chat template can render: for templates without tool support, an assistant
    turn's ``tool_calls`` become its text (in the call format) and a ``tool`` message becomes a
    user turn ``<tool_response>...</tool_response>``; the tools themselves go into the system
    prompt (`TOOLS_SYSTEM_PROMPT`, added to the first system message or as a new one).
    Templates that render tools get the calls with their arguments as objects."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if template_has_tools:
            entry = {k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")}
            if calls:
                entry["tool_calls"] = [
                    {"type": "function", "id": c.get("id"), "function": {
                        "name": c.get("function", {}).get("name"),
                        "arguments": _arguments_dict(c.get("function", {}).get("arguments", {}))}}
                    for c in calls]
            entry["content"] = entry.get("content") or ""
            out.append(entry)
            continue
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif calls:
            text = "\n".join(_call_text(c) for c in calls)
            content = m.get("content") or ""
            out.append({"role": m["role"], "content": f"{content}\n{text}" if content else text})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if offered and not template_has_tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_list(tools))
        prompt = TOOLS_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- reading calls back ---------------------------------------------------------------------------

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*" + re.escape(CALL_CLOSE))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Reads tool calls out of an answer as it streams (I/O-free: `feed` text, then `finish`).

    `feed` returns items in order: ``("content", text)`` for answer text outside calls,
    ``("call", index, id, name)`` when a call's name is known, ``("arguments", index, fragment)``
    for each piece of its arguments JSON. `calls` lists the calls so far as ``{"id", "name",
    "arguments"}``; ids are ``call_<stream_id>_<index>``, the same on every route.

    Example:
        >>> p = ToolCallParser("x")
        >>> p.feed('Sure. <tool_call>{"name": "f", "argu') + p.feed('ments": {"a": [1]}}</tool_call>')
        [('content', 'Sure. '), ('call', 0, 'call_x_0', 'f'), ('arguments', 0, '{"a": [1]}')]
    """

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.calls: list[dict[str, Any]] = []
        self._buf = ""
        self._state = "text"  # text | head | args | tail
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._complete: list[bool] = []

    @property
    def complete_calls(self) -> list[dict[str, Any]]:
        """The calls whose ``</tool_call>`` has been read (an answer cut short may end inside one)."""
        return [c for c, done in zip(self.calls, self._complete) if done]

    def feed(self, delta: str) -> list[tuple[Any, ...]]:
        self._buf += delta
        items: list[tuple[Any, ...]] = []
        while True:
            before = (self._state, len(self._buf))
            getattr(self, f"_{self._state}")(items)
            if (self._state, len(self._buf)) == before:
                return items

    def finish(self) -> list[tuple[Any, ...]]:
        """The text held back at the end (a partial marker, or a call that never completed)."""
        rest, self._buf = self._buf, ""
        if self._state == "text" and rest:
            return [("content", rest)]
        return []

    def _text(self, items: list[tuple[Any, ...]]) -> None:
        at = self._buf.find(CALL_OPEN)
        if at < 0:
            keep = _partial_suffix(self._buf, CALL_OPEN)
            out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            if out and not (self.calls and not out.strip()):  # the newline between calls is no content
                items.append(("content", out))
            return
        out = self._buf[:at]
        if out and not (self.calls and not out.strip()):
            items.append(("content", out))
        self._buf = self._buf[at + len(CALL_OPEN):]
        self._state = "head"

    def _head(self, items: list[tuple[Any, ...]]) -> None:
        m = _HEAD.match(self._buf)
        if m is not None and m.end() == len(self._buf):
            return  # more whitespace may follow before the arguments begin
        if m is None:
            if len(self._buf) > 400 or CALL_CLOSE in self._buf:  # not our format: keep it as text
                items.append(("content", CALL_OPEN + self._buf))
                self._buf, self._state = "", "text"
            return
        try:
            name = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            name = m.group(1)
        index = len(self.calls)
        call_id = f"call_{self.stream_id}_{index}"
        self.calls.append({"id": call_id, "name": name, "arguments": ""})
        self._complete.append(False)
        items.append(("call", index, call_id, name))
        self._buf = self._buf[m.end():]
        self._state, self._depth, self._in_string, self._escape = "args", 0, False, False

    def _args(self, items: list[tuple[Any, ...]]) -> None:
        end = None
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        fragment = self._buf if end is None else self._buf[:end]
        if fragment:
            index = len(self.calls) - 1
            self.calls[index]["arguments"] += fragment
            items.append(("arguments", index, fragment))
        self._buf = "" if end is None else self._buf[end:]
        if end is not None:
            self._state = "tail"

    def _tail(self, items: list[tuple[Any, ...]]) -> None:
        m = _TAIL.match(self._buf)
        if m is not None:
            self._buf = self._buf[m.end():]
            self._state = "text"
            self._complete[-1] = True


def parse_tool_calls(text: str, stream_id: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of a whole answer: the text outside calls, and the complete calls.

    Example:
        >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "s")
        ('', [{'id': 'call_s_0', 'name': 'f', 'arguments': '{}'}])
    """
    parser = ToolCallParser(stream_id)
    items = parser.feed(text) + parser.finish()
    content = "".join(i[1] for i in items if i[0] == "content")
    return content, parser.complete_calls
