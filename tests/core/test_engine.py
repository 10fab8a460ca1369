"""The engine: one thread per model, continuous batching of text, step-level image scheduling.

Most tests use a tiny random-weight Llama (real transformers code, real tokenizer, milliseconds
per step); the parity tests run the real embedded SmolLM2 (marked ``model``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import TYPE_CHECKING

import pytest
import torch

import multistream as ms
from multistream.errors import EngineClosedError

from repo_paths import ROOT

if TYPE_CHECKING:
    import numpy as np


@pytest.fixture(scope="module")
def tiny_llm(text_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(text_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=text_tokenizer.eos_token_id, bos_token_id=text_tokenizer.bos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    llm = ms.TextModel(model, text_tokenizer, name="tiny", max_batch=4)
    yield llm
    llm.close()


PROMPTS = [
    "Hi",
    "Tell me about cats and why they purr so much.",
    "Write a short poem about the sea at night, with rhymes.",
    "What is two plus two?",
]


def _collect(stream) -> tuple[list, object]:
    events = list(stream)
    return events, events[-1]


def _wait_for_events(stream_events: list, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(stream_events) < n and time.monotonic() < deadline:
        time.sleep(0.005)


def _consume_in_thread(stream) -> tuple[threading.Thread, list]:
    events: list = []

    def run() -> None:
        for ev in stream:
            events.append(ev)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, events


def _staggered(llm, prompts, **kwargs) -> list:
    """Start each stream once the previous one has produced a few events: joins at different steps."""
    running = []
    for i, prompt in enumerate(prompts):
        thread, events = _consume_in_thread(llm.stream(prompt, **kwargs))
        running.append((thread, events))
        _wait_for_events(events, 2 + i)
    finals = []
    for thread, events in running:
        thread.join(120)
        finals.append(events[-1])
    return finals


# -- parity: a stream in a batch gives what it gives alone ------------------------------------------


@pytest.mark.model
def test_greedy_in_a_batch_equals_greedy_alone(text_model) -> None:
    alone = [text_model.generate(p, max_new_tokens=24) for p in PROMPTS]
    together = _staggered(text_model, PROMPTS, max_new_tokens=24)
    for a, b in zip(alone, together):
        assert b.text == a.text
        assert b.usage == a.usage
    # ...and alone equals transformers' own greedy generate on the same tokens (bit for bit unless
    # the decode step is compiled: fused kernels round in their own order; tests/text/test_quantize.py).
    if text_model.compiled is not None and text_model.compiled.compiled:
        return
    ids = text_model.encode_prompt(PROMPTS[2])
    out = text_model.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert together[2].text == text_model.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.mark.model
def test_seeded_sampling_does_not_depend_on_batch_mates(text_model) -> None:
    kw = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    alone = text_model.generate(PROMPTS[1], **kw).text
    mates = [text_model.stream(p, max_new_tokens=16, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS)]
    with_mates = text_model.stream(PROMPTS[1], **kw)
    assert with_mates.wait().text == alone
    for s in mates:
        s.wait()


def test_seeded_sampling_is_the_same_in_any_batch_tiny(tiny_llm) -> None:
    kw = dict(max_new_tokens=12, temperature=1.0, seed=5)
    alone = tiny_llm.generate(PROMPTS[3], **kw)
    finals = _staggered(tiny_llm, [PROMPTS[0], PROMPTS[3], PROMPTS[2]], max_new_tokens=12, temperature=1.0, seed=5)
    assert finals[1].text == alone.text


def test_greedy_batch_parity_on_the_tiny_model(tiny_llm) -> None:
    alone = [tiny_llm.generate(p, max_new_tokens=16) for p in PROMPTS]
    together = _staggered(tiny_llm, PROMPTS, max_new_tokens=16)
    assert [f.text for f in together] == [f.text for f in alone]


# -- faults, cancel, close -----------------------------------------------------------------------


def test_cancel_in_a_batch_leaves_the_others_intact(tiny_llm) -> None:
    alone = [tiny_llm.generate(p, max_new_tokens=20).text for p in PROMPTS[:3]]
    streams = [tiny_llm.stream(p, max_new_tokens=20) for p in PROMPTS[:3]]
    runs = [_consume_in_thread(s) for s in streams]
    _wait_for_events(runs[1][1], 3)
    streams[1].cancel()
    for thread, _ in runs:
        thread.join(60)
    finals = [events[-1] for _, events in runs]
    assert finals[1].finish_reason == "cancelled"
    assert finals[0].text == alone[0] and finals[2].text == alone[2]


def test_a_model_fault_in_a_batched_step_fails_that_batch_and_the_engine_goes_on(tiny_llm) -> None:
    boom = {"armed": False}

    def hook(module, args, kwargs):
        if boom["armed"] and kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1:
            raise RuntimeError("simulated device fault")

    handle = tiny_llm.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        streams = [tiny_llm.stream(p, max_new_tokens=50) for p in PROMPTS[:2]]
        runs = [_consume_in_thread(s) for s in streams]
        _wait_for_events(runs[0][1], 2)
        boom["armed"] = True
        for thread, _ in runs:
            thread.join(60)
        for _, events in runs:
            assert events[-1].type == "error"
            assert "simulated device fault" in events[-1].error["message"]
        boom["armed"] = False
        assert tiny_llm.generate("Hi", max_new_tokens=4).finish_reason in ("length", "stop")
    finally:
        handle.remove()


def test_finish_early_on_text_is_a_chosen_end(tiny_llm) -> None:
    s = tiny_llm.stream(PROMPTS[1], max_new_tokens=200)
    events = []
    for ev in s:
        events.append(ev)
        if len(events) == 3:
            s.finish_early()
    final = events[-1]
    assert final.finish_reason == "finished_early"
    assert final.text == "".join(e.delta for e in events)
    assert final.usage["completion_tokens"] < 200


def test_forward_runs_only_on_the_engine_thread(tiny_llm) -> None:
    threads: set[str] = set()
    handle = tiny_llm.model.register_forward_pre_hook(lambda m, a: threads.add(threading.current_thread().name))
    try:
        finals = [s.wait() for s in [tiny_llm.stream(p, max_new_tokens=6) for p in PROMPTS]]
        assert all(f.type == "text" for f in finals)
    finally:
        handle.remove()
    assert threads == {tiny_llm.engine.thread.name}


def test_priority_runs_first_when_the_batch_is_full(text_tokenizer, tiny_llm) -> None:
    llm = ms.TextModel(tiny_llm.model, text_tokenizer, name="tiny-one-row", max_batch=1)
    try:
        low = llm.stream(PROMPTS[1], max_new_tokens=60)
        low_thread, low_events = _consume_in_thread(low)
        _wait_for_events(low_events, 3)
        waiting = llm.stream(PROMPTS[2], max_new_tokens=5, priority=0)
        high = llm.stream(PROMPTS[3], max_new_tokens=5, priority=10)
        high_final = high.wait()
        # The high-priority stream took the only row from the running one and finished first.
        assert high_final.finish_reason in ("length", "stop")
        assert not low_events[-1].is_final
        assert waiting.wait().is_final
        low_thread.join(60)
        assert low_events[-1].is_final
        # A paused stream resumes exactly where it was: same text as alone.
        assert low_events[-1].text == tiny_llm.generate(PROMPTS[1], max_new_tokens=60).text
    finally:
        llm.close()


@pytest.mark.parametrize("case", ["free row", "outranks a full batch", "full batch, same priority"])
def test_a_newcomer_is_prefilled_inside_a_running_decode_step(text_tokenizer, tiny_llm, case: str) -> None:
    """A request that arrives while a batched decode forward runs is prefilled at the next prefill
    point (between two decoder layers), so its first token does not wait for the rest of the step;
    unless it would then wait for a row (full batch, no lower priority to pause). Every output
    still equals its output alone."""
    from multistream.text._batcher import _decoder_layers

    rows = 2 if case == "free row" else 1
    llm = ms.TextModel(tiny_llm.model, text_tokenizer, name="tiny-prefill-points", max_batch=rows + (case == "free row"))
    batcher = llm._batcher
    arrived: dict = {}

    def arrive(module, args) -> None:  # runs on the engine thread, at the top of the decode forward
        if batcher._open_for is not None and batcher.batch and not arrived and batcher.steps >= 3:
            arrived["steps"] = batcher.steps
            arrived["stream"] = llm.stream(PROMPTS[3], max_new_tokens=5, temperature=0.0,
                                           priority=5 if case == "outranks a full batch" else 0)

    handle = _decoder_layers(llm.model)[0].register_forward_pre_hook(arrive)
    try:
        running = [llm.stream(p, max_new_tokens=12, temperature=0.0) for p in PROMPTS[1 : 1 + rows]]
        finals = [s.wait() for s in running]
        joined = arrived["stream"].wait()
    finally:
        handle.remove()
        llm.close()
    assert batcher.prefills_inside_steps == (0 if case == "full batch, same priority" else 1)
    assert [f.text for f in finals] == [tiny_llm.generate(p, max_new_tokens=12).text for p in PROMPTS[1 : 1 + rows]]
    assert joined.text == tiny_llm.generate(PROMPTS[3], max_new_tokens=5).text


def test_a_higher_priority_is_prefilled_inside_a_group_prefill(text_tokenizer, tiny_llm) -> None:
    """While a group of priority-0 prompts is being prefilled, a priority-10 arrival is prefilled at
    a prefill point of that forward and its first token goes out before theirs; a priority-0
    arrival waits for the next step."""
    from multistream.text._batcher import _decoder_layers

    llm = ms.TextModel(tiny_llm.model, text_tokenizer, name="tiny-prefill-points-group", max_batch=8)
    batcher = llm._batcher
    arrived: list = []

    def arrive(module, args) -> None:
        if batcher._prefilling and len(batcher._prefilling) == 3 and not arrived:
            arrived.append(llm.stream(PROMPTS[0], max_new_tokens=3, temperature=0.0, priority=0))
            arrived.append(llm.stream(PROMPTS[3], max_new_tokens=3, temperature=0.0, priority=10))

    seen: list = []

    def before_lows_logits(module, args, output) -> None:  # the end of the lows' group forward
        if batcher._prefilling and len(batcher._prefilling) == 3 and not seen:
            seen.append(({r.priority: r.generated for r in batcher.waiting if r not in batcher._prefilling},
                         [r.generated for r in batcher._prefilling]))

    layers = _decoder_layers(llm.model)
    handle = layers[0].register_forward_pre_hook(arrive)
    last = layers[-1].register_forward_hook(before_lows_logits)
    try:
        lows = llm.engine.run_on_engine(lambda: [llm.stream(p, max_new_tokens=4, temperature=0.0) for p in PROMPTS[:3]])
        low_finals = [s.wait() for s in lows]
        same, high = (s.wait() for s in arrived)
    finally:
        handle.remove()
        last.remove()
        llm.close()
    assert batcher.prefills_inside_steps == 1
    # The high one had its first token before the lows' forward even ended; the same-priority one had not.
    assert seen == [({10: 1, 0: 0}, [0, 0, 0])]
    assert all(f.finish_reason == "length" for f in low_finals)
    assert high.text == tiny_llm.generate(PROMPTS[3], max_new_tokens=3).text
    assert same.text == tiny_llm.generate(PROMPTS[0], max_new_tokens=3).text


def test_newcomers_prefilled_inside_a_step_each_get_a_row(text_tokenizer, tiny_llm) -> None:
    """A full batch of priorities 0 and 5: of two priority-3 arrivals only one can take a row at
    the next boundary (the priority-0 one's), so only one is prefilled at a prefill point; the
    other waits for a row instead of sending a first token and then stalling."""
    from multistream.text._batcher import _decoder_layers

    llm = ms.TextModel(tiny_llm.model, text_tokenizer, name="tiny-rows", max_batch=2)
    batcher = llm._batcher
    arrived: list = []
    counted: list = []

    def arrive(module, args) -> None:
        if batcher._open_for is not None and len(batcher.batch) == 2 and batcher.steps >= 3 and not arrived:
            counted.append(batcher.prefills_inside_steps)  # (the priority-5 one may have been, at the start)
            arrived.extend(llm.stream(p, max_new_tokens=4, temperature=0.0, priority=3) for p in PROMPTS[2:4])

    handle = _decoder_layers(llm.model)[0].register_forward_pre_hook(arrive)
    try:
        running = [llm.stream(PROMPTS[0], max_new_tokens=40, temperature=0.0, priority=0),
                   llm.stream(PROMPTS[1], max_new_tokens=40, temperature=0.0, priority=5)]
        finals = [s.wait() for s in running]
        finals = [s.wait() for s in arrived] + finals  # (they arrive while the running ones decode)
    finally:
        handle.remove()
        llm.close()
    assert len(finals) == 4 and batcher.prefills_inside_steps - counted[0] == 1
    assert all(f.finish_reason in ("length", "stop") for f in finals)
    assert finals[0].text == tiny_llm.generate(PROMPTS[2], max_new_tokens=4).text


def test_the_model_stays_copyable_while_an_engine_runs_it(tiny_llm) -> None:
    """The prefill-point hooks on the user's model hold the engine weakly: deepcopy still works."""
    import copy

    twin = copy.deepcopy(tiny_llm.model)
    assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in tiny_llm.model.parameters())


