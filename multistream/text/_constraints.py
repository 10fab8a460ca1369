"""Constrained decoding on llguidance: ``allowed=`` (a regular expression or choices),
``json_schema=`` (a JSON Schema or a pydantic model class) and tool calls (`._tools`).

Every constraint is compiled into one llguidance grammar (`grammar_of`). Per stream, a
`TokenConstraint` holds the grammar's matcher: it writes the stream's row of the batch's token
bitmask, and consumes each token the stream takes. The batcher applies the rows of every
constrained stream to the batch's logits in one tensor operation (`apply_masks`), so constrained
and unconstrained streams share one batch. Why llguidance and not xgrammar: docs/constrained.md.

Checking an option never needs the tokenizer (the value is validated against the JSON Schema
meta-schema and by llguidance alone); compiling for a tokenizer happens when a stream starts.
Both have a time limit (`COMPILE_TIMEOUT_S`), and a bad schema or pattern is an
`InvalidArgumentError` that names the part.

Example:
    >>> import multistream as ms
    >>> llm = ms.load_text_model()                                              # doctest: +SKIP
    >>> llm.generate("Is the sky blue? Answer yes or no.", allowed=["yes", "no"]).text  # doctest: +SKIP
    'yes'
    >>> llm.generate("A person", json_schema={"type": "object", "properties": {"name": {"type": "string"}},
    ...                                       "required": ["name"]}).text       # doctest: +SKIP
    '{"name": "John Doe"}'
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from ._schemas import COMPILE_TIMEOUT_S, JSON_LAYOUT, check_json_schema, check_schema_value, first_line, limited
from ._tools import tools_active, tools_grammar

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMPILE_TIMEOUT_S",
    "TokenConstraint",
    "apply_masks",
    "check_json_schema",
    "check_schema_value",
    "compile_allowed",
    "constraint_for",
    "grammar_of",
]

# The characters Rust's regex_syntax::escape escapes (llguidance's regex dialect).
_META = set("\\.+*?()|[]{}^$#&-~")


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _META else c for c in text)


def compile_allowed(allowed: Any) -> str | None:
    """Check ``allowed=`` (a pattern, or a list of choices) and return it as one pattern."""
    if allowed is None:
        return None
    if isinstance(allowed, str):
        pattern = allowed
    elif isinstance(allowed, (list, tuple)) and allowed and all(isinstance(c, str) and c for c in allowed):
        pattern = "|".join(_escape(c) for c in allowed)
    else:
        raise InvalidArgumentError(
            f"allowed must be a regular expression string or a non-empty list of non-empty strings, got {allowed!r}"
        )
    import llguidance

    error = limited(lambda: llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern)),
                     f"allowed={pattern[:60]!r}")
    if error:
        detail = error.split("regex parse error:")[-1]
        raise InvalidArgumentError(
            f"allowed={allowed!r} is not a valid regular expression: {first_line(detail)} (the syntax is Rust's "
            "regex crate: no look-around or back-references)")
    return pattern


def grammar_of(allowed: str | None, json_schema: str | None, tools: str | None = None,
               tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> str | None:
    """The llguidance grammar of a stream's constraints (None: unconstrained)."""
    active = tools_active(tools, tool_choice)
    if not active and json_schema is None and allowed is None:
        return None  # without importing llguidance: a server may start this stream on its event loop
    import llguidance

    if active:
        assert tools is not None
        return llguidance.LLMatcher.grammar_from_lark(tools_grammar(tools, tool_choice, parallel_tool_calls,
                                                                    json_schema))
    if json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_LAYOUT)
    if allowed is not None:
        return llguidance.LLMatcher.grammar_from_regex(allowed)
    return None


# -- per tokenizer and per stream --------------------------------------------------------------------

