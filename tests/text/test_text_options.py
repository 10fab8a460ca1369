"""Argument checks shared by the real text model, the fake and the server (no model needed)."""

from __future__ import annotations

import re

import pytest

import multistream as ms
from multistream.testing import ScriptedTextModel
from multistream.text._options import parse_text_options


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": 2**64}, "seed must be an integer in [0, 2**63)"),
        ({"seed": -1}, "seed must be an integer in [0, 2**63)"),
        ({"chunk_ms": 0}, "chunk_ms must be"),
        ({"chunk_tokens": 0}, "chunk_tokens must be"),
        ({"chat": "yes"}, "chat must be True, False or None"),
        ({"repetition_penalty": 0}, "repetition_penalty must be"),
        ({"top_k": 1.5}, "top_k must be"),
        ({"max_tokens": 5}, "Did you mean 'max_new_tokens'"),
    ],
)
def test_bad_options_are_rejected_with_the_fix(kwargs, message):
    with pytest.raises(ms.InvalidArgumentError, match=re.escape(message)):
        parse_text_options(**kwargs)


def test_the_fake_model_rejects_exactly_what_the_real_one_does():
    with pytest.raises(ms.InvalidArgumentError, match="seed must be"):
        ScriptedTextModel().stream("hi", seed=2**64)
    with pytest.raises(ms.InvalidArgumentError, match="Did you mean 'temperature'"):
        ScriptedTextModel().stream("hi", temprature=1.0)


def test_good_options_normalise():
    opts = parse_text_options(stop="END", temperature=1, seed=3)
    assert opts.stop == ("END",) and opts.temperature == 1.0 and isinstance(opts.temperature, float)


def test_an_unknown_message_role_is_refused_with_the_roles():
    with pytest.raises(ms.InvalidArgumentError) as info:
        ScriptedTextModel().stream([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
    assert str(info.value) == ("messages[1]['role'] is 'robot'; a chat message's role is one of "
                               "system, developer, user, assistant, tool")
    assert ms.text.check_messages([{"role": "developer", "content": "be brief"}])[0]["role"] == "system"
