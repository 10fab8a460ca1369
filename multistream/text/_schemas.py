"""JSON Schemas checked for the grammar engine, and the time limit every grammar compiles under.

`check_json_schema` takes what ``json_schema=`` accepts (a JSON Schema dict, a pydantic model
class, JSON text) and returns canonical JSON text, after checking it against its meta-schema
(``jsonschema``) and compiling it with llguidance (no tokenizer needed); errors name the part as a
JSON pointer. `limited` runs a compilation with the time limit `COMPILE_TIMEOUT_S`.

Example:
    >>> check_json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    '{"type":"object","properties":{"n":{"type":"integer"}}}'
    >>> check_json_schema({"type": "strin"})
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: json_schema is not a valid JSON Schema at /type: 'strin' is not valid under any of the given schemas
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from ..errors import InvalidArgumentError

__all__ = ["COMPILE_TIMEOUT_S", "JSON_LAYOUT", "check_json_schema", "check_schema_value", "first_line", "limited"]

T = TypeVar("T")

# JSON as the engine writes it: one space after ',' and ':' and no other whitespace, so the output
# is exact (and a small model cannot wander off into endless whitespace).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Seconds a grammar may take to validate or compile before the request is refused.
COMPILE_TIMEOUT_S = 10.0


def limited(fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
    """``fn()`` on a worker thread (llguidance drops the GIL while it builds a grammar), refused
    after the time limit. A grammar past the limit is also bounded by llguidance's own fuel limits,
    so the abandoned thread ends on its own."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="multistream-grammar").start()
    limit = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return future.result(timeout=limit)
    except TimeoutError:
        raise InvalidArgumentError(
            f"{what} took more than {limit:g} s to compile; simplify it (fewer alternatives, "
            "shorter patterns, fewer nested or optional parts)") from None


def first_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3])[:400]


def _pointer(path: Any) -> str:
    return "/" + "/".join(str(p) for p in path) if path else "(the root)"


def _find_key(node: Any, key: str, path: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    if isinstance(node, dict):
        if key in node:
            return (*path, key)
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for k, child in items:
        found = _find_key(child, key, (*path, k))
        if found is not None:
            return found
    return None


def _closed(node: Any) -> Any:
    """Objects with declared properties take no others unless the schema says so (as the openai
    SDK's strict mode does for pydantic classes): the answer holds the class's fields only."""
    if isinstance(node, dict):
        node = {k: _closed(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    elif isinstance(node, list):
        node = [_closed(v) for v in node]
    return node


def _schema_dict(v: Any, what: str) -> dict[str, Any]:
    model_json_schema = getattr(v, "model_json_schema", None)
    if isinstance(v, type) and callable(model_json_schema):  # a pydantic model class
        v = _closed(model_json_schema())
    elif isinstance(v, str):  # JSON text (the canonical form TextOptions stores)
        try:
            v = json.loads(v)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{what} is a string but not JSON: {exc}") from exc
    if not isinstance(v, dict):
        raise InvalidArgumentError(
            f"{what} must be a JSON Schema (a dict) or a pydantic model class, got {type(v).__name__}")
    return v


def check_schema_value(schema: Any, what: str) -> None:
    """A JSON Schema dict checked: valid against its meta-schema and compilable by llguidance;
    the error names the part (a JSON pointer into the schema)."""
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"{what} must be a JSON Schema object (a dict), got {type(schema).__name__}")
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} is not JSON: {exc}") from exc
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a dependency; llguidance still checks
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise InvalidArgumentError(
                f"{what} is not a valid JSON Schema at {_pointer(exc.path)}: {exc.message}") from None
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    error = limited(lambda: llguidance.LLMatcher.validate_grammar(grammar), what)
    if error:
        where = ""
        if error.startswith("Unimplemented keys: "):
            keys = json.loads(error.split(": ", 1)[1].splitlines()[0]) if "[" in error else []
            found = _find_key(schema, keys[0]) if keys else None
            where = f" (at {_pointer(found)})" if found else ""
        raise InvalidArgumentError(
            f"{what} uses what the grammar engine does not support{where}: {first_line(error)}")


def check_json_schema(v: Any) -> str | None:
    """``json_schema=``: a JSON Schema dict, a pydantic model class or JSON text; returned as
    canonical JSON text (key order kept: properties are generated in the schema's order)."""
    if v is None:
        return None
    schema = _schema_dict(v, "json_schema")
    check_schema_value(schema, "json_schema")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


