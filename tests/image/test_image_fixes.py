"""Fixes in the diffusers adapter (issue 10): a diffusers ``PipelineCallback`` as the user's step
callback keeps its tensor inputs, and a Flux hub model is loaded in bfloat16 from the start."""

from __future__ import annotations

import types

import pytest
import torch

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from test_image import one_thread  # noqa: F401

import multistream as ms
from multistream.image import ImageModel
from multistream.image import _loading as image_module
from multistream.testing import _random_pipelines as rp


@pytest.fixture(scope="module")
def sd() -> ImageModel:
    return ms.load_image_model(rp.tiny_sd_pipeline(scheduler="ddim"))


def test_sd_cfg_cutoff_callback_works_as_user_callback(sd: ImageModel) -> None:
    from diffusers.callbacks import SDCFGCutoffCallback

    # It reads and rewrites callback_kwargs["prompt_embeds"]: a KeyError if only latents were asked for.
    guidance_seen: list[float] = []

    class Cutoff(SDCFGCutoffCallback):
        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            out = super().callback_fn(pipeline, step_index, timestep, callback_kwargs)
            # The pipeline passed in is the run's own (each run has its own scheduler and state).
            guidance_seen.append(pipeline._guidance_scale)
            return out

    cutoff = Cutoff(cutoff_step_ratio=0.5)
    final = sd.generate("x", steps=4, seed=0, guidance_scale=7.0, preview="x0", callback_on_step_end=cutoff)
    assert final.type == "image" and final.finish_reason == "stop", getattr(final, "error", None)
    assert guidance_seen[0] == 7.0 and guidance_seen[-1] == 0.0  # the cutoff happened


def test_multi_pipeline_callbacks_chain_every_tensor_input(sd: ImageModel) -> None:
    from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback, SDCFGCutoffCallback

    seen: list[set[str]] = []

    class Record(PipelineCallback):
        tensor_inputs = ["latents", "prompt_embeds"]

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            seen.append(set(callback_kwargs))
            return callback_kwargs

    both = MultiPipelineCallbacks([Record(cutoff_step_ratio=None, cutoff_step_index=100), SDCFGCutoffCallback(cutoff_step_ratio=None, cutoff_step_index=1)])
    final = sd.generate("x", steps=3, seed=0, guidance_scale=7.0, callback_on_step_end=both)
    assert final.finish_reason == "stop", getattr(final, "error", None)
    assert seen and all({"latents", "prompt_embeds"} <= keys for keys in seen)


def test_explicit_tensor_inputs_still_merge(sd: ImageModel) -> None:
    seen: list[set[str]] = []

    def record(pipe, i, t, kwargs):
        seen.append(set(kwargs))
        return kwargs

    sd.generate("x", steps=2, seed=0, callback_on_step_end=record, callback_on_step_end_tensor_inputs=["prompt_embeds"])
    assert seen and all({"latents", "prompt_embeds"} <= keys for keys in seen)


def test_flux_hub_id_loads_in_bfloat16_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[torch.dtype] = []

    class FakePipe:
        def to(self, *args, **kwargs):
            raise AssertionError("no cast after loading: the dtype was right from the start")

    def fake_from_pretrained(source, dtype, local_only, **kw):
        loads.append(dtype)
        return FakePipe()

    monkeypatch.setattr(image_module, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(image_module, "check_device", lambda device, family: device)  # as if CUDA were here
    # As if the hub answered (this machine has no network): the name is the source.
    monkeypatch.setattr(image_module, "locate", lambda name, **kw: types.SimpleNamespace(path=name, offline=False))
    monkeypatch.setattr(image_module, "_from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(image_module, "_hub_class_name", lambda source, **kw: "FluxPipeline")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    with pytest.raises(AssertionError, match="no cast"):
        ms.load_image_model("black-forest-labs/FLUX.1-schnell")  # stops at the final .to(device)
    assert loads == [torch.bfloat16]
