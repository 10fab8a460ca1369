"""OpenAI's Responses API body (`ResponsesRequest`) and its conversion into `TextOptions` keyword
arguments (as vLLM's ``ResponsesRequest.to_sampling_params()``); the events it streams are
`serving.ResponseBuilder`'s.

Example:
    >>> from multistream.server import ServerSettings
    >>> req = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 8})
    >>> kwargs = req.to_text_options(ServerSettings(), history=[])
    >>> kwargs["prompt"], kwargs["max_new_tokens"]
    ([{'role': 'user', 'content': 'hi'}], 8)
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Union

from pydantic import BaseModel, Field, create_model

from ....text import TextOptions, check_role
from ...bodies import check_prompt_limit
from ...http.bodies import LAX_BODY, validate_body
from ...http.problems import Problem
from ...settings import ServerSettings
from .._protocol import chat_messages, check_options, given_options, max_tokens, option_fields

logger = logging.getLogger("multistream.server")


# OpenAI's request fields that change nothing here (accepted, logged, ignored).
_IGNORED = ("user", "include", "reasoning", "service_tier", "truncation", "prompt_cache_key", "safety_identifier",
            "stream_options", "top_logprobs", "max_tool_calls", "prompt", "conversation")


class _ResponsesBase(BaseModel):
    """``POST /v1/responses`` (OpenAI). Text in, text or function calls out; ``text.format``
    ``json_schema`` / ``json_object`` and function ``tools`` run under the grammar engine.
    Built-in tools (web search, file search, ...) are refused: this server has none."""

    model_config = LAX_BODY  # SDKs add fields over time; unknown ones are logged and ignored
    model: Optional[str] = Field(default=None, description="the served text model: its name (GET /v1/models), \"default\" or \"text\"; another name is 404 model_not_found")
    input: Union[str, list[dict[str, Any]]] = Field(description="a string, or a list of input items (messages, "
                                                    "function_call, function_call_output)")
    instructions: Optional[str] = Field(default=None, description="a system message for this response only "
                                        "(not carried on by previous_response_id)")
    max_output_tokens: Optional[int] = Field(default=None, description="an integer >= 1; null: the server's default")
    tools: Optional[list[dict[str, Any]]] = Field(default=None, description='function tools: [{"type": "function", '
                                                  '"name", "description", "parameters"}]')
    tool_choice: Union[str, dict[str, Any], None] = Field(default=None, description='"none", "auto", "required" or '
                                                          '{"type": "function", "name": ...}')
    text: Optional[dict[str, Any]] = Field(default=None, description='{"format": {"type": "text" | "json_object" | '
                                           '"json_schema", "name", "schema", "strict"}}')
    store: Optional[bool] = Field(default=None, description="true (default): keep the response for GET, "
                                  "input_items and previous_response_id (for the server's retention_s)")
    metadata: Optional[dict[str, str]] = Field(default=None, description="up to 16 string pairs, returned as given")
    previous_response_id: Optional[str] = Field(default=None, description="continue the conversation of a stored "
                                                "response")
    background: Optional[bool] = Field(default=None, description="true: answer at once; the generation runs on, "
                                       "read it with GET /v1/responses/{id} (?stream=true&starting_after=N)")
    stream: Optional[bool] = Field(default=None, description="true: server-sent typed events")

    def to_text_options(self, settings: ServerSettings, history: list[dict[str, Any]]) -> dict[str, Any]:
        """``TextModel.stream`` keyword arguments: ``history`` (the conversation of the previous
        response, its output included), then ``instructions`` as a system message first and this
        request's input items."""
        messages = list(history) + input_messages(self.input)
        if self.instructions:
            messages = [{"role": "system", "content": self.instructions}] + messages
        if not messages:
            raise Problem(400, "invalid_argument", "input must be a non-empty string or list of items", param="input")
        messages = chat_messages(messages)
        check_prompt_limit(messages, settings)
        kwargs: dict[str, Any] = {"prompt": messages}
        kwargs["max_new_tokens"] = max_tokens(self.max_output_tokens, "max_output_tokens", settings)
        schema = format_schema(self.text)
        if schema is not None:
            kwargs["json_schema"] = schema
        tools = chat_tools(self.tools)
        if tools:
            kwargs["tools"] = tools
            if self.tool_choice is not None:
                kwargs["tool_choice"] = chat_tool_choice(self.tool_choice)
            kwargs.update(given_options(self, ("parallel_tool_calls",)))
        kwargs.update(given_options(self, _SAMPLING))
        return kwargs


