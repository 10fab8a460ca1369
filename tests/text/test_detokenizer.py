"""Incremental detokenization is exact: deltas concatenate to the full decode, for any tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from multistream.text._detokenizer import IncrementalDetokenizer

SAMPLES = [
    "Hello, world! Streaming text token by token.",
    "日本語のテキストを少しずつ表示します。",
    "中文流式输出：你好，世界！",
    "Emoji 🌊🐟 and a family 👨‍👩‍👧‍👦, skin tone 👍🏽, flag 🇯🇵.",
    "def reverse(s: str) -> str:\n    return s[::-1]  # tabs\tand  double  spaces\n",
    "  leading spaces, trailing space ",
    "mixed: café naïve Ελληνικά русский עברית العربية 한국어",
]


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer (Metaspace + byte fallback), trained here so nothing is downloaded."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    tok.train_from_iterator(["hello world streaming text token by token " * 20, "def reverse return"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _wordpiece_like() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"])
    tok.train_from_iterator(["hello world streaming text token by token"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]")


def assert_exact(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.feed(i) for i in ids]
    deltas.append(detok.flush())
    full = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas[:-1]), "a half-decoded character leaked out"


@pytest.mark.parametrize("text", SAMPLES)
def test_sentencepiece_with_byte_fallback(text):
    assert_exact(_sentencepiece_like(), text)


@pytest.mark.parametrize("text", SAMPLES[:1] + SAMPLES[5:6])
def test_wordpiece(text):
    assert_exact(_wordpiece_like(), text)


@pytest.mark.model
@pytest.mark.parametrize("text", SAMPLES)
def test_embedded_model_tokenizer(text_tokenizer, text):
    # SmolLM2 is byte-level BPE: CJK and emoji span several tokens each.
    assert_exact(text_tokenizer, text)


@pytest.mark.model
def test_stopping_mid_character_loses_nothing(text_tokenizer):
    ids = text_tokenizer("🌊", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1, "the emoji should take several byte-level tokens"
    detok = IncrementalDetokenizer(text_tokenizer)
    streamed = "".join(detok.feed(i) for i in ids[:-1])
    assert streamed == ""  # nothing half-decoded was emitted
    tail = detok.flush()  # generation stopped here: the partial bytes are not dropped
    assert tail == text_tokenizer.decode(ids[:-1]) and tail


@pytest.mark.model
def test_no_empty_deltas_are_counted_as_text(text_tokenizer):
    ids = text_tokenizer("日本語", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(text_tokenizer)
    non_empty = [d for d in (detok.feed(i) for i in ids) if d]
    assert "".join(non_empty) + detok.flush() == "日本語"
