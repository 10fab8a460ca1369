"""Exact lookahead (``speculate``, on by default): several tokens per step, the text of one per step.

On the default model (``ms.load_text_model()``), every stream is compared with the same stream at
``speculate=0``: text, token ids, logprobs and top alternatives, finish reason and usage, bit for
bit, alone and in a batch whose members join and leave; the drafts must also be accepted where the
answer copies its prompt (fewer decode steps than tokens). The machinery (the ragged KV rows, the
drafting policy) is tested on its own with small tensors.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from multistream.errors import InvalidArgumentError
from multistream.text._kv_rows import RowCache
from multistream.text._lookahead import Lookahead

from lookahead_prompts import COPY, OPEN, QUOTE

SAMPLED = {"temperature": 0.8, "seed": 11}


def _run(llm, prompt, **options):
    events = list(llm.stream(prompt, logprobs=True, top_logprobs=2, **options))
    return events


def _ids(events):
    return [i for ev in events for i in ev.token_ids or []]


def _logprobs(events):
    return [e for ev in events for e in ev.logprobs or []]


def _same(a, b) -> None:
    """Two runs of one stream gave the same answer, bit for bit."""
    fa, fb = a[-1], b[-1]
    assert fb.text == fa.text
    assert _ids(b) == _ids(a)
    assert _logprobs(b) == _logprobs(a)  # logprob floats and top alternatives, compared exactly
    assert fb.finish_reason == fa.finish_reason
    assert fb.usage == fa.usage


# -- the default model ----------------------------------------------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_lookahead_gives_the_text_of_one_token_per_step_and_fewer_steps(llm, sampling) -> None:
    off = _run(llm, COPY, max_new_tokens=48, speculate=0, **sampling)
    on = _run(llm, COPY, max_new_tokens=48, **sampling)  # speculate="auto" is the default
    _same(off, on)
    tokens = on[-1].usage["completion_tokens"]
    m_on, m_off = on[-1].metrics, off[-1].metrics
    # speculate=0: one step per token after the first (which the prefill gives), no drafts.
    assert "drafted_tokens" not in m_off and m_off["decode_steps"] == len(_ids(off)) - 1 + (on[-1].finish_reason == "stop")
    assert m_on["accepted_tokens"] > 0 and m_on["drafted_tokens"] >= m_on["accepted_tokens"]
    assert m_on["decode_steps"] < tokens - 1
    # Several tokens of one step arrive as one event (chunk_tokens is 1 by default).
    assert any(len(ev.token_ids or []) > 1 for ev in on)


@pytest.mark.model
def test_a_forward_patched_then_put_back_leaves_lookahead_on(llm) -> None:
    """``monkeypatch`` and ``mock.patch.object`` undo a patch of ``model.forward`` by setting the
    original bound method on the instance; the fast step (and so lookahead) must come back, where it
    used to stay off for the rest of the process."""
    spied: list[int] = []
    forward = llm.model.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm.model, "forward", lambda *a, **k: spied.append(1) or forward(*a, **k))
        patched = _run(llm, COPY, max_new_tokens=16)
    assert spied and not patched[-1].metrics.get("drafted_tokens")  # the user's forward ran every step
    assert "forward" in vars(llm.model)  # what the undo left: the original method, on the instance
    again = _run(llm, COPY, max_new_tokens=16)
    assert again[-1].metrics["accepted_tokens"] > 0
    _same(patched, again)


@pytest.mark.model
def test_an_integer_caps_the_drafts_and_still_gives_the_same_text(llm) -> None:
    off = _run(llm, COPY, max_new_tokens=32, speculate=0)
    one = _run(llm, COPY, max_new_tokens=32, speculate=1)
    _same(off, one)
    assert max(len(ev.token_ids or []) for ev in one) <= 2  # one draft and the token after it
    assert one[-1].metrics["accepted_tokens"] > 0


@pytest.mark.model
def test_a_batch_with_lookahead_gives_each_stream_its_text_as_streams_join_and_leave(llm) -> None:
    jobs = [
        (COPY, {"max_new_tokens": 40}), (OPEN, {"max_new_tokens": 12, **SAMPLED}),
        (QUOTE, {"max_new_tokens": 30, **SAMPLED}), (OPEN, {"max_new_tokens": 20}),
        (QUOTE, {"max_new_tokens": 36}), (COPY, {"max_new_tokens": 24, "temperature": 0.7, "seed": 5}),
        (OPEN, {"max_new_tokens": 16, "temperature": 1.0, "seed": 2}), (COPY, {"max_new_tokens": 30}),
    ]

    def batch(**extra):
        out: list[list | None] = [None] * len(jobs)
        early_done = threading.Event()  # the later half joins once the first stream is under way

        def work(i: int) -> None:
            prompt, options = jobs[i]
            if i >= 4:
                early_done.wait(timeout=600)
            events = []
            for ev in llm.stream(prompt, logprobs=True, top_logprobs=2, **options, **extra):
                events.append(ev)
                if i == 0 and len(events) == 3:
                    early_done.set()
            early_done.set()
            out[i] = events

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert all(r is not None for r in out)
        return out

    off = batch(speculate=0)
    for extra in ({}, {"speculate": 4}):  # "auto" weighs drafts against the batch; 4 drafts regardless
        on = batch(**extra)
        for a, b in zip(off, on):
            _same(a, b)
    # Drafts were verified inside batched steps (speculate=4 drafts whatever the batch's size).
    assert sum(r[-1].metrics["accepted_tokens"] for r in on) > 0


@pytest.mark.model
def test_a_stop_string_inside_an_accepted_block_ends_the_text_there(llm) -> None:
    free = _run(llm, COPY, max_new_tokens=48)
    text = free[-1].text
    # A stop string that begins inside an event of several tokens (one step's accepted block).
    stop, at = None, 0
    for ev in free[:-1]:
        delta = ev.delta
        if len(ev.token_ids or []) >= 3 and len(delta.strip()) >= 6:
            candidate = delta[len(delta) // 2:].strip()[:6]
            if candidate and text.find(candidate) > at:
                stop = candidate
                break
        at += len(delta)
    assert stop is not None, "no event with a block of accepted tokens"
    off = _run(llm, COPY, max_new_tokens=48, speculate=0, stop=stop)
    on = _run(llm, COPY, max_new_tokens=48, stop=stop)
    _same(off, on)
    assert on[-1].finish_reason == "stop_sequence"
    assert stop not in on[-1].text and stop not in "".join(ev.delta for ev in on)


@pytest.mark.model
def test_eos_inside_an_accepted_block_ends_the_stream(llm) -> None:
    line = [{"role": "user", "content": "Copy this line exactly: alpha beta gamma delta epsilon zeta eta theta."}]
    off = _run(llm, line, max_new_tokens=64, speculate=0)
    on = _run(llm, line, max_new_tokens=64)
    _same(off, on)
    assert on[-1].finish_reason == "stop"  # the model's EOS, drafted from the prompt's end of turn
    # One token per step, EOS arrives alone; here it came in the same step as the token before it
    # (a block of several tokens): the final event carries that token, and nothing after EOS leaked.
    assert not off[-1].token_ids and len(on[-1].token_ids or []) >= 1
    assert on[-1].metrics["decode_steps"] < on[-1].usage["completion_tokens"] - 1


@pytest.mark.model
@pytest.mark.parametrize("limit", [5, 13])
def test_max_new_tokens_is_exact_with_lookahead(llm, limit: int) -> None:
    off = _run(llm, QUOTE, max_new_tokens=limit, speculate=0)
    on = _run(llm, QUOTE, max_new_tokens=limit)
    _same(off, on)
    assert on[-1].finish_reason == "length"
    assert len(_ids(on)) == limit == on[-1].usage["completion_tokens"]


@pytest.mark.model
def test_json_schema_with_lookahead_is_valid_and_equal(llm) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "city", "age"], "additionalProperties": False}
    prompt = [{"role": "user", "content": "Extract name, city and age as JSON from: Margaret Hamilton, aged 34, "
               "lives in Cambridge and writes flight software."}]
    off = _run(llm, prompt, max_new_tokens=60, speculate=0, json_schema=schema)
    on = _run(llm, prompt, max_new_tokens=60, json_schema=schema)
    _same(off, on)
    value = json.loads(on[-1].text)
    assert set(value) == {"name", "city", "age"}
    # The keys, quotes and colons the schema forces ('name":', ' "city":', ' "age":': 8 tokens) are
    # drafts kept without a guess: the answer took far fewer steps than tokens.
    metrics, tokens = on[-1].metrics, on[-1].usage["completion_tokens"]
    assert metrics["accepted_tokens"] >= 8, metrics
    assert metrics["decode_steps"] <= 0.75 * tokens, (metrics, tokens)


def test_the_grammar_forces_a_schemas_keys_and_admits_only_drafts_it_allows(text_tokenizer) -> None:
    from multistream.text._constraints import constraint_for, grammar_of

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    constraint = constraint_for(grammar_of(None, json.dumps(schema)), text_tokenizer,
                                frozenset({text_tokenizer.eos_token_id}))
    constraint.consume(text_tokenizer.encode("{", add_special_tokens=False)[0])
    forced = constraint.forced(16)
    assert text_tokenizer.decode(forced).startswith('"name"')
    assert constraint.forced(1) == forced[:1] and constraint.forced(0) == []
    draft = text_tokenizer.encode('"name": "Ada', add_special_tokens=False)
    assert constraint.admitted(draft) == draft  # nothing consumed: asking twice is the same
    assert constraint.admitted(draft) == draft
    wrong = text_tokenizer.encode('"city": "Oslo', add_special_tokens=False)
    assert len(constraint.admitted(wrong)) < len(wrong)


@pytest.mark.model
def test_rewind_and_steer_with_lookahead_equal_one_token_per_step(llm) -> None:
    """A rewind (``revise`` at an offset) and a steer (with an instruction) re-prefill the kept
    tokens and go on with lookahead: the same text as one token per step."""
    first = llm.generate(COPY, max_new_tokens=40, temperature=0.0)
    cut = len(first.text) // 2
    for instruction in (None, "Use four spaces."):
        off = list(llm.revise(first, cut, instruction, speculate=0, logprobs=True))
        on = list(llm.revise(first, cut, instruction, logprobs=True))
        _same(off, on)


# -- the surface ----------------------------------------------------------------------------------

def test_speculate_is_checked_with_a_clear_message() -> None:
    from multistream.text._options import parse_text_options

    assert parse_text_options().speculate == "auto"
    assert parse_text_options(speculate=4).speculate == 4
    for bad in ("fast", -1, 1.5, 999, True):
        with pytest.raises(InvalidArgumentError, match="speculate must be"):
            parse_text_options(speculate=bad)
    with pytest.raises(InvalidArgumentError, match="num_beams=2 does not combine with speculate=3"):
        parse_text_options(num_beams=2, speculate=3)
    assert parse_text_options(num_beams=2).speculate == "auto"  # beams simply decode one token per step


def test_the_openai_body_has_speculate_as_an_extension() -> None:
    from multistream.server.openai.chat.protocol import ChatCompletionRequest

    field = ChatCompletionRequest.model_fields["speculate"]
    assert field.description.startswith("extension:")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], speculate=0)
    assert body.speculate == 0


# -- the machinery --------------------------------------------------------------------------------

def _cache(rows: int, columns: int) -> RowCache:
    keys = torch.arange(rows * columns, dtype=torch.float32).view(rows, 1, columns, 1)
    return RowCache.from_layers([(keys.clone(), -keys.clone())], torch.ones(rows, columns, dtype=torch.long))


def test_ragged_rows_keep_their_own_columns_and_are_aligned_for_transformers() -> None:
    cache = _cache(2, 6)
    cache.keep([(0, 4), (0, 6)])  # row 0 kept 4 columns of what a step wrote, row 1 all 6
    assert cache.mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert cache.spans() == [(0, 4), (0, 6)]
    one = cache.select([0])  # trailing columns no row holds are trimmed, like leading padding
    assert one.length == 4 and one.kv()[0][0].flatten().tolist() == [0, 1, 2, 3]
    aligned = cache.aligned()
    assert aligned.mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert aligned.kv()[0][0][0].flatten().tolist()[2:] == [0, 1, 2, 3]
    assert aligned.kv()[0][1][1].flatten().tolist() == [-6, -7, -8, -9, -10, -11]
    cache.keep([(0, 3), (0, 2)])  # narrowed to the longest row
    assert cache.length == 3 and cache.spans() == [(0, 3), (0, 2)]
    keys = cache.kv()[0][0]
    cache.keep([(0, 3), (0, 3)])  # as wide as the layers already are: the same views, not new ones
    assert cache.kv()[0][0] is keys and cache.spans() == [(0, 3), (0, 3)]
    assert RowCache(None, torch.tensor([[1, 0, 1]])).spans() is None  # a hole is not a span


def test_a_draft_that_starts_another_pass_of_the_kernels_must_pay_for_it() -> None:
    """The kernels read each weight block once for a group of positions (8 with AVX-512): in a full
    batch of 8 a single likely draft would cost a whole pass for a fraction of a row's step."""
    context = list(range(1, 13)) * 3 + list(range(1, 4))  # a long copy, continued after [1, 2, 3]
    look = Lookahead(cap=10)
    for _ in range(6):  # drafts kept every time: a high acceptance rate
        drafted = look.drafts(context, rows=1, room=10)
        look.verified(drafted=len(drafted), kept=len(drafted))
    alone = look.drafts(context, rows=1, room=10, positions=1, group=8)
    assert alone == look.drafts(context, rows=1, room=10) and len(alone) >= 7  # within one pass: as before
    some_room = look.drafts(context, rows=5, room=10, positions=5, group=8)
    assert 1 <= len(some_room)  # three free positions in the pass: drafts fit
    full = look.drafts(context, rows=8, room=10, positions=8, group=8)
    assert look.drafts(context, rows=8, room=10) != [] and full == []  # one more position would start a pass
    explicit = Lookahead(cap=3, batch_aware=False)  # speculate=3 asked for drafts whatever the batch
    assert explicit.drafts(context, rows=8, room=10, positions=8, group=8) == [4]