# The Responses fields that have a `TextOptions` namesake (type, default, description from the
# spec). ``tools`` and ``tool_choice`` are OpenAI's Responses shapes (flat function tools), converted
# by `chat_tools` / `chat_tool_choice`, so they are this body's own.
_SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop_on_repetition",
             "speculate")
RESPONSES_OPTION_FIELDS = (*_SAMPLING, "parallel_tool_calls", "priority", "cache_salt")
_EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "stop_on_repetition", "speculate", "priority",
               "cache_salt")

ResponsesRequest = create_model(
    "ResponsesRequest", __base__=_ResponsesBase, __doc__=_ResponsesBase.__doc__,
    **option_fields(TextOptions, RESPONSES_OPTION_FIELDS, _EXTENSIONS))


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                    and isinstance(p.get("text"), str)):
                raise Problem(400, "invalid_type", f"{where}.content parts must be text parts ({{\"type\": "
                              "\"input_text\", \"text\": ...}); this server has a text-only model", param="input")
            parts.append(p["text"])
        return "".join(parts)
    raise Problem(400, "invalid_type", f"{where}.content must be a string or a list of text parts", param="input")


#: The roles of a Responses input message (a tool's output is a function_call_output item instead).
MESSAGE_ROLES = ("system", "developer", "user", "assistant")


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (function calls as an assistant turn's
    ``tool_calls``, their outputs as ``tool`` turns)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            role = item.get("role")
            if role not in MESSAGE_ROLES:  # worded as chat's check_role words it
                raise Problem(400, "invalid_argument", f"{where}.role is {str(role)[:40]!r}; an input message's role "
                              f"is one of {', '.join(MESSAGE_ROLES)} (a tool's output is an item of type "
                              "function_call_output)", param="input")
            out.append({"role": check_role(role, f"{where}.role"), "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's item an SDK sends back: nothing to render here
        else:
            raise Problem(400, "unsupported", f"{where}: input items of type {str(kind)[:40]!r} are not supported "
                          "(message, function_call, function_call_output)", param="input")
    return out


def format_schema(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON Schema ``text.format`` asks for (None: free text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise Problem(400, "invalid_argument", 'text.format json_schema needs {"type": "json_schema", "name": ..., '
                          '"schema": {...}}', param="text")
        return schema
    raise Problem(400, "invalid_argument", f"text.format.type must be 'text', 'json_object' or 'json_schema', got "
                  f"{str(kind)[:40]!r}", param="text")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses function tools (flat) -> the chat form the text family takes."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise Problem(400, "unsupported", f"tools[{i}]: only function tools are supported, got {str(kind)[:40]!r}",
                          param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise Problem(400, "unsupported", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                          '"name": ...}', param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def parse_responses_body(body: Any, settings: ServerSettings,
                         history: list[dict[str, Any]]) -> tuple[ResponsesRequest, dict[str, Any]]:
    """A ``POST /v1/responses`` body -> (the request, ``TextModel.stream`` keyword arguments)."""
    req = validate_body(ResponsesRequest, body, "POST /v1/responses")
    assert isinstance(req, ResponsesRequest)
    if req.background and req.store is False:
        raise Problem(400, "invalid_argument", "background responses must be stored (store: true)", param="store")
    if req.metadata is not None and (len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512
                                                                   for k, v in req.metadata.items())):
        raise Problem(400, "invalid_argument", "metadata allows 16 pairs, keys up to 64 and values up to 512 "
                      "characters", param="metadata")
    ignored = [n for n in _IGNORED if body.get(n) not in (None, "", {}, [])]
    extra = sorted(set(body) - set(ResponsesRequest.model_fields) - set(_IGNORED))
    if ignored or extra:
        logger.info("responses: ignoring field(s) %s", ignored + extra)
    kwargs = req.to_text_options(settings, history)
    check_options(kwargs, "max_output_tokens")
    return req, kwargs


def request_view(req: ResponsesRequest) -> dict[str, Any]:
    """The request fields a response object repeats (stored with the response)."""
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "text": req.text if req.text is not None else {"format": {"type": "text"}},
            "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id,
            "background": bool(req.background), "store": req.store is not False, "model": req.model}
