"""The embedded model's key/value cache, without importing transformers.

The engine keeps every stream's keys and values in transformers' ``DynamicCache`` layout: per
layer, ``keys`` and ``values`` shaped ``[rows, heads, length, head_dim]``, grown by ``update``.
`KVCache` is that layout and those calls (``layers``, ``update``, ``get_seq_length``), which is
all the native layers, the decode step and `RowCache` use; `LeanLlamaForCausalLM` gives the
engine one (``new_cache``), so serving the embedded model never imports transformers (about
0.7 s of every start). A model of transformers gets ``DynamicCache``, which its forward needs.

Example:
    >>> import torch
    >>> cache = KVCache()
    >>> k, v = cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    >>> cache.get_seq_length(0), len(cache.layers)
    (3, 1)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KVCache", "KVLayer"]


class KVLayer:
    """One layer's keys and values (transformers' ``DynamicLayer`` fields). ``keys`` is None
    until the first ``update``."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        self.keys = keys
        self.values = values

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append these columns; the layer's keys and values after it (new tensors, as
        ``DynamicLayer.update`` makes them)."""
        if self.keys is None or self.values is None:
            self.keys = keys.clone(memory_format=torch.contiguous_format)
            self.values = values.clone(memory_format=torch.contiguous_format)
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])


class KVCache:
    """Per-layer keys and values in ``DynamicCache``'s layout (module docstring). ``layers``: the
    ``(keys, values)`` of each layer to start from (copied, as ``DynamicCache(ddp_cache_data=)``
    copies them: the engine grows a cache in place, so it must not share another's buffers).

    Example:
        >>> KVCache([(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))]).get_seq_length()
        2
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.layers: list[KVLayer] = []
        for keys, values in layers or []:
            layer = KVLayer()
            layer.update(keys, values)
            self.layers.append(layer)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *_: Any, **__: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys`` and ``values`` to layer ``layer_idx``; its keys and values after it."""
        while len(self.layers) <= layer_idx:
            self.layers.append(KVLayer())
        return self.layers[layer_idx].update(keys, values)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def as_dynamic(self) -> Any:
        """transformers' ``DynamicCache`` of the same keys and values (for transformers' forward)."""
        from transformers import DynamicCache

        dynamic = DynamicCache()
        for i, layer in enumerate(self.layers):
            if layer.keys is not None and layer.values is not None:
                dynamic.update(layer.keys, layer.values, i)
        return dynamic

    def take(self, dynamic: Any) -> None:
        """Hold the layers of ``dynamic`` (a ``DynamicCache`` that transformers' forward grew from
        `as_dynamic`), so callers that grow this cache in place see the new columns."""
        self.layers = [KVLayer(layer.keys, layer.values) for layer in dynamic.layers]