def test_close_ends_the_thread_and_later_streams_raise(text_tokenizer, tiny_llm) -> None:
    llm = ms.TextModel(tiny_llm.model, text_tokenizer, name="tiny-closing")
    running = llm.stream(PROMPTS[1], max_new_tokens=400)
    thread, events = _consume_in_thread(running)
    _wait_for_events(events, 2)
    llm.close()
    thread.join(30)
    assert events[-1].is_final and events[-1].finish_reason == "cancelled"
    assert not llm.engine.thread.is_alive()
    with pytest.raises(EngineClosedError, match="closed"):
        llm.stream("Hi")


def test_dropping_the_model_ends_its_engine_thread(text_tokenizer, tiny_llm) -> None:
    llm = ms.TextModel(tiny_llm.model, text_tokenizer, name="tiny-dropped")
    assert llm.generate("Hi", max_new_tokens=2).is_final
    thread = llm.engine.thread
    del llm
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_bad_engine_settings_are_clear_errors(text_tokenizer, tiny_llm) -> None:
    with pytest.raises(ms.InvalidArgumentError, match="max_batch must be an integer >= 1"):
        ms.TextModel(tiny_llm.model, text_tokenizer, max_batch=0)
    with pytest.raises(ms.InvalidArgumentError, match="priority must be an integer"):
        tiny_llm.stream("Hi", priority="high")


