"""Per-token logprob entries: each token's own text and UTF-8 bytes, and the entry dicts of the protocol.

A token's text on its own is not always text: a byte-level BPE token can hold half of a UTF-8
character (CJK, emoji). So each entry carries the token's exact ``bytes``: the bytes of an
answer's tokens, joined, are the answer's UTF-8 (what OpenAI's ``bytes`` field promises), and
``token`` is those bytes decoded with replacement characters for the incomplete ones.

`TokenTable` finds the bytes from the tokenizer's own vocabulary (the byte-level alphabet of GPT-2
style tokenizers, ``<0xNN>`` pieces and ``▁`` of SentencePiece ones), once per token id, cached.
`entries` turns one step's numbers (already on the CPU, as plain lists) into the entry dicts.

Example:
    >>> from transformers import AutoTokenizer                                  # doctest: +SKIP
    >>> table = TokenTable(AutoTokenizer.from_pretrained("gpt2"))              # doctest: +SKIP
    >>> table.info(995)                                                         # doctest: +SKIP
    (' world', [32, 119, 111, 114, 108, 100])
"""

from __future__ import annotations

import json
import logging
from typing import Any

__all__ = ["TokenTable", "entries"]

logger = logging.getLogger("multistream")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, inverted: char -> byte.

    GPT-2's ``bytes_to_unicode`` (transformers has it in ``convert_slow_tokenizer``, whose import
    costs 1.4 s): the printable Latin-1 bytes stand for themselves, the other 68 bytes take the
    characters from U+0100 on, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in printable)
    stand_ins = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in stand_ins.items()}


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "decode"
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - an unusual tokenizer: decode token by token
        return "decode"
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
        return "sentencepiece"
    return "decode"


class TokenTable:
    """``info(token_id) -> (text, bytes)`` for one tokenizer, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._kind = _decoder_kind(tokenizer)
        self._alphabet = _byte_alphabet() if self._kind == "bytelevel" else {}
        special = getattr(tokenizer, "all_special_ids", None) or []
        self._special = set(int(i) for i in special)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        if token_id in self._special:
            # Special tokens are not part of the answer's text; their bytes spell their name.
            return str(tok.convert_ids_to_tokens(token_id)).encode("utf-8")
        if self._kind == "bytelevel":
            piece = tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._alphabet for c in piece):
                return bytes(self._alphabet[c] for c in piece)
        elif self._kind == "sentencepiece":
            piece = tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    try:
                        return bytes([int(piece[3:5], 16)])
                    except ValueError:
                        pass
                return piece.replace("\u2581", " ").encode("utf-8")
        return str(tok.decode([token_id], skip_special_tokens=False)).encode("utf-8")

    def info(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = found
        return found


def entries(table: TokenTable, chosen: int, logprob: float, top_ids: list[int],
            top_values: list[float]) -> dict[str, Any]:
    """The protocol's entry for one token: ``{"token_id", "token", "bytes", "logprob", "top_logprobs"}``."""
    text, raw = table.info(chosen)
    top = []
    for tid, value in zip(top_ids, top_values):
        t_text, t_raw = table.info(tid)
        top.append({"token_id": tid, "token": t_text, "bytes": t_raw, "logprob": value})
    return {"token_id": chosen, "token": text, "bytes": raw, "logprob": logprob, "top_logprobs": top}
