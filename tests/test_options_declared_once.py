"""Options declared once (issue 26, item 4): one engine capacity default, one text max_batch default,
the rewind options, the OpenAI chat and image option fields and the native image body from the specs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from multistream.engine import DEFAULT_CAPACITY, capacity_of
from multistream.server.state import _capacity
from multistream.testing import ScriptedImageModel

ROOT = Path(__file__).resolve().parent.parent


class _Sized:
    def __init__(self, capacity: object) -> None:
        self.capacity = capacity


def test_capacity_of_falls_back_to_the_one_default() -> None:
    assert capacity_of(object()) == DEFAULT_CAPACITY
    assert capacity_of(_Sized(7)) == 7
    for bad in (0, -1, True, 2.5, None):
        assert capacity_of(_Sized(bad)) == DEFAULT_CAPACITY
    assert _capacity(object(), "text") == _capacity(object(), "image") == DEFAULT_CAPACITY
    assert _capacity(ScriptedImageModel(), "image") == capacity_of(ScriptedImageModel())


def test_the_families_use_the_constants() -> None:
    from multistream.image import ImageModel
    from multistream.text import DEFAULT_MAX_BATCH, TextModel, load_text_model

    assert ImageModel.capacity == DEFAULT_CAPACITY
    assert inspect.signature(load_text_model).parameters["max_batch"].default == DEFAULT_MAX_BATCH
    assert inspect.signature(TextModel.__init__).parameters["max_batch"].default == DEFAULT_MAX_BATCH


def test_no_capacity_literal_left_in_the_server() -> None:
    for path in [*(ROOT / "multistream" / "server").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"capacity\W{1,4}(?:or )?\d", text), path


def test_rewind_options_are_declared_once() -> None:
    from multistream.server.bodies import RewindBody
    from multistream.text import REWIND_OPTIONS, TextOptions

    fields = RewindBody.model_fields
    assert set(fields) == {"offset", "instruction", "token_id", *REWIND_OPTIONS}
    specs = {f.name: f.metadata["option"].doc for f in __import__("dataclasses").fields(TextOptions)
             if "option" in f.metadata}
    for name in REWIND_OPTIONS:
        assert fields[name].description == specs[name], name  # the spec's description, not a copy
    for path in ("multistream/text/_model.py", "multistream/testing/_text.py", "multistream/server/bodies.py"):
        text = (ROOT / path).read_text(encoding="utf-8")
        assert '"temperature", "top_p", "top_k", "repetition_penalty", "seed"' not in text, path


def test_openai_chat_option_fields_come_from_the_specs() -> None:
    import dataclasses

    from multistream.server.openai.chat.protocol import CHAT_OPTION_FIELDS, ChatCompletionRequest
    from multistream.text import TextOptions

    docs = {f.name: f.metadata["option"].doc for f in dataclasses.fields(TextOptions) if "option" in f.metadata}
    fields = ChatCompletionRequest.model_fields
    assert len(CHAT_OPTION_FIELDS) >= 18
    for name in CHAT_OPTION_FIELDS:
        assert fields[name].description.removeprefix("extension: ") == docs[name], name
        assert fields[name].default == (0 if name == "priority" else None), name
    assert ChatCompletionRequest.__name__ == "ChatCompletionRequest" and "messages" in fields


def test_openai_image_option_fields_come_from_the_specs() -> None:
    import dataclasses
    from typing import Optional

    from multistream._spec import body_fields
    from multistream.image import ImageOptions
    from multistream.server.openai.images.protocol import IMAGE_OPTION_FIELDS, ImageGenerationRequest

    specs = body_fields(ImageOptions)
    docs = {f.name: f.metadata["option"].doc for f in dataclasses.fields(ImageOptions) if "option" in f.metadata}
    fields = ImageGenerationRequest.model_fields
    # Every OpenAI image field with an ImageOptions namesake is one of them (none hand-written).
    assert set(IMAGE_OPTION_FIELDS) == set(fields) & set(docs)
    assert {"steps", "seed", "guidance_scale", "negative_prompt", "priority"} <= set(IMAGE_OPTION_FIELDS)
    for name in IMAGE_OPTION_FIELDS:
        assert fields[name].description == "extension: " + docs[name], name  # the spec's description
        assert fields[name].default == specs[name][1].default, name  # null (the model's default), priority 0
        wire = specs[name][0]
        assert fields[name].annotation in (wire, Optional[wire]), name
    assert ImageGenerationRequest.__name__ == "ImageGenerationRequest" and "prompt" in fields and "size" in fields
    text = (ROOT / "multistream/server/openai/images/protocol.py").read_text(encoding="utf-8")
    assert 'description="extension: denoising steps"' not in text


def test_native_image_body_fields_are_the_specs() -> None:
    from multistream._spec import body_fields
    from multistream.image import ImageOptions
    from multistream.server.bodies import ImageBody

    specs = body_fields(ImageOptions)
    fields = ImageBody.model_fields
    assert set(fields) == {"prompt", *specs}
    for name, (wire, field) in specs.items():
        assert fields[name].description == field.description and fields[name].default == field.default, name
        assert fields[name].annotation == wire, name
