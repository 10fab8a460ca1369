"""Steer, rewind and revise on the real embedded model: exact against transformers' generate."""

from __future__ import annotations

import asyncio

import pytest
import torch

import multistream as ms

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def default_model(text_model):
    """These tests compare with transformers prefilling the whole sequence, on the default model:
    its decode and prefill compute the same numbers (one arithmetic), so they agree exactly."""
    return text_model


def _apply(events) -> str:
    text = ""
    for ev in events:
        text = text[: ev.offset] + ev.delta
    return text


def _greedy(llm, ids: list[int], n: int) -> list[int]:
    out = llm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    tokens = out[0, len(ids):].tolist()
    eos = llm.eos_token_ids
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def _run_with_edit(stream, at_event: int, edit):
    events = []
    for ev in stream:
        events.append(ev)
        if len(events) == at_event:
            edit(stream)
    return events


@pytest.mark.parametrize(("prompt", "at"), [("Write a story about a dragon.", 3), ("Explain how rain forms.", 8)])
def test_steer_continues_exactly_as_generate_on_the_same_tokens(default_model, prompt, at) -> None:
    text_model = default_model
    stream = text_model.stream(prompt, max_new_tokens=30)
    events = _run_with_edit(stream, at, lambda s: s.steer("Answer in one short sentence."))
    final = events[-1]
    (rev,) = final.revisions
    assert rev["kind"] == "steer" and rev["instruction"] == "Answer in one short sentence."
    answer_ids = [t for ev in events for t in ev.token_ids]
    written, after = answer_ids[: rev["step"]], answer_ids[rev["step"]:]
    sequence = text_model.encode_prompt(prompt) + written + rev["token_ids"]
    assert after == _greedy(text_model, sequence, len(after))[: len(after)]
    assert _apply(events) == final.text
    assert all(ev.revision == 1 for ev in events if ev.index >= rev["step"] and ev.delta)


def test_rewind_keeps_the_text_before_the_offset_and_regenerates_like_a_fresh_greedy_run(default_model) -> None:
    text_model = default_model
    prompt = "List five fruits, one per line."
    stream = text_model.stream(prompt, max_new_tokens=30)
    events = _run_with_edit(stream, 10, lambda s: s.rewind(6, instruction="Only red fruits."))
    final = events[-1]
    (rev,) = final.revisions
    kept = final.text[: rev["offset"]]
    before = "".join(ev.delta for ev in events[:10])
    assert before.startswith(kept) and rev["offset"] <= 6
    assert _apply(events) == final.text
    # The part after the cut is what greedy decoding gives on prompt + kept tokens + instruction.
    kept_ids = text_model.tokenizer(kept, add_special_tokens=False)["input_ids"] if kept else []
    sequence = text_model.encode_prompt(prompt) + kept_ids + rev["token_ids"]
    regenerated = text_model.tokenizer(final.text[rev["offset"]:], add_special_tokens=False)["input_ids"]
    expected = _greedy(text_model, sequence, 40)
    assert text_model.tokenizer.decode(expected, skip_special_tokens=True).startswith(
        text_model.tokenizer.decode(regenerated, skip_special_tokens=True)
    )


def test_rewind_without_changes_regenerates_the_same_text(text_model) -> None:
    plain = text_model.generate("Name three colours.", max_new_tokens=20).text
    stream = text_model.stream("Name three colours.", max_new_tokens=20)
    events = _run_with_edit(stream, 6, lambda s: s.rewind(3))
    assert events[-1].text == plain
    assert _apply(events) == plain
    assert [ev.revision for ev in events][-1] == 1


async def test_offsets_rebuild_the_text_in_an_async_loop_too(text_model) -> None:
    stream = text_model.stream("Write a haiku about snow.", max_new_tokens=24)
    events = []
    async for ev in stream:
        events.append(ev)
        if len(events) == 4:
            # (an instruction the int4 model answers at length: "Write it about rain instead." gets an
            # empty answer from it, which leaves no event to steer at)
            stream.rewind(0, instruction="Make it about rain.")
        if len(events) == 9:
            stream.steer("End with an exclamation mark.")
    assert _apply(events) == events[-1].text
    assert [r["kind"] for r in events[-1].revisions] == ["rewind", "steer"]
    await asyncio.sleep(0)


def test_revise_keeps_the_start_of_a_finished_answer(text_model) -> None:
    final = text_model.generate("Write two sentences about the moon.", max_new_tokens=30)
    offset = len(final.text) // 2
    events = list(text_model.revise(final, offset, instruction="Finish with a question."))
    new = events[-1]
    kept = events[0].delta
    assert final.text.startswith(kept) and len(kept) <= offset
    assert new.text.startswith(kept)
    assert _apply(events) == new.text
    assert new.revisions[0]["kind"] == "rewind"


