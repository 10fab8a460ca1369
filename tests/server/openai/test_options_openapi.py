"""Options declared once, checked structurally (issue 35, item 3): every request body that
``/openapi.json`` publishes is walked, and each property that is a namesake of its family's option
(same name) must carry the spec's type, default, bounds and description. A hand-written namesake
that drifts (a description copied and edited, a default of its own) fails here, whatever its
spelling in the source."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import pytest
from pydantic import TypeAdapter

from multistream._spec import OptionInfo, body_fields, info, option_fields
from multistream.errors import InvalidArgumentError
from multistream.image import ImageOptions
from multistream.server import ServerSettings, create_app
from multistream.server.families import FAMILIES
from multistream.speech import SpeechOptions
from multistream.testing import ScriptedImageModel, ScriptedTextModel
from multistream.text import TextOptions
from multistream.video import VideoOptions

# The OpenAI routes' bodies and the family whose options they carry (the native routes' come from
# the family table: `Family.route` and `Family.options`).
OPENAI_BODIES: dict[str, type] = {
    "/v1/chat/completions": TextOptions,
    "/v1/completions": TextOptions,
    "/v1/responses": TextOptions,
    "/v1/images/generations": ImageOptions,
    "/v1/audio/speech": SpeechOptions,
    "/v1/streams/{stream_id}/rewind": TextOptions,
    "/v1/streams/{stream_id}/steer": ImageOptions,
    "/v1/videos": VideoOptions,
}

# Properties named like an option that mean something else, each with why.
OWN_MEANING: dict[tuple[str, str], str] = {
    ("/v1/completions", "logprobs"): "OpenAI's: an integer 0..20 (alternatives per token), not a bool",
    ("/v1/audio/speech", "voice"): "OpenAI's voice names, which mean the model's default voice",
    ("/v1/responses", "tools"): "the Responses API's flat function tools, converted to the chat form",
    ("/v1/responses", "tool_choice"): "the Responses API's {'type': 'function', 'name'} form",
    ("/v1/streams/{stream_id}/steer", "negative_prompt"): "an edit: null means unchanged",
    ("/v1/streams/{stream_id}/steer", "guidance_scale"): "an edit: null means unchanged",
    ("/v1/videos", "video_format"): "OpenAI's clips are MP4, so mp4 is the default there (the spec's is webm)",
}

# What a JSON Schema says about a value's type and range (everything else is presentation).
_SHAPE = ("type", "anyOf", "items", "additionalProperties", "minimum", "maximum", "exclusiveMinimum",
          "exclusiveMaximum", "enum", "const", "minLength", "maxLength", "pattern")


def _shape(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: schema[k] for k in _SHAPE if k in schema}


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema of the non-null values (an OpenAI body also takes null for "not given"). The
    alternatives of an ``anyOf`` are sorted: their order means nothing in JSON Schema, and Python
    caches ``int | str`` and ``str | int`` as one object, so it follows import order."""
    shape = _shape(schema)
    if "anyOf" in shape:
        rest = sorted((s for s in shape["anyOf"] if s != {"type": "null"}), key=json.dumps)
        shape = {**{k: v for k, v in shape.items() if k != "anyOf"}, **(rest[0] if len(rest) == 1 else {"anyOf": rest})}
    return shape


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    app = create_app(text_model=ScriptedTextModel(), image_model=ScriptedImageModel(steps=2, size=32))
    return app.openapi()  # type: ignore[no-any-return]


