"""The parts of a text request (issue 32's split), each on its own: the frozen `RequestSpec`, the
`RowState` the batcher writes, the `EditQueue`, and the `TextOutput` that turns tokens into events
(driven here without a model or a batcher: tokens in, the wire events out)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest

from multistream.stream import Stream, StreamWriter
from multistream.text._edits import Edit, EditQueue
from multistream.text._options import parse_text_options
from multistream.text._output import TextOutput
from multistream.text._request_spec import RequestSpec
from multistream.text._row_state import RowState
from multistream.text._sampling import SamplingPlan


def test_the_spec_is_frozen() -> None:
    options = parse_text_options(max_new_tokens=8)
    spec = RequestSpec(prompt_ids=(1, 2), options=options, plan=SamplingPlan.resolve(options, None),
                       max_new_tokens=8, eos_token_ids=frozenset({0}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_new_tokens = 9  # type: ignore[misc]
    assert not spec.resumes and spec.priority == 0 and spec.first_edit is None


def test_the_row_keeps_answer_positions_through_an_instruction_and_a_cut() -> None:
    row = RowState(context=[10, 11])
    row.append(20)
    row.context.extend([90, 91])  # a steering instruction's tokens, between answer tokens 0 and 1
    row.append(21)
    row.append(22)
    assert row.answer_ids == [20, 21, 22] and row.answer_pos == [2, 5, 6] and row.output_position == 3
    assert row.cut(1) == 5  # answer token 1 sat at 5: the instruction before it stays
    assert row.context == [10, 11, 20, 90, 91] and row.answer_ids == [20] and row.answer_pos == [2]
    assert row.cut(1) == 5 and row.context == [10, 11, 20, 90, 91]  # nothing after: nothing cut
    row.prefilled, row.own_cache, row.share = 3, object(), object()
    row.release()
    assert row.own_cache is None and row.share is None and row.prefilled == 3


def test_edits_come_out_in_order_once_from_any_thread() -> None:
    queue = EditQueue()
    threads = [threading.Thread(target=lambda i=i: queue.put(Edit("steer", [i]))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert queue
    taken = queue.take()
    assert sorted(e.inserted[0] for e in taken) == list(range(8))
    assert not queue and queue.take() == []


def _run_output(tokenizer: Any, ids: list[int], stop_at: int | None = None, **options: Any) -> list[Any]:
    """Feed ``ids`` to a `TextOutput` as a request would (ending at a stop string, or at the end
    with ``length``) and return the stream's events."""
    checked = parse_text_options(**options)

    def produce(writer: StreamWriter) -> None:
        out = TextOutput(writer, tokenizer, checked)
        for token in ids:
            out.tick()
            if out.feed(token, None):
                out.finish("stop_sequence", usage={"prompt_tokens": 0, "completion_tokens": len(ids)}, metrics={})
                return
            out.send_if_ready()
        out.finish("length", usage={"prompt_tokens": 0, "completion_tokens": len(ids)}, metrics={"decode_steps": 7.0})

    return list(Stream(produce, kind="text"))


@pytest.mark.model
def test_the_output_side_alone_stops_and_ends(text_tokenizer: Any) -> None:
    ids = text_tokenizer("Hello there, world. STOP and more", add_special_tokens=False)["input_ids"]
    events = _run_output(text_tokenizer, ids, chunk_tokens=2, stop=["STOP"])
    # (A consumer slower than this producer gets deltas merged, so event sizes are not checked here.)
    final = events[-1]
    assert final.is_final and final.finish_reason == "stop_sequence"
    assert "".join(ev.delta for ev in events) == final.text == "Hello there, world. "  # the stop never leaks
    assert set(final.metrics) >= {"ttft_ms", "itl_ms_p50", "itl_ms_p95", "duration_ms", "tokens_per_s"}
    whole = _run_output(text_tokenizer, ids)
    assert whole[-1].finish_reason == "length" and whole[-1].text == text_tokenizer.decode(ids)
    assert whole[-1].metrics["decode_steps"] == 7.0  # the request's own metrics follow the timing ones
    assert [t for ev in whole for t in ev.token_ids] == ids
