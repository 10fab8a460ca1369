"""Prompt prefix caching (`multistream.text._prefix_cache`): a prompt that begins like an earlier
one prefills only the rest, and streams exactly what a whole prefill streams."""

from __future__ import annotations

import threading

import pytest
import torch

import multistream as ms
from multistream.text._kv_rows import RowCache
from multistream.text._prefix_cache import PrefixCache


def _row(tokens: list[int], layers: int = 2) -> RowCache:
    """One unpadded row whose key at column j is the token there (so copies can be told apart)."""
    keys = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).repeat(1, 2, 1, 4)
    return RowCache.from_layers([(keys.clone(), -keys.clone()) for _ in range(layers)], torch.ones(1, len(tokens)))


# -- the store ----------------------------------------------------------------------------------


def test_lookup_gives_the_longest_shared_start_but_never_the_last_token() -> None:
    cache = PrefixCache()
    cache.store(list(range(20)), _row(list(range(20))))
    cache.store([0, 1, 2, 3, 50, 51, 52, 53, 54, 55], _row([0, 1, 2, 3, 50, 51, 52, 53, 54, 55]))
    covered, rows = cache.lookup(list(range(12)) + [99, 98])
    assert covered == 12 and rows.length == 12 and rows.rows == 1
    assert rows.kv()[0][0][0, 0, :, 0].tolist() == list(range(12))
    covered, _ = cache.lookup(list(range(20)))  # the same prompt again: its last token is prefilled
    assert covered == 19
    assert cache.lookup([0, 1, 2, 3, 4, 5, 6, 70, 71]) is None  # 7 shared tokens: under MIN_PREFIX_TOKENS
    assert cache.lookup([5] * 30) is None
    assert (cache.hits, cache.reused_tokens) == (2, 31)


def test_a_hit_is_a_private_copy() -> None:
    cache = PrefixCache()
    cache.store(list(range(16)), _row(list(range(16))))
    _, first = cache.lookup(list(range(16)) + [1])
    first.kv()[0][0].fill_(-1.0)  # a request's cache grows in place
    _, second = cache.lookup(list(range(16)) + [2])
    assert second.kv()[0][0][0, 0, :, 0].tolist() == list(range(16))


def test_the_store_keeps_to_its_bytes_and_drops_the_least_recently_used() -> None:
    per_prompt = 2 * 2 * (2 * 4 * 4) * 16  # layers x (k, v) x (heads x dim x fp32) x tokens
    cache = PrefixCache(max_bytes=2 * per_prompt)
    a, b, c = ([i] * 16 for i in (1, 2, 3))
    cache.store(a, _row(a))
    cache.store(b, _row(b))
    assert cache.lookup(a + [0]) is not None  # a is now the most recently used
    cache.store(c, _row(c))
    assert len(cache) == 2 and cache.lookup(b + [0]) is None and cache.lookup(a + [0]) is not None
    cache.store(list(range(100)), _row(list(range(100))))  # bigger than the whole store: not kept
    assert cache.lookup(list(range(100))) is None and len(cache) == 2
    cache.max_bytes = 0  # keeps nothing new
    cache.store([7] * 16, _row([7] * 16))
    assert cache.lookup([7] * 17) is None
    cache.clear()
    assert len(cache) == 0 and cache.lookup(a + [0]) is None


def test_a_later_turn_replaces_the_earlier_one_it_extends() -> None:
    cache = PrefixCache()
    turn1 = list(range(30))
    cache.store(turn1, _row(turn1))
    turn2 = turn1 + list(range(100, 120))
    cache.store(turn2, _row(turn2))
    assert len(cache) == 1
    assert cache.lookup(turn1 + [7])[0] == 30  # the longer entry serves the shorter start too


# -- the default model --------------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?",
    "Tell me a joke about cats.",
    "Tell me a joke about dogs.",
    "Name three colours of the rainbow.",
]


def _run(llm, prompt: str, **options):
    events = list(llm.stream(prompt, max_new_tokens=24, logprobs=True, **options))
    return events[-1], [(e["token_id"], e["logprob"]) for ev in events for e in ev.logprobs or []]


@pytest.fixture(scope="module")
def uncached() -> ms.TextModel:
    """The default model with its prefix cache kept empty: every prompt prefilled whole."""
    llm = ms.load_text_model()
    llm.prefix_cache.max_bytes = 0
    yield llm
    llm.close()


@pytest.mark.model
@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 3}, {"speculate": 0}],
                         ids=["greedy", "seeded", "speculate=0"])
