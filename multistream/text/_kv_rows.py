"""A KV cache whose rows are separate requests, left-padded to one length: join, leave, split.

transformers' `DynamicCache` (or the embedded model's `KVCache`, the same layout) holds, per
layer, keys and values shaped ``[rows, heads, length, dim]``. Requests of different lengths share it by left padding: row ``i`` has
``mask[i, j] == 0`` for its padding columns, and its own position ids (tokens before it in *its*
sequence, not the column). These functions reshape such a cache between two decoding steps, so
requests can join (after their own prefill), leave (finished, cancelled) or pause (a higher
priority needs the slot) without recomputing anything.

Example:
    >>> import torch
    >>> a = RowCache.from_layers([(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))], torch.ones(1, 3))
    >>> b = RowCache.from_layers([(torch.ones(1, 1, 5, 2), torch.ones(1, 1, 5, 2))], torch.ones(1, 5))
    >>> both = RowCache.concat(a, b)
    >>> both.mask.tolist()
    [[0.0, 0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
    >>> both.select([0]).mask.tolist()          # leading padding is trimmed
    [[1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._kv_cache import KVCache, KVLayer

__all__ = ["RowCache", "cache_of", "supports_row_cache"]


def _layers(cache: Any) -> list[Any]:
    return list(getattr(cache, "layers", []))


def supports_row_cache(cache: Any) -> bool:
    """True if every layer is a plain growing key/value layer (no sliding window, no state)."""
    layers = _layers(cache)
    if layers and all(type(layer) is KVLayer for layer in layers):
        return True
    from transformers.cache_utils import DynamicLayer

    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]], like: Any = None) -> Any:
    """A cache holding ``layers`` (copied), of the kind of ``like``: a `KVCache` where ``like`` is
    one (the embedded model's), else transformers' ``DynamicCache``."""
    if isinstance(like, KVCache):
        return KVCache(layers)
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers)


@dataclass
class RowCache:
    """A `DynamicCache` or `KVCache` plus the attention mask (rows x columns) that says which
    columns are real."""

    cache: Any
    mask: torch.Tensor

    @classmethod
    def from_layers(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                    like: Any = None) -> RowCache:
        """``layers`` in a cache of the kind of ``like`` (`cache_of`), with ``mask``."""
        return cls(cache_of(layers, like), mask)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in _layers(self.cache)]

    def select(self, rows: list[int]) -> RowCache:
        """A cache of just these rows (in this order), with columns no row uses trimmed off (leading
        padding, and the columns past every row's end that lookahead leaves behind)."""
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        stop = int(used[-1]) + 1 if used.numel() else mask.shape[1]
        layers = [
            (k.index_select(0, index.to(k.device))[:, :, start:stop],
             v.index_select(0, index.to(v.device))[:, :, start:stop])
            for k, v in self.kv()
        ]
        return RowCache.from_layers(layers, mask[:, start:stop], self.cache)

    def spans(self) -> list[tuple[int, int]] | None:
        """Each row's columns ``(start, end)`` if every row is padding, tokens, padding (None otherwise).

        Rows end at the last column unless a lookahead step kept fewer columns for some rows than
        for others (`keep`): each row then attends to its own span, and its next token goes at its end.

        Example:
            >>> RowCache(None, torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])).spans()
            [(1, 3), (0, 4)]
        """
        mask = self.mask.to(torch.int8)
        counts = mask.sum(1)
        first = mask.argmax(1)
        ends = first + counts
        columns = torch.arange(mask.shape[1], device=mask.device)
        expected = (columns[None, :] >= first[:, None]) & (columns[None, :] < ends[:, None])
        if not bool(torch.equal(expected.to(torch.int8), mask)):
            return None
        return list(zip(first.tolist(), ends.tolist()))

    def keep(self, spans: list[tuple[int, int]]) -> None:
        """In place, after a step wrote its tokens: row ``r`` now holds columns ``spans[r]`` (the
        tokens it accepted; what lies past its end is free to be written again), and the layers
        are narrowed to the last column any row holds (views: the buffers stay)."""
        width = max(end for _, end in spans)
        for layer in _layers(self.cache):
            if layer.keys.shape[2] != width:  # only where a row wrote drafts it did not keep: a step's 60 views cost ~0.15 ms
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
        columns = torch.arange(width, device=self.mask.device)
        starts = torch.tensor([s for s, _ in spans], device=self.mask.device)
        ends = torch.tensor([e for _, e in spans], device=self.mask.device)
        self.mask = ((columns[None, :] >= starts[:, None]) & (columns[None, :] < ends[:, None])).to(self.mask.dtype)

    def aligned(self) -> RowCache:
        """The same rows with every row ending at the last column (left padding only), as
        transformers' forward needs them; rows that end earlier are copied to the right."""
        spans = self.spans()
        width = self.length
        if spans is None or all(end == width for _, end in spans):
            return self
        layers = []
        for k, v in self.kv():
            k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
            for r, (start, end) in enumerate(spans):
                k2[r, :, width - (end - start):] = k[r, :, start:end]
                v2[r, :, width - (end - start):] = v[r, :, start:end]
            layers.append((k2, v2))
        columns = torch.arange(width, device=self.mask.device)
        sizes = torch.tensor([end - start for start, end in spans], device=self.mask.device)
        mask = (columns[None, :] >= width - sizes[:, None]).to(self.mask.dtype)
        return RowCache.from_layers(layers, mask, self.cache)

    def reorder(self, rows: list[int], sources: list[int]) -> None:
        """In place: row ``rows[j]`` becomes a copy of row ``sources[j]`` (as it was before), in
        every layer; one index-select per tensor. The mask is unchanged (a beam search's rows share
        their padding), and rows not named keep their keys and values untouched.

        Example:
            >>> c = RowCache.from_layers([(torch.arange(3.).view(3, 1, 1, 1), torch.zeros(3, 1, 1, 1))], torch.ones(3, 1))
            >>> c.reorder([1, 2], [2, 2]); c.kv()[0][0].flatten().tolist()
            [0.0, 2.0, 2.0]
        """
        for k, v in self.kv():
            dst = torch.tensor(rows, device=k.device)
            src = torch.tensor(sources, device=k.device)
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def crop(self, length: int) -> RowCache:
        """The first ``length`` columns (a single unpadded row: its first ``length`` tokens)."""
        layers = [(k[:, :, :length], v[:, :, :length]) for k, v in self.kv()]
        return RowCache.from_layers(layers, self.mask[:, :length], self.cache)

    def left_pad(self, columns: int) -> RowCache:
        if columns <= 0:
            return self
        layers = []
        for k, v in self.kv():
            pad = (0, 0, columns, 0)
            layers.append((torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)))
        mask = torch.nn.functional.pad(self.mask, (columns, 0))
        return RowCache.from_layers(layers, mask, self.cache)

    @staticmethod
    def concat(first: RowCache, second: RowCache) -> RowCache:
        """Rows of ``first`` then rows of ``second``, left-padded to the longer of the two."""
        length = max(first.length, second.length)
        a, b = first.left_pad(length - first.length), second.left_pad(length - second.length)
        layers = [
            (torch.cat([ka, kb.to(ka.device)], 0), torch.cat([va, vb.to(va.device)], 0))
            for (ka, va), (kb, vb) in zip(a.kv(), b.kv())
        ]
        return RowCache.from_layers(layers, torch.cat([a.mask, b.mask], 0), first.cache)
