"""Options declared once (issue 26, item 4): one engine capacity default, one text max_batch default,
the rewind options. Every body's namesakes of the families' options: tests/server/openai/test_options_openapi.py."""

from __future__ import annotations

import inspect
import re

import pytest

from multistream.engine import DEFAULT_CAPACITY, capacity_of
from multistream.errors import InvalidArgumentError
from multistream.server.state import _capacity
from multistream.testing import ScriptedImageModel

from repo_paths import ROOT


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


def test_every_family_checks_seed_with_one_message() -> None:
    from multistream.image import parse_image_options
    from multistream.text import parse_text_options
    from multistream.video import parse_video_options

    for parse in (parse_text_options, lambda **kw: parse_image_options("x", **kw),
                  lambda **kw: parse_video_options("x", **kw)):
        for bad in (-1, 2**63, 1.5):
            with pytest.raises(InvalidArgumentError) as info:
                parse(seed=bad)
            assert str(info.value) == f"seed must be an integer in [0, 2**63) or None, got {bad!r}"
            assert info.value.param == "seed"