def test_the_default_model_streams_the_same_tokens_and_logprobs_from_a_cached_prefix(llm, uncached, options) -> None:
    assert llm.prefix_cache is not None, "on by default on the embedded model (native layers)"
    llm.generate("Hi", max_new_tokens=1)  # a first prompt: the chat template's start is cached
    for question in QUESTIONS:
        hits = llm.prefix_cache.hits
        final, entries = _run(llm, question, **options)
        base, base_entries = _run(uncached, question, **options)
        assert final.text == base.text and entries == base_entries, question
        # Every chat prompt starts with the template's system prompt: a hit.
        assert llm.prefix_cache.hits > hits
        assert final.metrics["cached_prompt_tokens"] >= 20
        assert "cached_prompt_tokens" not in base.metrics


@pytest.mark.model
def test_concurrent_prompts_that_share_a_start_each_stream_their_own_answer(llm, uncached) -> None:
    """Requests arriving together, several starting from cached rows while others decode."""
    expected = {q: _run(uncached, q, temperature=0.0) for q in QUESTIONS}
    got: dict[str, tuple] = {}

    def ask(question: str) -> None:
        got[question] = _run(llm, question, temperature=0.0)

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for q in QUESTIONS:
        assert got[q][0].text == expected[q][0].text and got[q][1] == expected[q][1], q


@pytest.mark.model
def test_a_follow_up_turn_starts_from_the_first_turns_rows(llm) -> None:
    turn1 = [{"role": "user", "content": "Give me a name for a cat."}]
    first = llm.generate(turn1, max_new_tokens=12, temperature=0.0)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And for a dog?"}]
    second = llm.generate(turn2, max_new_tokens=12, temperature=0.0)
    assert second.metrics["cached_prompt_tokens"] >= len(llm.encode_prompt(turn1)) - 2


def test_a_salted_prompt_is_found_only_by_the_same_salt() -> None:
    cache = PrefixCache()
    prompt = list(range(20))
    cache.store(prompt, _row(prompt), salt="alice")
    assert cache.lookup(prompt + [1]) is None  # unsalted: alice's prompts are not shared
    assert cache.lookup(prompt + [1], salt="bob") is None
    assert cache.lookup(prompt + [1], salt="alice")[0] == 20
    cache.store(prompt, _row(prompt))  # the same tokens unsalted: a separate entry
    longer = prompt + list(range(50, 60))
    cache.store(longer, _row(longer), salt="bob")  # extends alice's and the unsalted one: replaces neither
    assert len(cache) == 3
    assert cache.lookup(longer + [1])[0] == 20 and cache.lookup(longer + [1], salt="bob")[0] == 30


@pytest.mark.model
def test_cache_salt_keeps_requests_apart_and_the_text_the_same(llm) -> None:
    """A salted request starts from no other salt's prompts (nor the unsalted ones: the chat
    template's start, cached since the suite's first prompt), and from its own salt's; the answer
    is the same either way."""
    question = "Name a river in Europe."
    llm.generate("Hi", max_new_tokens=1)  # the template's start, cached unsalted (if no test did so before)
    plain = llm.generate(question, max_new_tokens=12, temperature=0.0)
    assert plain.metrics.get("cached_prompt_tokens", 0) >= 8  # the template's start, unsalted
    salt = f"tenant-{threading.get_ident()}-{id(plain)}"  # a salt no earlier request used
    first = llm.generate(question, max_new_tokens=12, temperature=0.0, cache_salt=salt)
    again = llm.generate(question, max_new_tokens=12, temperature=0.0, cache_salt=salt)
    other = llm.generate(question, max_new_tokens=12, temperature=0.0, cache_salt=salt + "-other")
    assert "cached_prompt_tokens" not in first.metrics and "cached_prompt_tokens" not in other.metrics
    assert again.metrics["cached_prompt_tokens"] == again.usage["prompt_tokens"] - 1
    assert plain.text == first.text == again.text == other.text
    with pytest.raises(ms.InvalidArgumentError, match="cache_salt must be a non-empty string"):
        llm.stream(question, cache_salt="")


@pytest.mark.model
def test_the_next_turn_of_a_long_conversation_starts_from_the_cache(llm) -> None:
    """A conversation of 1,700 tokens (more than the first default of 64 MiB held) is kept whole, so
    its next turn prefills only the new messages: the case where a cache saves the most."""
    passage = "The river runs past the mill and the market square, where traders sell bread and wool. " * 2
    conversation = []
    for i in range(18):
        conversation += [{"role": "user", "content": f"Part {i} of the story, please. {passage}"},
                         {"role": "assistant", "content": passage}]
    conversation.append({"role": "user", "content": "What happened next?"})
    first = llm.generate(conversation, max_new_tokens=2, temperature=0.0)
    assert first.usage["prompt_tokens"] * 46_080 > 64 << 20  # bigger than the first default store
    follow_up = conversation + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    second = llm.generate(follow_up, max_new_tokens=2, temperature=0.0)
    assert second.metrics["cached_prompt_tokens"] >= first.usage["prompt_tokens"] - 2
