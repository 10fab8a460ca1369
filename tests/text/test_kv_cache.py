"""`KVCache` (the embedded model's engine cache, `multistream.text._kv_cache`) against transformers'
``DynamicCache``: the same columns after the same calls, and `RowCache` keeps a cache's kind."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from multistream.text._kv_cache import KVCache
from multistream.text._kv_rows import RowCache, supports_row_cache


def _kv(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, length, 4, generator=g), torch.randn(rows, 2, length, 4, generator=g)


def test_updates_hold_what_a_dynamic_cache_holds() -> None:
    mine, theirs = KVCache(), DynamicCache()
    assert mine.get_seq_length(0) == theirs.get_seq_length(0) == 0
    for step, length in enumerate((5, 1, 3)):
        for layer in range(3):
            k, v = _kv(2, length, 10 * step + layer)
            a, b = mine.update(k, v, layer), theirs.update(k, v, layer)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert mine.get_seq_length(1) == theirs.get_seq_length(1) == 5 + (1 if step else 0) + (3 if step > 1 else 0)
    assert mine.get_seq_length(7) == 0
    back = KVCache()
    back.take(mine.as_dynamic())
    assert all(torch.equal(x.keys, y.keys) for x, y in zip(back.layers, mine.layers))


def test_layers_given_are_copied_not_shared() -> None:
    """The engine grows caches in place: a cache built from another's tensors must not write into them."""
    k, v = _kv(1, 4, 0)
    cache = KVCache([(k[:, :, :3], v[:, :, :3])])
    cache.layers[0].keys[0, 0, 0, 0] = 99.0
    assert k[0, 0, 0, 0] != 99.0 and cache.get_seq_length() == 3


def test_row_caches_keep_the_kind_of_their_cache() -> None:
    """Select, crop, concat and pad give a `KVCache` from a `KVCache` (no transformers import on the
    embedded model's path) and a ``DynamicCache`` from a ``DynamicCache``, with the same tensors."""
    layers = [_kv(2, 5, i) for i in range(2)]
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    ours = RowCache(KVCache(layers), mask)
    theirs = RowCache(DynamicCache(ddp_cache_data=layers), mask)
    assert supports_row_cache(ours.cache) and supports_row_cache(theirs.cache)
    for make in (lambda r: r.select([1, 0]), lambda r: r.crop(3), lambda r: RowCache.concat(r, r.select([0])),
                 lambda r: r.left_pad(2)):
        a, b = make(ours), make(theirs)
        assert isinstance(a.cache, KVCache) and isinstance(b.cache, DynamicCache)
        assert torch.equal(a.mask, b.mask)
        for (ka, va), (kb, vb) in zip(a.kv(), b.kv()):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
