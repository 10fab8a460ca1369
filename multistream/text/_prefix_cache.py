"""Prompt prefix caching: a new request starts from the KV rows of an earlier prompt it begins with.

Chat prompts share their start: the chat template, the system prompt (SmolLM2's template adds one
of 20 tokens to every conversation), a tool list, an earlier turn of the same conversation. After a
prompt is prefilled, its row of the KV cache is kept here (a copy, in a least-recently-used store
bounded in bytes); a later request whose prompt begins with the same tokens takes a copy of that
many columns and prefills only the rest, as a prompt cut by ``prefill_budget`` continues from its
first chunk. vLLM's automatic prefix caching and llama.cpp's prompt cache do the same.

It is exact only where a chunked prefill is: a key or value of position ``i`` must not depend on
how many tokens its forward held. The native layers compute every position alone (one arithmetic,
`multistream.text._accel.native_layers`), so the batcher turns the cache on only for a model whose
every decoder layer runs on them (the embedded model's default); other models prefill whole
prompts as before, whose GEMMs round differently by shape.

Example:
    >>> import torch
    >>> from multistream.text._kv_rows import RowCache
    >>> cache = PrefixCache(max_bytes=1 << 20)
    >>> row = RowCache.from_layers([(torch.ones(1, 1, 6, 2), torch.ones(1, 1, 6, 2))], torch.ones(1, 6))
    >>> cache.store([1, 2, 3, 4, 5, 6], row)
    >>> hit = cache.lookup([1, 2, 3, 4, 9, 9], min_tokens=2)
    >>> hit[0], hit[1].length
    (4, 4)
    >>> cache.lookup([1, 2, 3, 4, 5, 6], min_tokens=2)[0]   # the last token is always prefilled
    5
    >>> cache.lookup([1, 2, 3, 4, 9, 9], min_tokens=2, salt="tenant-b") is None   # another salt: nothing shared
    True

A request's ``cache_salt`` (vLLM's name) keeps its prompts apart: an entry is found only by
lookups with the same salt, so one user's time to first token cannot reveal whether another's
prompt began the same way. A server with API keys salts each key's requests with its name. The
store's room is shared by every salt (one least-recently-used order, as in vLLM), so a tenant can
still push another's prompts out, though never read them.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from ._kv_rows import RowCache

__all__ = ["DEFAULT_PREFIX_CACHE_BYTES", "MIN_PREFIX_TOKENS", "PrefixCache"]

# 512 MiB: the embedded model's keys and values take 46 KB a token (30 layers x 3 KV heads x 64 x
# 2 x fp32), so about 11,600 tokens of prompts: a conversation as long as its 8,192-token context
# and the system prompts beside it. A long conversation is where a cache pays most: on 2 cores a
# 2,000-token prompt takes 12-14 s to prefill, its next turn 0.3 s from the cache (64 MiB, the first
# default, held 1,400 tokens and so none of it). llama.cpp's server keeps 8 GiB of prompts.
DEFAULT_PREFIX_CACHE_BYTES = 512 << 20
# A shorter shared start is not worth a copy and a separate prefill forward.
MIN_PREFIX_TOKENS = 8


class PrefixCache:
    """Prefilled prompts' KV rows (one row each, no padding), least recently used out first.

    ``lookup`` returns ``(tokens, rows)``: how many leading tokens of the prompt are covered (never
    all of them: the prompt's last token is prefilled to give the first logits) and a private copy
    of their keys and values, which the request's cache then grows from.
    """

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        # (salt, prompt tokens) -> (its KV row, bytes)
        self._entries: OrderedDict[tuple[str | None, tuple[int, ...]], tuple[RowCache, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the engine thread writes; close() may clear from another
        self.hits = 0  # requests that started from a cached prefix (tests and benchmarks read these)
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, tokens: list[int], rows: RowCache, index: int = 0, *, salt: str | None = None) -> None:
        """Keep a copy of row ``index`` of ``rows``, which holds exactly ``tokens`` (a prompt just
        prefilled), for later prompts of the same ``salt`` that begin with them. Too big for the
        store: not kept."""
        prompt = tuple(tokens)
        key = (salt, prompt)
        per_token = sum(k.shape[1] * k.shape[3] * k.element_size() + v.shape[1] * v.shape[3] * v.element_size()
                        for k, v in rows.kv())
        size = per_token * len(prompt)
        with self._lock:
            if key in self._entries:  # the same prompt again: nothing new to copy
                self._entries.move_to_end(key)
                return
        if size > self.max_bytes:
            return
        row = rows.select([index])  # a copy, without the batch's padding
        if row.length != len(prompt):
            return
        with self._lock:
            # A stored prompt that the new one extends (an earlier turn) adds nothing the new one lacks.
            for other in [k for k in self._entries
                          if k[0] == salt and len(k[1]) < len(prompt) and prompt[: len(k[1])] == k[1]]:
                self._bytes -= self._entries.pop(other)[1]
            self._entries[key] = (row, size)
            self._bytes += size
            while self._bytes > self.max_bytes and self._entries:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed

    def lookup(self, tokens: list[int], *, min_tokens: int = MIN_PREFIX_TOKENS,
               salt: str | None = None) -> tuple[int, RowCache] | None:
        """The longest cached start of ``tokens`` among prompts stored with ``salt`` (at least
        ``min_tokens``, at most all but the last token) and a copy of its keys and values; None
        when no such prompt shares enough."""
        wanted = tuple(tokens)
        with self._lock:
            best, best_key = 0, None
            for key in self._entries:
                if key[0] != salt:
                    continue
                shared = len(os.path.commonprefix([key[1], wanted]))  # element-wise, on any sequences
                if shared > best:
                    best, best_key = shared, key
            covered = min(best, len(tokens) - 1)
            if best_key is None or covered < min_tokens:
                return None
            self._entries.move_to_end(best_key)
            rows = self._entries[best_key][0]
        # A copy: the request's cache grows in place past these columns (lookahead writes there).
        layers = [(k[:, :, :covered].clone(), v[:, :, :covered].clone()) for k, v in rows.kv()]
        self.hits += 1
        self.reused_tokens += covered
        return covered, RowCache.from_layers(layers, rows.mask[:, :covered].clone(), rows.cache)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
