"""Resumable image runs (issue 13, part 3): ``on_checkpoint=`` / ``resume_from=`` on the embedded model.

A run resumed from the checkpoint taken after step k ends with the same final image as the run
never interrupted (the same PNG bytes: exact, fp32 on a CPU) and shows the same previews after k,
under their original step numbers. Checked for the embedded model's multistep solver
(DPMSolverMultistep: ``model_outputs`` and ``lower_order_nums`` carried) and for an ancestral
sampler (EulerAncestralDiscrete: the generator's state carried), and after a steer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from test_image import Lockstep, one_thread  # noqa: F401

import multistream as ms
from multistream.errors import InvalidArgumentError
from multistream.image import EMBEDDED_MODEL_DIR, ImageCheckpoint

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        not (EMBEDDED_MODEL_DIR / "model_index.json").is_file(), reason="the embedded image model is not installed"
    ),
]

PROMPT = "a red circle on a blue background"
STEPS = 10


@pytest.fixture(scope="module")
def ancestral(shapes: ms.ImageModel):
    from diffusers import EulerAncestralDiscreteScheduler, StableDiffusionPipeline

    components = dict(shapes.pipeline.components)
    components["scheduler"] = EulerAncestralDiscreteScheduler.from_config(shapes.pipeline.scheduler.config)
    model = ms.ImageModel(StableDiffusionPipeline(**components))
    yield model
    model.close()


def _run(model: ms.ImageModel, **kwargs) -> tuple[list, list[ImageCheckpoint]]:
    """Every event (no preview dropped) and every checkpoint of one run."""
    saved: list[ImageCheckpoint] = []
    lock = Lockstep()
    kwargs.setdefault("on_checkpoint", saved.append)
    events = lock.events(model.stream(PROMPT, steps=STEPS, seed=3, preview="x0", preview_format="png",
                                      callback_on_step_end=lock.callback, **kwargs))
    return events, saved


@pytest.mark.parametrize("which", ["embedded", "ancestral"])
def test_resumed_run_equals_the_uninterrupted_one(which: str, shapes: ms.ImageModel, ancestral) -> None:
    model = shapes if which == "embedded" else ancestral
    full, saved = _run(model)
    assert [c.step for c in saved] == list(range(1, STEPS + 1)) and full[-1].metrics["checkpoints"] == STEPS
    for k in (1, 4, 9):
        data = saved[k - 1].to_bytes()  # through bytes, as a checkpoint in Redis travels
        resumed, _ = _run(model, resume_from=data, on_checkpoint=None)
        assert [e.step for e in resumed[:-1]] == list(range(k + 1, STEPS + 1))
        assert [e.data for e in resumed[:-1]] == [e.data for e in full[k:-1]]  # the same previews after k
        final = resumed[-1]
        assert final.is_final and final.finish_reason == "stop" and final.step == final.total_steps == STEPS
        assert final.data == full[-1].data  # the same PNG: the same pixels, exactly
        assert final.metrics["resumed_from_step"] == k and final.metrics["steps"] == STEPS
    # What the checkpoint carries: the solver's history, and the generator only where steps drew noise.
    ck = ImageCheckpoint.from_bytes(saved[3].to_bytes())
    assert ck.step == 4 and ck.total_steps == STEPS and torch.equal(ck.latents, saved[3].latents)
    if which == "embedded":
        assert {"model_outputs", "lower_order_nums", "_step_index"} <= set(ck.scheduler_state)
        assert ck.generators == 0
        assert len(saved[3].to_bytes()) < 16_000  # 4x16x16 fp32 latents, two model outputs, a header
    else:
        assert ck.generators == 1
        # Without the generator's state the rest of the run draws other noise: another picture.
        no_rng = dataclasses.replace(saved[3], generators=0)
        other = model.generate(PROMPT, steps=STEPS, seed=3, preview="none", resume_from=no_rng)
        assert other.data != full[-1].data


def test_checkpoint_every_k_and_the_steered_conditioning(shapes: ms.ImageModel) -> None:
    holder: dict = {}

    def steer_after_2(pipe, i, t, kwargs):
        if i + 1 == 2:
            holder["stream"].steer(prompt="a red circle on a yellow background", guidance_scale=5.0)
        return kwargs

    saved: list[ImageCheckpoint] = []
    s = holder["stream"] = shapes.stream(PROMPT, steps=STEPS, seed=1, preview="none", on_checkpoint=saved.append,
                                         checkpoint_every=3, callback_on_step_end=steer_after_2)
    steered = s.wait()
    assert [c.step for c in saved] == [3, 6, 9] and steered.metrics["steers"] == 1
    assert saved[0].conditioning == {"prompt": "a red circle on a yellow background", "negative_prompt": None,
                                     "guidance_scale": 5.0}
    resumed = shapes.generate(PROMPT, steps=STEPS, seed=1, preview="none", resume_from=saved[0])
    assert resumed.data == steered.data and resumed.metrics["steers"] == 1
    assert shapes.generate(PROMPT, steps=STEPS, seed=1, preview="none").data != steered.data


def test_bad_checkpoint_arguments(shapes: ms.ImageModel) -> None:
    saved: list[ImageCheckpoint] = []
    shapes.generate(PROMPT, steps=4, seed=0, preview="none", on_checkpoint=saved.append, checkpoint_every=2)
    ck = saved[0]
    with pytest.raises(InvalidArgumentError, match="not a multistream image checkpoint"):
        shapes.stream(PROMPT, steps=4, seed=0, resume_from=b"junk")
    with pytest.raises(InvalidArgumentError, match="not a multistream image checkpoint"):
        ImageCheckpoint.from_bytes(ck.to_bytes()[:-10])
    with pytest.raises(InvalidArgumentError, match="ImageCheckpoint or its to_bytes"):
        shapes.stream(PROMPT, steps=4, seed=0, resume_from="ck.safetensors")
    for change, match in [({"steps": 5}, "steps=4"), ({"seed": 1}, "seed=0"), ({"width": 32}, "width=64"),
                          ({"prompt": "a cat"}, "prompt, negative_prompt and guidance_scale"),
                          ({"guidance_scale": 3.0}, "prompt, negative_prompt and guidance_scale")]:
        args = {"prompt": PROMPT, "steps": 4, "seed": 0, **change}
        with pytest.raises(InvalidArgumentError, match=match):
            shapes.stream(args.pop("prompt"), resume_from=ck, **args)
    with pytest.raises(InvalidArgumentError, match="checkpoint_every must be an integer >= 1"):
        shapes.stream(PROMPT, on_checkpoint=print, checkpoint_every=0)
    with pytest.raises(InvalidArgumentError, match="on_checkpoint must be callable"):
        shapes.stream(PROMPT, on_checkpoint="ms:ckpt")