# -- images: step-level interleaving ---------------------------------------------------------------


@pytest.fixture(scope="module")
def shapes():
    sd = ms.load_image_model()
    yield sd
    sd.close()


@pytest.fixture(scope="module")
def in_turn(shapes):
    """The embedded model's pipeline with max_batch=1: requests take steps in turn, each
    bit-identical to its run alone (the reference for batched steps)."""
    one = ms.ImageModel(shapes.pipeline, max_batch=1, name="one-at-a-time")
    yield one
    one.close()


def test_a_short_image_request_finishes_while_a_long_one_runs(shapes) -> None:
    shapes._stepper.trace = []
    try:
        long = shapes.stream("a red circle on a blue background", steps=16, seed=0, preview="none")
        long_thread, long_events = _consume_in_thread(long)
        time.sleep(0.05)
        short = shapes.generate("a green square on a white background", steps=3, seed=0, preview="none")
        long_thread.join(60)
        assert short.finish_reason == "stop" and long_events[-1].finish_reason == "stop"
        trace = [order for order, _ in shapes._stepper.trace]
        short_order = max(trace)
        first_short = trace.index(short_order)
        last_short = len(trace) - 1 - trace[::-1].index(short_order)
        # The long request had steps before the short one came, and goes on after it ended:
        # the short one did not wait for the long one to finish.
        assert any(o != short_order for o in trace[:first_short])
        assert any(o != short_order for o in trace[last_short + 1:])
    finally:
        shapes._stepper.trace = None