def _bodies(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(route, schema name, schema)`` of every JSON request body in the document."""
    out = []
    schemas = document["components"]["schemas"]
    for path, ops in document["paths"].items():
        for op in ops.values():
            content = (op.get("requestBody") or {}).get("content", {}).get("application/json")
            if content is None:
                continue
            ref = content["schema"]["$ref"]
            name = ref.rsplit("/", 1)[1]
            assert name in schemas, f"{path}'s body {ref} is not in the document"
            out.append((path, name, schemas[name]))
    return out


def _options_of(path: str) -> type:
    natives = {f.route: f for f in FAMILIES}
    if path in natives:
        fam = natives[path]
        assert fam.options is not None, f"the {fam.name} family has no options class in the family table"
        return fam.options
    assert path in OPENAI_BODIES, (f"{path} takes a JSON body this test does not know: add it to OPENAI_BODIES with "
                                   "the options class of its family")
    return OPENAI_BODIES[path]


def test_every_namesake_in_every_body_is_the_spec(document: dict[str, Any]) -> None:
    bodies = _bodies(document)
    assert {p for p, _, _ in bodies} >= set(OPENAI_BODIES) | {f.route for f in FAMILIES}
    checked = 0
    for path, name, schema in bodies:
        options = _options_of(path)
        specs = body_fields(options)
        all_options = {f.name for f in dataclasses.fields(options) if "option" in f.metadata}
        for prop, got in schema["properties"].items():
            if prop not in all_options or (path, prop) in OWN_MEANING:
                continue
            where = f"{name}.{prop} ({path})"
            assert prop in specs, f"{where} names a Python-only option of {options.__name__}"
            wire, field = specs[prop]
            bounds = _declared(options, prop).schema_bounds
            expected = {**TypeAdapter(Optional[wire]).json_schema(), **bounds}
            assert _without_null(got) == _without_null(expected), f"{where}: type or bounds differ from the spec"
            assert got.get("default") == field.default, f"{where}: default {got.get('default')!r} is not the spec's"
            assert got["description"].removeprefix("extension: ") == field.description, f"{where}: description"
            checked += 1
    assert checked >= 60  # text in five bodies, image in three, speech in two


def _declared(options: type, name: str) -> OptionInfo:
    return next(info(f) for f in option_fields(options) if f.name == name)


def _probes(wire: Any, key: str, bound: float) -> tuple[Any, Any]:
    """(a value the bound allows, the nearest one it refuses) for a bound of a number option."""
    kinds = [a for a in getattr(wire, "__args__", (wire,)) if a is not type(None)]
    step: float = 1 if float not in kinds else 1e-6
    number: Any = int if float not in kinds else float
    inside = {"minimum": bound, "maximum": bound, "exclusiveMinimum": bound + step, "exclusiveMaximum": bound - step}
    outside = {"minimum": bound - step, "maximum": bound + step, "exclusiveMinimum": bound, "exclusiveMaximum": bound}
    return number(inside[key]), number(outside[key])


@pytest.mark.parametrize("options", [TextOptions, ImageOptions, SpeechOptions, ServerSettings],
                         ids=lambda c: c.__name__)
def test_every_declared_bound_is_the_one_its_check_enforces(options: type) -> None:
    """The bounds ``/openapi.json`` publishes are the checks' own: each check takes the value at an
    inclusive bound and refuses the nearest value beyond it, naming the option."""
    probed = 0
    for field in option_fields(options):
        meta = info(field)
        for key, bound in meta.bounds:
            ok, bad = _probes(meta.wire, key, bound)
            assert meta.check is not None
            meta.check(ok)
            with pytest.raises(InvalidArgumentError) as err:
                meta.check(bad)
            assert field.name in str(err.value), (field.name, key, bad)
            probed += 1
    assert probed >= {TextOptions: 20, ImageOptions: 12, SpeechOptions: 2, ServerSettings: 30}[options]


def test_the_openai_bodies_carry_the_options_they_forward(document: dict[str, Any]) -> None:
    """The namesakes are present where the route passes them on (not hand-mapped under other names)."""
    schemas = document["components"]["schemas"]
    for body, names in (("CompletionRequest", ("temperature", "top_p", "seed", "stop", "speculate", "priority")),
                        ("ResponsesRequest", ("temperature", "top_p", "seed", "speculate", "parallel_tool_calls")),
                        ("ChatCompletionRequest", ("temperature", "logprobs", "speculate", "priority")),
                        ("AudioSpeechRequest", ("speed", "priority")),
                        ("ImageGenerationRequest", ("steps", "seed", "guidance_scale", "priority"))):
        assert set(names) <= set(schemas[body]["properties"]), body


def test_a_drifted_namesake_is_caught() -> None:
    """The comparison sees a copied description, a default of its own and other bounds."""
    wire, field = body_fields(TextOptions)["top_p"]
    spec = TypeAdapter(Optional[wire]).json_schema()
    assert _without_null({"anyOf": [{"type": "number"}, {"type": "null"}]}) == _without_null(spec)
    assert _without_null({"anyOf": [{"type": "number", "maximum": 1}, {"type": "null"}]}) != _without_null(spec)
    assert _without_null({"type": "integer"}) != _without_null(spec)
    assert field.default is None and field.description == dataclasses.fields(TextOptions)[2].metadata["option"].doc
