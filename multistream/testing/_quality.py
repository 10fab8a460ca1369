"""How close a (quantized) causal LM stays to its reference: greedy agreement and perplexity.

Used by ``benchmarks/cpu_decode.py`` and the quantization tests: the same prompts through two
models, the length of the greedy prefix they share, and the perplexity of fixed paragraphs.

Example:
    >>> agreement([5, 6, 7, 8], [5, 6, 9, 9])
    0.5
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["agreement", "greedy_tokens", "perplexity"]


def greedy_tokens(model: Any, prompt_ids: list[int], n: int, eos_token_ids: Iterable[int] = ()) -> list[int]:
    """The first ``n`` greedy tokens after ``prompt_ids`` (one row, a KV cache; ends after an EOS).

    Example:
        >>> greedy_tokens(llm.model, llm.encode_prompt("hi"), 8, llm.eos_token_ids)   # doctest: +SKIP
        [22503, 17, 1073, 339, 2773, 346, 3117, 47]
    """
    from transformers import DynamicCache

    eos = set(eos_token_ids)
    device = next(model.parameters()).device
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < n:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = int(torch.argmax(logits[0, -1]))
            out.append(token)
            if token in eos:
                break
            ids = torch.tensor([[token]], device=device)
    return out


def agreement(reference: list[int], tokens: list[int]) -> float:
    """The share of ``reference`` that ``tokens`` reproduces before their first difference (0..1).

    Example:
        >>> agreement([1, 2, 3], [1, 2, 3]), agreement([1, 2, 3], [4, 2, 3])
        (1.0, 0.0)
    """
    if not reference:
        return 1.0
    same = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), min(len(reference), len(tokens)))
    return same / len(reference)


def perplexity(model: Any, tokenizer: Any, texts: Iterable[str]) -> float:
    """exp(mean negative log-likelihood) of every token of ``texts`` after its first, in fp32.

    Example:
        >>> perplexity(llm.model, llm.tokenizer, ["The cat sat on the mat."])   # doctest: +SKIP
        24.1
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]], device=device)
            if ids.shape[1] < 2:
                continue
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            total += float(nll)
            count += ids.shape[1] - 1
    return math.exp(total / max(count, 1))