def test_drafts_follow_the_latest_match_and_stop_when_they_keep_failing() -> None:
    look = Lookahead(cap=8)
    context = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert look.drafts(context, rows=1, room=10) == [4]  # a 3-gram match: one draft at first
    for _ in range(4):
        drafted = look.drafts(context, rows=1, room=10)
        look.verified(drafted=len(drafted), kept=len(drafted))
    assert len(look.drafts(context, rows=1, room=10)) > 2  # accepted drafts: longer ones
    assert look.drafts(context, rows=1, room=1) == [4]  # never past max_new_tokens
    busy = len(look.drafts(context, rows=16, room=10))
    assert busy < len(look.drafts(context, rows=1, room=10))  # a full batch drafts less
    capped = Lookahead(cap=3, batch_aware=False)  # speculate=3: drafts in any batch
    assert capped.drafts(context, rows=16, room=10) == capped.drafts(context, rows=1, room=10) == [4]
    rejections = 0
    while (drafted := look.drafts(context, rows=1, room=10)) and rejections < 20:
        look.verified(drafted=len(drafted), kept=0)
        rejections += 1
    assert drafted == [] and rejections <= 15  # rejected again and again: no more drafts
    assert look.drafts([7, 8, 9], rows=1, room=10) == []  # no match, no drafts
    assert Lookahead(cap=0).drafts(context, rows=1, room=10) == []


@pytest.mark.model
def test_the_server_takes_speculate_and_counts_drafted_and_accepted_tokens(llm) -> None:
    import re

    import httpx
    import openai

    from server_fixtures import make_server

    with make_server(llm) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        answers = [client.chat.completions.create(model="default", messages=COPY, max_tokens=32, temperature=0,
                                                  extra_body=extra)
                   for extra in ({}, {"speculate": 0})]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="speculate must be"):
            client.chat.completions.create(model="default", messages=COPY, max_tokens=4, extra_body={"speculate": "fast"})
        metrics = httpx.get(srv.url + "/metrics").text
    drafted = re.search(r'multistream:spec_decode_num_draft_tokens_total\{kind="text"\} ([0-9.]+)', metrics)
    accepted = re.search(r'multistream:spec_decode_num_accepted_tokens_total\{kind="text"\} ([0-9.]+)', metrics)
    assert drafted and accepted and float(drafted.group(1)) >= float(accepted.group(1)) > 0