def test_interleaved_images_equal_images_alone(in_turn) -> None:
    """With max_batch=1 requests take steps in turn, each bit-identical to its run alone."""
    one = in_turn
    alone = [one.generate(p, steps=6, seed=3, preview="none").data for p in ("a red circle on a blue background", "a yellow star on a black background")]
    one._stepper.trace = []
    try:
        streams = [one.stream(p, steps=6, seed=3, preview="latent") for p in ("a red circle on a blue background", "a yellow star on a black background")]
        together = [s.wait().data for s in streams]
        trace = [order for order, _ in one._stepper.trace]
        assert one._stepper.batched_calls == 0
    finally:
        one._stepper.trace = None
    assert together == alone
    # Requests of equal length take turns: both advance in the first half of the steps.
    assert len(set(trace[: len(trace) // 2])) == 2


SHAPES = ["a red circle on a blue background", "a green square on a white background",
          "a yellow triangle on a green background"]


def _pixels(ev) -> "np.ndarray":
    import numpy as np

    return np.asarray(ev.image.convert("RGB"), dtype=np.int16)


def test_same_shape_requests_share_batched_denoiser_calls(shapes, in_turn) -> None:
    """Concurrent requests of one shape take their steps together in one batched UNet call; each
    image matches its run alone within float rounding, and each gets all its own previews."""
    import numpy as np

    alone = [in_turn.generate(p, steps=8, seed=i, preview="none") for i, p in enumerate(SHAPES)]
    before = shapes._stepper.batched_calls
    shapes._stepper.trace = []
    try:
        streams = [shapes.stream(p, steps=8, seed=i, preview="latent", preview_every=1) for i, p in enumerate(SHAPES)]
        events = [list(s) for s in streams]
        trace = shapes._stepper.trace
    finally:
        shapes._stepper.trace = None
    assert shapes._stepper.batched_calls - before >= 6  # (all three joined after their first steps)
    ticks: dict[int, set[int]] = {}
    for order, tick in trace:
        ticks.setdefault(tick, set()).add(order)
    assert max(len(v) for v in ticks.values()) == 3
    for evs, ref in zip(events, alone):
        final = evs[-1]
        assert final.finish_reason == "stop" and final.step == 8
        assert np.abs(_pixels(final) - _pixels(ref)).max() <= 2
        assert final.metrics["previews"] == 8


def test_batched_steps_keep_priority_and_shapes_apart(shapes, in_turn) -> None:
    """A higher priority steps alone (never slowed by lower ones); requests of another size run
    in the same steps without sharing a call; both still match their runs alone."""
    import numpy as np

    ref_small = in_turn.generate(SHAPES[0], steps=6, seed=1, height=32, width=32, preview="none")
    ref_big = in_turn.generate(SHAPES[1], steps=6, seed=2, preview="none")
    shapes._stepper.trace = []
    before = shapes._stepper.batched_calls
    try:
        lows = [shapes.stream(SHAPES[0], steps=6, seed=1, height=32, width=32, preview="none"),
                shapes.stream(SHAPES[1], steps=6, seed=2, preview="none")]
        high = shapes.stream(SHAPES[2], steps=6, seed=3, preview="none", priority=5)
        finals = [s.wait() for s in lows]
        assert high.wait().finish_reason == "stop"
        trace = shapes._stepper.trace
    finally:
        shapes._stepper.trace = None
    assert shapes._stepper.batched_calls == before  # 32 px and 64 px latents never share a call
    assert np.abs(_pixels(finals[0]) - _pixels(ref_small)).max() <= 2
    assert np.abs(_pixels(finals[1]) - _pixels(ref_big)).max() <= 2
    orders = sorted({order for order, _ in trace})
    high_order = orders[-1]
    ticks: dict[int, set[int]] = {}
    for order, tick in trace:
        ticks.setdefault(tick, set()).add(order)
    assert all(group == {high_order} for group in ticks.values() if high_order in group)


@pytest.mark.parametrize("fault", ["batched calls only", "every call"])
def test_a_failing_batched_call_is_retried_alone_and_the_engine_goes_on(shapes, in_turn, fault: str) -> None:
    """A batched UNet call that fails (out of memory at the larger batch, say) is run again one
    request at a time: the requests finish if they can alone, else each gets an error event; the
    engine serves the next request either way."""
    import numpy as np

    def refuse(module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        if fault == "every call" or sample.shape[0] > 2:  # > 2: more than one request's CFG pair
            raise RuntimeError("injected fault in a UNet call")

    before = shapes._stepper.batched_calls
    handle = shapes.pipeline.unet.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        streams = [shapes.stream(p, steps=6, seed=i, preview="none") for i, p in enumerate(SHAPES[:2])]
        finals = [s.wait() for s in streams]
    finally:
        handle.remove()
    assert shapes._stepper.batched_calls == before
    if fault == "every call":
        assert [f.type for f in finals] == ["error", "error"]
        assert all("injected fault" in f.error["message"] for f in finals)
    else:
        refs = [in_turn.generate(p, steps=6, seed=i, preview="none") for i, p in enumerate(SHAPES[:2])]
        assert [f.finish_reason for f in finals] == ["stop", "stop"]
        assert all(np.abs(_pixels(f) - _pixels(r)).max() <= 2 for f, r in zip(finals, refs))
    assert shapes.generate(SHAPES[0], steps=3, seed=0, preview="none").finish_reason == "stop"


def test_image_max_batch_is_checked() -> None:
    with pytest.raises(ms.InvalidArgumentError, match="max_batch must be an integer >= 1"):
        ms.ImageModel(ms.load_image_model().pipeline, max_batch=0)


def test_image_priority_takes_the_next_step(shapes) -> None:
    shapes._stepper.trace = []
    try:
        low = shapes.stream("a red circle on a blue background", steps=10, seed=0, preview="none")
        thread, events = _consume_in_thread(low)
        time.sleep(0.05)
        high = shapes.generate("a blue square on a red background", steps=4, seed=0, preview="none", priority=5)
        thread.join(60)
        trace = [order for order, _ in shapes._stepper.trace]
        high_order = max(trace)
        steps_of_high = [i for i, o in enumerate(trace) if o == high_order]
        # Once the high-priority request has started, it takes every step until it is done.
        assert steps_of_high == list(range(steps_of_high[0], steps_of_high[0] + len(steps_of_high)))
        assert high.finish_reason == "stop"
    finally:
        shapes._stepper.trace = None


def test_image_finish_early_gives_a_full_vae_png_closer_than_the_preview(shapes) -> None:
    import numpy as np

    prompt = "a red circle on a blue background"
    full = shapes.generate(prompt, steps=20, seed=0, preview="none")
    s = shapes.stream(prompt, steps=20, seed=0, preview="latent", preview_every=1)
    events, preview_at_stop = [], None
    for ev in s:
        events.append(ev)
        if ev.step == 8 and not ev.is_final:
            preview_at_stop = ev
            s.finish_early()
    final = events[-1]
    assert final.finish_reason == "finished_early" and final.mime == "image/png"
    assert final.image.size == (64, 64)
    assert 8 <= final.step < 20

    def mae(ev) -> float:
        a = np.asarray(ev.image.convert("RGB").resize((64, 64)), dtype=np.float32)
        return float(np.abs(a - np.asarray(full.image.convert("RGB"), dtype=np.float32)).mean())

    # Keeping the picture now gives something closer to the full run's result than the preview shown.
    assert preview_at_stop is not None and mae(final) < mae(preview_at_stop)


# -- leaving a stream early ends the process cleanly -------------------------------------------------


@pytest.mark.parametrize("kind", ["image", "text"])
def test_leaving_streams_early_then_exiting_is_clean(kind: str, tmp_path) -> None:
    # Each way of leaving (break, an exception in user code, cancel), then the script just ends:
    # before the engine, an image stream left this way aborted the interpreter (status 134).
    start = (
        'model = ms.load_image_model()\ndef new(): return model.stream("a red circle on a blue background", steps=30, seed=0)'
        if kind == "image"
        else 'model = ms.load_text_model()\ndef new(): return model.stream("Write a long story", max_new_tokens=200)'
    )
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""\
        import multistream as ms
        {start}
        for ev in new():
            break
        try:
            for ev in new():
                raise KeyError("user code failed")
        except KeyError:
            pass
        s = new(); next(iter(s)); s.cancel()
        s = new(); next(iter(s))          # left running: the interpreter exits with it in flight
        print("left")
        """).format(start=start))
    # This checkout, whatever is installed: the script runs from a temporary directory.
    root = str(ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left" in done.stdout
    assert "terminate called" not in done.stderr


def test_the_arrival_flag_is_set_while_a_request_waits_and_cleared_when_taken() -> None:
    """`Engine.arrivals` is what the native decode polls at its prefill points: set by `submit` for a
    request (not for a call), cleared when the engine takes the inbox."""
    from multistream.engine.core import Engine

    gate, busy, taken = threading.Event(), threading.Event(), []

    class Backend:
        def admit(self, item) -> None:
            taken.append(item)

        def has_work(self) -> bool:
            return False

        def step(self) -> None:
            pass

        def fail_all(self, exc) -> None:
            pass

        def shutdown(self) -> None:
            pass

    engine = Engine(Backend(), name="flag-test")
    try:
        def hold() -> None:  # keeps the engine thread inside a call, so the inbox is not taken
            busy.set()
            gate.wait(5)

        blocker = threading.Thread(target=engine.run_on_engine, args=(hold,), daemon=True)
        blocker.start()
        assert busy.wait(5)
        assert engine.arrivals.value == 0  # a call alone does not raise it
        engine.submit("a request")
        assert engine.arrivals.value == 1
        assert engine.poll_arrivals() == 1 and engine.arrivals.value == 0 and taken == ["a request"]
        engine.submit("another")
        gate.set()
        blocker.join(5)
        deadline = time.monotonic() + 5
        while len(taken) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert taken == ["a request", "another"] and engine.arrivals.value == 0
    finally:
        engine.close()
