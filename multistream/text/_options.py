"""The one definition of every ``TextModel.stream()`` option, checked without torch.

`TextOptions` declares each option once (type, default, bounds in its check, description); the
real model, the scripted fake in `multistream.testing`, the server's request bodies (built from it,
so ``/openapi.json`` describes exactly these options), the OpenAI conversion, the WebSocket and the
Ray ingress all go through `parse_text_options`, so every entry point accepts the same values and
rejects the same mistakes with the same message.

Example:
    >>> opts = parse_text_options(max_new_tokens=16, stop="\\n\\n")
    >>> opts.max_new_tokens, opts.stop
    (16, ('\\n\\n',))
    >>> parse_text_options(max_new_tokens=0)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: max_new_tokens must be an integer >= 1, got 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from .._checks import check_seed, is_int, is_number
from .._spec import option, option_names, parse_options
from ..errors import InvalidArgumentError

__all__ = ["CHAT_ROLES", "REWIND_OPTIONS", "TEXT_STREAM_ARGS", "TextOptions", "check_messages", "check_prompt",
           "check_role", "parse_text_options"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgumentError(message)


def _max_new_tokens(v: Any) -> int:
    _require(is_int(v) and v >= 1, f"max_new_tokens must be an integer >= 1, got {v!r}")
    return int(v)


def _temperature(v: Any) -> float | None:
    _require(v is None or (is_number(v) and v >= 0), f"temperature must be a number >= 0 (0 means greedy), got {v!r}")
    return None if v is None else float(v)


def _top_p(v: Any) -> float | None:
    _require(v is None or (is_number(v) and 0 < v <= 1), f"top_p must be in (0, 1] (1 disables it), got {v!r}")
    return None if v is None else float(v)


def _top_k(v: Any) -> int | None:
    _require(v is None or (is_int(v) and v >= 0), f"top_k must be an integer >= 0 (0 disables it), got {v!r}")
    return None if v is None else int(v)


def _repetition_penalty(v: Any) -> float | None:
    _require(v is None or (is_number(v) and v > 0), f"repetition_penalty must be a number > 0 (1 disables it), got {v!r}")
    return None if v is None else float(v)


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        stops: tuple[str, ...] = (v,)
    elif isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        stops = tuple(v)
    else:
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {v!r}")
    _require(all(stops), "stop strings must not be empty")
    return stops


def _chunk_tokens(v: Any) -> int | None:
    _require(v is None or (is_int(v) and v >= 1), f"chunk_tokens must be an integer >= 1, got {v!r}")
    return None if v is None else int(v)


def _chunk_ms(v: Any) -> float | None:
    _require(v is None or (is_number(v) and v > 0), f"chunk_ms must be a number of milliseconds > 0, got {v!r}")
    return None if v is None else float(v)


def _chat(v: Any) -> bool | None:
    _require(v is None or isinstance(v, bool), f"chat must be True, False or None (automatic), got {v!r}")
    return v  # type: ignore[no-any-return]


def _allowed(v: Any) -> str | None:
    from ._constraints import compile_allowed  # the `regex` package, only when a constraint is given

    return compile_allowed(v)


def _logprobs(v: Any) -> bool:
    _require(isinstance(v, bool), f"logprobs must be True or False, got {v!r}")
    return bool(v)


def _top_logprobs(v: Any) -> int:
    _require(is_int(v) and 0 <= v <= 20, f"top_logprobs must be an integer from 0 to 20 (alternatives per token), got {v!r}")
    return int(v)


def _penalty(name: str) -> Any:
    def check(v: Any) -> float:
        _require(is_number(v) and -2 <= v <= 2, f"{name} must be a number from -2 to 2 (0 disables it), got {v!r}")
        return float(v)

    return check


def _logit_bias(v: Any) -> dict[int, float] | None:
    if v is None:
        return None
    _require(isinstance(v, dict), f"logit_bias must map token ids to biases, e.g. {{123: -100}}, got {v!r}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        _require(is_int(token) and token >= 0,
                 f"logit_bias keys must be token ids (integers >= 0, or their digit strings), got {key!r}")
        _require(is_number(bias) and -100 <= bias <= 100,
                 f"logit_bias[{key!r}] must be a number from -100 to 100 (-100 bans the token), got {bias!r}")
        out[int(token)] = float(bias)
    return out or None


def _min_p(v: Any) -> float | None:
    _require(v is None or (is_number(v) and 0 <= v <= 1), f"min_p must be a number in [0, 1] (0 disables it), got {v!r}")
    return None if v is None else float(v)


def _json_schema(v: Any) -> str | None:
    from ._schemas import check_json_schema  # the grammar engine, only when a schema is given

    return check_json_schema(v)


def _tools(v: Any) -> str | None:
    from ._tools import check_tools

    return check_tools(v)


def _tool_choice(v: Any) -> str | dict[str, Any] | None:
    from ._tools import check_tool_choice

    return check_tool_choice(v)


def _parallel_tool_calls(v: Any) -> bool | None:
    _require(v is None or isinstance(v, bool), f"parallel_tool_calls must be true, false or null (true), got {v!r}")
    return v  # type: ignore[no-any-return]


def _num_beams(v: Any) -> int:
    _require(is_int(v) and 1 <= v <= 8, f"num_beams must be an integer from 1 (no beams) to 8, got {v!r}")
    return int(v)


def _length_penalty(v: Any) -> float:
    _require(is_number(v) and -100 <= v <= 100,
             f"length_penalty must be a number from -100 to 100 (beam scores are divided by length ** it), got {v!r}")
    return float(v)


def _early_stopping(v: Any) -> bool | str:
    _require(isinstance(v, bool) or v == "never",
             f"early_stopping must be true, false or \"never\" (as transformers' generate takes it), got {v!r}")
    return v  # type: ignore[no-any-return]


def _stop_on_repetition(v: Any) -> bool:
    _require(isinstance(v, bool), f"stop_on_repetition must be True or False, got {v!r}")
    return bool(v)


#: The most drafted tokens one step may verify for a request (``speculate=k``).
MAX_SPECULATE = 32


def _speculate(v: Any) -> str | int:
    if isinstance(v, str) and v.isdigit():  # the command line's --speculate 4
        v = int(v)
    _require(v == "auto" or (is_int(v) and 0 <= v <= MAX_SPECULATE),
             f'speculate must be "auto", 0 (off) or an integer from 1 to {MAX_SPECULATE} (drafts per step at most), '
             f"got {v!r}")
    return "auto" if v == "auto" else int(v)


#: The longest ``cache_salt``: a salt names who may share cached prompts (a tenant, a user), not content.
MAX_CACHE_SALT_CHARS = 256


def _cache_salt(v: Any) -> str | None:
    _require(v is None or (isinstance(v, str) and 0 < len(v) <= MAX_CACHE_SALT_CHARS),
             f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters (or null: "
             f"shared with every unsalted request), got {v!r:.80}")
    return v  # type: ignore[no-any-return]


def _priority(v: Any) -> int:
    _require(is_int(v), f"priority must be an integer (higher runs first), got {v!r}")
    return int(v)


@dataclass(frozen=True)
class TextOptions:
    """Checked ``TextModel.stream()`` options: each declared once, here.

    Sampling options left as None follow the model's ``generation_config`` (as transformers'
    ``generate`` does; see `multistream.text._sampling.SamplingPlan`): temperature None means
    greedy unless the config says ``do_sample``.
    """

    max_new_tokens: int = option(256, "an integer >= 1: tokens to generate at most", _max_new_tokens,
                                 wire=Optional[int], body_default=None, ge=1)
    temperature: Optional[float] = option(
        None, "a number >= 0 (0 = greedy); null: the model's generation_config", _temperature, wire=Optional[float], ge=0)
    top_p: Optional[float] = option(None, "a number in (0, 1] (1 = off); null: the model's default", _top_p,
                                    wire=Optional[float], gt=0, le=1)
    top_k: Optional[int] = option(None, "an integer >= 0 (0 = off); null: the model's default", _top_k,
                                  wire=Optional[int], ge=0)
    repetition_penalty: Optional[float] = option(
        None, "a number > 0 (1 = off); null: the model's default", _repetition_penalty, wire=Optional[float], gt=0)
    seed: Optional[int] = option(None, "an integer in [0, 2**63): reproducible sampling; null: random", check_seed,
                                 wire=Optional[int], ge=0, lt=2**63)
    stop: tuple[str, ...] = option((), "a string or a list of strings that end the text (never emitted)", _stop,
                                   wire=Union[str, list[str], None])
    chunk_tokens: Optional[int] = option(None, "an integer >= 1: tokens per event", _chunk_tokens, wire=Optional[int], ge=1)
    chunk_ms: Optional[float] = option(None, "a number of milliseconds > 0: group tokens into events this long",
                                       _chunk_ms, wire=Optional[float], gt=0)
    chat: Optional[bool] = option(None, "true/false: apply the chat template to a prompt string; null = auto",
                                  _chat, wire=Optional[bool])
    allowed: Optional[str] = option(
        None, "a regular expression the whole answer must match, or a list of choices (constrained decoding)",
        _allowed, wire=Union[str, list[str], None])
    priority: int = option(0, "an integer; higher runs first at every engine step (a server caps it per key)",
                           _priority, wire=int)
    # v1.2 "confidence": logprobs and OpenAI's sampling options.
    logprobs: bool = option(False, "true: each text event carries the log-probability of its tokens (raw model "
                            "log-softmax in fp32, before temperature, penalties and masks)", _logprobs, wire=bool)
    top_logprobs: int = option(0, "an integer 0..20: the most likely alternatives per token (implies logprobs)",
                               _top_logprobs, wire=int, ge=0, le=20)
    presence_penalty: float = option(0.0, "a number -2..2: subtracted from the logit of every token already "
                                     "generated (OpenAI's)", _penalty("presence_penalty"), wire=float, ge=-2, le=2)
    frequency_penalty: float = option(0.0, "a number -2..2: subtracted once per earlier occurrence of a token in "
                                      "the answer (OpenAI's)", _penalty("frequency_penalty"), wire=float, ge=-2, le=2)
    logit_bias: Optional[dict[int, float]] = option(
        None, "token id -> a bias -100..100 added to its logit (-100 bans it)", _logit_bias,
        wire=Optional[dict[str, float]], default_factory=lambda: None)
    min_p: Optional[float] = option(None, "a number in [0, 1]: drop tokens less likely than min_p times the most "
                                    "likely one (0 = off); null: the model's default", _min_p, wire=Optional[float], ge=0, le=1)

    # Structured outputs and tools (docs/constrained.md); stored as canonical JSON text.
    json_schema: Optional[str] = option(
        None, "a JSON Schema (or, in Python, a pydantic model class): the answer is JSON valid for it",
        _json_schema, wire=Optional[dict[str, Any]])
    tools: Optional[str] = option(
        None, 'a list of {"type": "function", "function": {"name", "description", "parameters"}}: the model may '
        "call them; the final event carries tool_calls", _tools, wire=Optional[list[dict[str, Any]]])
    tool_choice: Union[str, dict[str, Any], None] = option(
        None, '"none", "auto" (default), "required" or {"type": "function", "function": {"name": ...}}',
        _tool_choice, wire=Union[str, dict[str, Any], None])
    parallel_tool_calls: Optional[bool] = option(
        None, "true (default): several calls may follow each other; false: at most one", _parallel_tool_calls,
        wire=Optional[bool])

    num_beams: int = option(
        1, "an integer from 1 to 8: beam search over this many hypotheses (greedy; events show the best one, "
        "`committed` says how much of it can no longer change); 1 = off", _num_beams, wire=int, ge=1, le=8)
    length_penalty: float = option(
        1.0, "a number: beam scores are divided by length ** length_penalty (as in transformers)", _length_penalty,
        wire=float, ge=-100, le=100)
    early_stopping: Union[bool, str] = option(
        False, "true, false or \"never\": when beam search stops (as in transformers' generate)", _early_stopping,
        wire=Union[bool, str])
    # v1.3 "durable generations": generation health.
    stop_on_repetition: bool = option(
        False, "true: a repetition loop (the newest tokens repeat one unit of up to 64 tokens, 4 times and 32 "
        "tokens or more) ends the answer with finish_reason \"repetition\"; a loop is flagged on the final "
        "event's metrics either way", _stop_on_repetition, wire=bool)

    # Exact lookahead (text/_lookahead.py): several tokens per step, the same text.
    speculate: Union[str, int] = option(
        "auto", '"auto" (drafts from the prompt and the answer, when they pay), 0 (off) or an integer (at most '
        "that many drafts per step): verified exactly, the text, ids and logprobs are those of 0", _speculate,
        wire=Union[str, int], ge=0, le=MAX_SPECULATE)
    # Prompt prefix caching (text/_prefix_cache.py): who may start from whose cached prompts.
    cache_salt: Optional[str] = option(
        None, "a string: this request shares cached prompt starts only with requests of the same salt (vLLM's "
        "cache_salt: the time to first token then says nothing about other users' prompts; a server with API "
        "keys salts each key's requests itself); null: shared among unsalted requests", _cache_salt,
        wire=Optional[str])

    def __post_init__(self) -> None:
        # Checks that span options (each option alone was checked by its own check).
        if self.allowed is not None and self.json_schema is not None:
            raise InvalidArgumentError("allowed= and json_schema= cannot constrain one answer together; give one",
                                       param="allowed")
        if self.tools is not None or self.tool_choice is not None:
            from ._tools import check_tool_options

            check_tool_options(self.tools, self.tool_choice, self.allowed)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


TEXT_STREAM_ARGS: tuple[str, ...] = option_names(TextOptions)

#: The sampling options a rewind (``stream.rewind``, ``llm.revise``, the rewind body) may change
#: for the regenerated part; declared once here, checked by `TextOptions` like any other option.
REWIND_OPTIONS: tuple[str, ...] = ("temperature", "top_p", "top_k", "repetition_penalty", "seed")


def parse_text_options(**options: Any) -> TextOptions:
    """Check every option; raise `InvalidArgumentError` naming the first bad one and the fix."""
    checked = parse_options(TextOptions, "TextModel.stream()", options)
    _check_beams(checked)
    return checked


def _check_beams(options: TextOptions) -> None:
    """Beam search is greedy here: refuse sampling and per-token features that do not combine."""
    if options.num_beams == 1:
        return
    sampling = []
    if options.temperature is not None and options.temperature > 0:
        sampling.append(f"temperature={options.temperature}")
    if options.top_p is not None and options.top_p < 1:
        sampling.append(f"top_p={options.top_p}")
    if options.top_k is not None and options.top_k > 0:
        sampling.append(f"top_k={options.top_k}")
    if sampling:
        raise InvalidArgumentError(
            f"num_beams={options.num_beams} is greedy beam search; sampling ({', '.join(sampling)}) cannot be "
            "combined with it: drop the sampling options (or set temperature=0), or use num_beams=1 to sample",
            param="num_beams")
    # Beam search scores the model's own log-probabilities: what would change the scores or
    # constrain a row is not built for beams (yet).
    others = [name for name, on in (
        ("stop", bool(options.stop)), ("allowed", options.allowed is not None),
        ("repetition_penalty", options.repetition_penalty not in (None, 1.0)),
        ("json_schema", options.json_schema is not None), ("tools", options.tools is not None),
        ("logprobs", options.wants_logprobs), ("presence_penalty", options.presence_penalty != 0),
        ("frequency_penalty", options.frequency_penalty != 0), ("logit_bias", bool(options.logit_bias)),
        ("min_p", bool(options.min_p)), (f"speculate={options.speculate}", options.speculate not in ("auto", 0)),
    ) if on]
    if others:
        raise InvalidArgumentError(
            f"num_beams={options.num_beams} does not combine with {', '.join(others)} yet; drop "
            f"{'it' if len(others) == 1 else 'them'} or use num_beams=1", param="num_beams")


def _check_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    ok = isinstance(calls, (list, tuple)) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)
    _require(ok, f"messages[{i}]['tool_calls'] must be a list of "
             '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON>"}}')
    return [{"id": c.get("id"), "type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", "")}}
            for c in calls]


#: The roles a chat message may have: OpenAI's (``function``, deprecated there, aside).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_role(role: str, where: str) -> str:
    """A chat message's role, ``developer`` read as ``system``; another role is an error naming it
    (``where``: how the caller spells the field, e.g. ``messages[0].role``) and the accepted ones.

    Example:
        >>> check_role("developer", "messages[0].role")
        'system'
    """
    if role not in CHAT_ROLES:
        # A template renders an unknown role as it is, or drops the turn without a word.
        raise InvalidArgumentError(f"{where} is {role[:40]!r}; a chat message's role is one of "
                                   f"{', '.join(CHAT_ROLES)}", param="prompt")
    # OpenAI's newer name for system; most chat templates know only system.
    return "system" if role == "developer" else role


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as plain ``{"role", "content"}`` dicts, or a clear error.

    An assistant turn may carry ``tool_calls`` (its ``content`` may then be None) and a ``tool``
    turn its ``tool_call_id``, as OpenAI's messages do; the role is one of `CHAT_ROLES`.
    """
    if not messages:
        raise InvalidArgumentError("messages is empty; pass at least one {'role': 'user', 'content': '...'}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgumentError(
                f"messages[{i}] must be a dict with 'role' and 'content' strings, got {message!r}"
            )
        calls = message.get("tool_calls")
        content = message.get("content")
        if calls and content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidArgumentError(f"messages[{i}]['content'] must be a string, got {message.get('content')!r}")
        entry: dict[str, Any] = {"role": check_role(message["role"], f"messages[{i}]['role']"), "content": content}
        if calls:
            entry["tool_calls"] = _check_tool_calls(i, calls)
        for key in ("tool_call_id", "name"):
            value = message.get(key)
            if value is not None:
                _require(isinstance(value, str), f"messages[{i}]['{key}'] must be a string, got {value!r}")
                entry[key] = value
        checked.append(entry)
    return checked


def check_prompt(prompt: Any) -> str | list[dict[str, Any]]:
    """A prompt string, or a checked list of chat messages."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return check_messages(list(prompt))
    raise InvalidArgumentError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