def test_bad_edits_are_clear_errors_and_leave_the_stream_alone(text_model) -> None:
    stream = text_model.stream("Count from one to twenty.", max_new_tokens=24)
    events = []
    for ev in stream:
        events.append(ev)
        if len(events) == 3:
            with pytest.raises(ms.InvalidArgumentError, match="instruction is empty"):
                stream.steer("   ")
            with pytest.raises(ms.InvalidArgumentError, match="outside the text"):
                stream.rewind(10_000)
            with pytest.raises(ms.InvalidArgumentError, match="outside the text"):
                stream.rewind(-1)
            with pytest.raises(ms.InvalidArgumentError, match="sampling options"):
                stream.rewind(0, banana=1)
            with pytest.raises(ms.PromptTooLongError, match="does not fit"):
                stream.steer("word " * 9000)
    final = events[-1]
    assert final.revisions is None and final.text == text_model.generate("Count from one to twenty.", max_new_tokens=24).text
    with pytest.raises(ms.StreamFinishedError, match="already ended"):
        stream.steer("more")
    with pytest.raises(ms.InvalidArgumentError, match="final event of a text stream"):
        text_model.revise(events[0], 0)


def test_resume_after_a_steer_with_the_instruction_tokens(default_model) -> None:
    """``on_edit`` reports each steer as it takes effect (``at``: answer tokens before its
    instruction); ``resume_tokens`` + ``resume_inserted`` rebuild that context (what a Ray replica
    taking a stream over does): the continuation equals the uninterrupted steered one (the resumed
    run prefills what the first one decoded step by step: one arithmetic makes them agree)."""
    llm = default_model
    prompt = "Write one sentence about the sea."
    edits: list[dict] = []
    events = _run_with_edit(llm.stream(prompt, max_new_tokens=40, temperature=0.0, on_edit=edits.append), 3,
                            lambda s: s.steer("Describe the waves in detail."))
    final = events[-1]
    [edit] = edits
    assert edit["kind"] == "steer" and edit["revision"] == 1 and edit["token_ids"] == final.revisions[0]["token_ids"]
    ids: list[int] = []
    for ev in events:
        ids = ids[: ev.index] + list(ev.token_ids)
    k = edit["at"] + 2  # the failover came two tokens after the steer
    resumed = llm.generate(prompt, max_new_tokens=40, temperature=0.0, resume_tokens=ids[:k],
                           resume_inserted=[(edit["at"], edit["token_ids"])])
    assert resumed.text == final.text
    without = llm.generate(prompt, max_new_tokens=40, temperature=0.0, resume_tokens=ids[:k])
    assert without.text != final.text  # the instruction is what kept the answer on its course
    for bad in ([(k + 1, [1])], [(0, "x")], [(-1, [1])], "x", [(0,)]):
        with pytest.raises(ms.InvalidArgumentError, match="resume_inserted must be a list of"):
            llm.stream(prompt, resume_tokens=ids[:k], resume_inserted=bad)
    with pytest.raises(ms.InvalidArgumentError, match="goes with resume_tokens"):
        llm.stream(prompt, resume_inserted=[(0, [1])])
    with pytest.raises(ms.InvalidArgumentError, match="on_edit must be callable"):
        llm.stream(prompt, on_edit=3)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_resume_with_every_token_already_sent_adds_none(default_model, sampling) -> None:
    """A replica can die after the answer's last token and before its final event (the replica
    runs ahead of the client). The replica that takes over gets every token as ``resume_tokens``:
    it ends the stream at ``max_new_tokens`` with no token more (it used to decode one: the Ray
    failover test's text ended "... expanse of blue" instead of "... expanse of")."""
    llm = default_model
    prompt = "Write one sentence about the sea."
    events = list(llm.replica_stream(prompt, max_new_tokens=14, **sampling))
    ids = [t for ev in events for t in ev.token_ids]
    assert len(ids) == 14 and events[-1].finish_reason == "length"
    for sent in (13, 14):
        resumed = list(llm.replica_stream(prompt, max_new_tokens=14, resume_tokens=ids[:sent], **sampling))
        assert [t for ev in resumed for t in ev.token_ids] == ids[sent:]
        final = resumed[-1]
        assert final.is_final and final.finish_reason == "length" and final.text == events[-1].text
        assert final.usage["completion_tokens"] == 14