_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_COMPILED: OrderedDict[tuple[int, str], Any] = OrderedDict()  # (id of LLTokenizer, grammar) -> fresh matcher
_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a fast tokenizer (built once per tokenizer: 0.3-0.8 s).

    Built from the Rust backend's JSON as ``llguidance.hf.from_tokenizer`` does, without its
    ``import transformers`` (1.4 s on 2 cores): the embedded model's own tokenizer is not a
    transformers one, and a first ``json_schema=`` request should not wait for that import.
    """
    import llguidance

    with _LOCK:
        per_size = _TOKENIZERS.setdefault(tokenizer, {})
        ll = per_size.get(vocab_size)
        if ll is None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:  # a slow tokenizer (llguidance.hf refuses those too)
                raise InvalidArgumentError(
                    f"allowed=, json_schema= and tools= need a fast tokenizer (one on the tokenizers library); "
                    f"this model's {type(tokenizer).__name__} is not one: load it with use_fast=True or leave "
                    "the constraint out")
            if backend.padding is not None or backend.truncation is not None:
                backend = copy.copy(backend)  # as from_tokenizer: none in the JSON (a copy costs 0.3 s)
                backend.no_padding()
                backend.no_truncation()
            ll = per_size[vocab_size] = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                               eos_token=tokenizer.eos_token_id)
        return ll


def constraint_for(grammar: str, tokenizer: Any, eos_token_ids: frozenset[int], vocab_size: int | None = None,
                   timeout_s: float | None = None) -> TokenConstraint:
    """A fresh `TokenConstraint` for ``grammar`` (compiled once per tokenizer, with a time limit)."""
    import llguidance

    size = vocab_size if vocab_size is not None else len(tokenizer)
    ll = _ll_tokenizer(tokenizer, size)
    key = (id(ll), grammar)
    with _LOCK:
        initial = _COMPILED.get(key)
        if initial is not None:
            _COMPILED.move_to_end(key)
    if initial is None:
        initial = limited(lambda: llguidance.LLMatcher(ll, grammar, log_level=0), "the constraint", timeout_s)
        if initial.is_error():
            raise InvalidArgumentError(f"the grammar engine rejects the constraint: {first_line(initial.get_error())}")
        with _LOCK:
            _COMPILED[key] = initial
            while len(_COMPILED) > 64:
                _COMPILED.popitem(last=False)
    return TokenConstraint(initial.deep_copy(), size, eos_token_ids)


class TokenConstraint:
    """One stream's place in its grammar: which tokens may come next, and the tokens taken.

    EOS is allowed exactly when the grammar accepts the answer so far; a stream whose grammar can
    take nothing more ends at once (`done`).
    """

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._initial = matcher.deep_copy()
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = sorted(e for e in eos_token_ids if e < vocab_size)
        self.words = (vocab_size + 31) // 32

    def fill(self, row: Any) -> None:
        """Write the allowed tokens into ``row`` (a C-contiguous int32 numpy array of `words`)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)
        accepting = self.matcher.is_accepting()
        for e in self.eos:  # all of the model's EOS tokens, exactly when the answer may end
            word, bit = divmod(e, 32)
            value = int(row[word]) & 0xFFFFFFFF
            value = value | (1 << bit) if accepting else value & ~(1 << bit)
            row[word] = value - (1 << 32) if value >= 1 << 31 else value
        if not row.any() and self.eos:  # a dead end must end (never loops forever)
            word, bit = divmod(self.eos[0], 32)
            row[word] = 1 << bit if bit < 31 else -(1 << 31)

    def consume(self, token: int) -> None:
        if token not in self.eos:
            self.matcher.consume_token(token)

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (a key of a JSON schema, its quotes and colon), at most
        ``limit``: lookahead's free drafts, kept unless the model spells the same text otherwise.

        Example:
            >>> tok.decode(constraint.forced(8)).startswith('"name"')  # after '{', schema {"name"}  # doctest: +SKIP
            True
        """
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]

    def admitted(self, tokens: list[int]) -> list[int]:
        """The longest start of ``tokens`` the grammar admits from here (drafts it would mask are
        not worth a position)."""
        return tokens[:int(self.matcher.validate_tokens(list(tokens)))] if tokens else []

    @property
    def done(self) -> bool:
        """The grammar is complete and can take no more tokens (only EOS could follow)."""
        return bool(self.matcher.is_stopped())

    def reset(self, answer_ids: list[int]) -> None:
        """Start over and take ``answer_ids`` (after a rewind, or to continue an earlier answer)."""
        self.matcher = self._initial.deep_copy()
        if answer_ids:
            self.matcher.consume_tokens(list(answer_ids))

    def allowed_ids(self, generated: list[int]) -> list[int]:
        """The tokens allowed after ``generated`` (tests and tools; the engine uses `fill`)."""
        import numpy as np

        probe = TokenConstraint(self._initial.deep_copy(), self.vocab_size, frozenset(self.eos))
        probe.reset(generated)
        row = np.zeros(self.words, dtype=np.int32)
        probe.fill(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.vocab_size]
        return [int(i) for i in np.flatnonzero(bits)]


def apply_masks(logits: torch.Tensor, constraints: list[TokenConstraint | None]) -> torch.Tensor:
    """``logits`` (rows x vocab) with every token a row's constraint forbids at -inf, in one
    ``masked_fill`` over the batch (rows without a constraint are left as they are)."""
    import numpy as np
    import torch

    rows = len(constraints)
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = np.full((rows, words), -1, dtype=np.int32)  # all allowed
    for i, c in enumerate(constraints):
        if c is not None:
            c.fill(bitmask[i, : c.words])
            bitmask[i, c.words :] = 0  # logits past the grammar's vocabulary: never allowed
    # numpy's unpackbits is single-threaded and fast; bits are little-endian (token 32w + b).
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    blocked = torch.from_numpy(allowed == 0)
    if blocked.device != logits.device:
        blocked = blocked.to(logits.device, non_blocking=True)
    # Out of place: the logits may be inference-mode tensors of the model's output.
    return logits.masked_fill(blocked, float("-inf"))
