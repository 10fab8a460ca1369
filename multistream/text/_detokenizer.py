"""Incremental detokenization that is exact for any tokenizer: ``feed()`` token ids, ``flush()``.

Decoding token by token is wrong for most tokenizers: a byte-level BPE token can hold half of a
UTF-8 character (Chinese, emoji), and SentencePiece tokenizers drop or add spaces depending on
the neighbouring token. So each new token is decoded together with a few tokens before it (the
"prefix window"), and only the text that the window adds beyond its prefix is emitted. Text that
ends in an incomplete character (U+FFFD) is held back until a later token completes it.
``flush()`` decodes the whole output once and emits what is still missing, so the concatenation of
all deltas equals the full decode, and nothing is lost when generation stops mid-character.

I/O-free: the caller decides when to feed and what to do with the text.

Example:
    >>> from transformers import AutoTokenizer                     # doctest: +SKIP
    >>> detok = IncrementalDetokenizer(AutoTokenizer.from_pretrained("gpt2"))  # doctest: +SKIP
    >>> "".join(detok.feed(i) for i in [15496, 995]) + detok.flush()          # doctest: +SKIP
    'Hello world'
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["IncrementalDetokenizer"]

logger = logging.getLogger("multistream")

_REPLACEMENT = "\ufffd"
# A window of undecidable text (a tokenizer whose decoding is not prefix-stable) is given up on
# after this many tokens, so a long such run costs linear, not quadratic, decoding work.
_MAX_UNSTABLE_WINDOW = 16


def _decode_function(tokenizer: Any) -> Any:
    """The fastest exact decode available: the Rust tokenizer when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas. See the module docstring.

    The output is decoded on its own, without the prompt, exactly as ``tokenizer.decode(ids)``
    of the whole output would be, so a leading space is kept or dropped the same way.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._decode = _decode_function(tokenizer)
        self.ids: list[int] = []
        self.emitted = ""  # everything returned so far
        # Offsets into ids: text of ids[:_read] has been emitted; ids[_prefix:_read] anchor the next.
        self._prefix = 0
        self._read = 0

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self.ids.append(token_id)
        ids = self.ids
        prefix_text = self._decode(ids[self._prefix : self._read])
        new_text = self._decode(ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            if not new_text.startswith(prefix_text) and len(ids) - self._prefix <= _MAX_UNSTABLE_WINDOW:
                # The new token changed how earlier text decodes; a later token or the flush
                # reconciles it (past the window's limit, the text follows the streamed deltas).
                return ""
            self._prefix = self._read
            self._read = len(ids)
            self.emitted += delta
            return delta
        return ""

    def prime(self, ids: list[int]) -> str:
        """Start from output that already exists (a resumed or rewound generation); returns its text.

        Later deltas continue that text exactly as if its tokens had been fed one by one.
        """
        self.ids = list(ids)
        self.emitted = self._decode(self.ids) if self.ids else ""
        self._read = len(self.ids)
        self._prefix = max(0, self._read - 4)
        return self.emitted

    def flush(self) -> str:
        """Emit whatever the full decode has beyond what was emitted (end of generation)."""
        full = self._decode(self.ids)
        if full.startswith(self.emitted):
            rest = full[len(self.emitted) :]
        else:
            # Only tokenizers whose decoding is not prefix-stable get here; the deltas already sent
            # cannot be taken back, so send the window's remainder and keep deltas == text.
            logger.warning("tokenizer decoding is not prefix-stable; final text follows the streamed deltas")
            prefix_text = self._decode(self.ids[self._prefix : self._read])
            rest = self._decode(self.ids[self._prefix :])[len(prefix_text) :]
        self._prefix = self._read = len(self.ids)
        self.emitted += rest
        return rest
