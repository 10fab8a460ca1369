"""A KV cache whose rows are separate requests, left-padded to one length: join, leave, split.

transformers' `DynamicCache` holds, per layer, keys and values shaped ``[rows, heads, length,
dim]``. Requests of different lengths share it by left padding: row ``i`` has
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

__all__ = ["RowCache", "supports_row_cache"]


def _layers(cache: Any) -> list[Any]:
    return list(getattr(cache, "layers", []))


def supports_row_cache(cache: Any) -> bool:
    """True if every layer is a plain growing key/value layer (no sliding window, no state)."""
    from transformers.cache_utils import DynamicLayer

    layers = _layers(cache)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


@dataclass
class RowCache:
    """A `DynamicCache` plus the attention mask (rows x columns) that says which columns are real."""

    cache: Any
    mask: torch.Tensor

    @classmethod
    def from_layers(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> RowCache:
        from transformers import DynamicCache

        return cls(DynamicCache(ddp_cache_data=layers), mask)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in _layers(self.cache)]

    def select(self, rows: list[int]) -> RowCache:
        """A cache of just these rows (in this order), with columns no row uses trimmed off."""
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        layers = [
            (k.index_select(0, index.to(k.device))[:, :, start:], v.index_select(0, index.to(v.device))[:, :, start:])
            for k, v in self.kv()
        ]
        return RowCache.from_layers(layers, mask[:, start:])

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
        return RowCache.from_layers(layers, self.mask[:, :length])

    def left_pad(self, columns: int) -> RowCache:
        if columns <= 0:
            return self
        layers = []
        for k, v in self.kv():
            pad = (0, 0, columns, 0)
            layers.append((torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)))
        mask = torch.nn.functional.pad(self.mask, (columns, 0))
        return RowCache.from_layers(layers, mask)

    @staticmethod
    def concat(first: RowCache, second: RowCache) -> RowCache:
        """Rows of ``first`` then rows of ``second``, left-padded to the longer of the two."""
        length = max(first.length, second.length)
        a, b = first.left_pad(length - first.length), second.left_pad(length - second.length)
        layers = [
            (torch.cat([ka, kb.to(ka.device)], 0), torch.cat([va, vb.to(va.device)], 0))
            for (ka, va), (kb, vb) in zip(a.kv(), b.kv())
        ]
        return RowCache.from_layers(layers, torch.cat([a.mask, b.mask], 0))
