"""Constrained decoding with ``allowed=`` (on llguidance): what is written is exactly what the pattern admits."""

from __future__ import annotations

import pytest
import regex

import multistream as ms
from multistream.text._constraints import compile_allowed, constraint_for, grammar_of


def test_bad_allowed_values_are_clear_errors() -> None:
    with pytest.raises(ms.InvalidArgumentError, match="not a valid regular expression"):
        compile_allowed("a(")
    with pytest.raises(ms.InvalidArgumentError, match="non-empty list"):
        compile_allowed([])
    assert compile_allowed(["a.b", "c"]) == r"a\.b|c"


def test_a_tokenizer_without_a_tokenizers_backend_is_a_clear_error() -> None:
    class SlowTokenizer:  # what a transformers tokenizer loaded with use_fast=False lacks: backend_tokenizer
        eos_token_id = 0

    with pytest.raises(ms.InvalidArgumentError, match="need a fast tokenizer.*SlowTokenizer is not one"):
        constraint_for(grammar_of(compile_allowed("yes|no"), None), SlowTokenizer(), frozenset({0}), vocab_size=8)


def test_the_mask_keeps_only_tokens_that_extend_a_match(text_tokenizer) -> None:
    eos = frozenset({text_tokenizer.eos_token_id})
    allowed = constraint_for(grammar_of(compile_allowed("yes|no"), None), text_tokenizer, eos)
    first = allowed.allowed_ids([])
    texts = [text_tokenizer.decode([t]) for t in first]
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert text_tokenizer.eos_token_id not in first  # an empty answer is no match: it may not end
    done = text_tokenizer("yes", add_special_tokens=False)["input_ids"]
    assert allowed.allowed_ids(done) == [text_tokenizer.eos_token_id]


@pytest.mark.model
def test_the_answer_matches_the_pattern(text_model) -> None:
    pattern = r"a (red|green|blue) (circle|square) on a (white|black) background"
    final = text_model.generate("Describe a picture of the sea.", allowed=pattern, max_new_tokens=24)
    assert regex.fullmatch(pattern, final.text), final.text
    assert final.finish_reason == "stop"
    choice = text_model.generate("Is fire hot? Answer yes or no.", allowed=["yes", "no"], temperature=0.8, seed=3)
    assert choice.text in ("yes", "no")
