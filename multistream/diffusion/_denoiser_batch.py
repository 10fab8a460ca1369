"""One denoiser call for several image requests: same-shape requests take a step together.

A request's pipeline copy calls `DenoiserGate` where it would call its UNet. While the engine
gathers a group (`ImageStepper`), the gate does not run the UNet: it hands the call's inputs to
the engine (a greenlet switch, ``Parked``) and waits. When every member of the group has parked
(or yielded, or ended), the engine runs `call_together`: calls with the same shapes and
arguments become one batched UNet call (samples, timesteps, text embeddings and SDXL's added
conditions concatenated along the batch), each member gets its own slice back, and each goes on
to its scheduler step, callback and preview as if it had called the UNet alone. Outside a group
the gate is a plain call.

Why: a small denoiser on a CPU, and any denoiser at small batch on a GPU, costs nearly as much
for 4 samples as for 2 (measured on the embedded 64 px model on 2 CPU cores: 20 ms for one
request's CFG pair, 25 ms for two requests, 35 ms for four), so interleaved requests that each
took their own step pay for the weights' pass again and again.

Calls that carry anything else (ControlNet residuals, attention masks, cross-attention kwargs,
class labels) run alone; a batched call that fails (out of memory at the larger batch, say) is run
again one request at a time, so it fails only the requests that fail alone. Batching may change the last bits of float results (kernels pick other
blockings at other batch sizes): pass ``max_batch=1`` to `ImageModel` for results bit-identical
to a request run alone.

Example (what `ImageRun` does with its pipeline copy):
    >>> pipe.__dict__["unet"] = DenoiserGate(pipe.unet, stepper)   # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from greenlet import getcurrent

__all__ = ["DenoiserGate", "Gathering", "Parked", "call_together"]

logger = logging.getLogger("multistream")

# UNet2DConditionModel.forward's leading positional parameters, in order.
_POSITIONAL = ("sample", "timestep", "encoder_hidden_states")
# Keyword arguments that may be set (not None) in a batched call; anything else runs alone.
_BATCHABLE = {"sample", "timestep", "encoder_hidden_states", "timestep_cond", "added_cond_kwargs", "return_dict"}


class Parked:
    """A denoiser call waiting for the engine: the call as made, its inputs by name, its batch key."""

    __slots__ = ("args", "gate", "inputs", "key", "kwargs")

    def __init__(self, gate: DenoiserGate, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.gate = gate
        self.args, self.kwargs = args, kwargs
        self.inputs = {**dict(zip(_POSITIONAL, args)), **kwargs}
        self.key = _batch_key(gate.denoiser, self.inputs) if len(args) <= len(_POSITIONAL) else None

    def alone(self) -> Any:
        return self.gate.denoiser(*self.args, **self.kwargs)


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Gathering(Protocol):
    """What a gate reads of the engine's step scheduler (`ImageStepper`): whether it is gathering
    a batched step now (else a call runs the denoiser at once)."""

    gathering: bool


class DenoiserGate:
    """Stands in for a run's UNet; parks its calls while the engine gathers a batched step."""

    def __init__(self, denoiser: torch.nn.Module, stepper: Gathering) -> None:
        self.denoiser = denoiser
        self.stepper = stepper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.stepper.gathering:
            return self.denoiser(*args, **kwargs)
        # The request's greenlet's parent is the engine: it resumes us with the result.
        reply = getcurrent().parent.switch(Parked(self, args, kwargs))
        if isinstance(reply, _Failed):
            raise reply.exc
        return reply

    def __getattr__(self, name: str) -> Any:
        # config, dtype, device, add_embedding, ...: the pipeline reads them from its "unet".
        if name in ("denoiser", "stepper"):  # not set yet (copy, unpickling): no endless recursion
            raise AttributeError(name)
        return getattr(self.denoiser, name)


def _batch_key(denoiser: Any, inputs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What calls must share to be batched (None: this call runs alone)."""
    if any(v is not None for k, v in inputs.items() if k not in _BATCHABLE):
        return None
    sample, ehs = inputs.get("sample"), inputs.get("encoder_hidden_states")
    if not isinstance(sample, torch.Tensor) or not isinstance(ehs, torch.Tensor) or ehs.shape[0] != sample.shape[0]:
        return None
    cond = inputs.get("timestep_cond")
    added = inputs.get("added_cond_kwargs") or {}
    if cond is not None and (not isinstance(cond, torch.Tensor) or cond.shape[0] != sample.shape[0]):
        return None
    if not all(isinstance(v, torch.Tensor) and v.shape[0] == sample.shape[0] for v in added.values()):
        return None
    return (id(denoiser), tuple(sample.shape[1:]), sample.dtype, sample.device, tuple(ehs.shape[1:]), ehs.dtype,
            None if cond is None else tuple(cond.shape[1:]),
            tuple(sorted((k, tuple(v.shape[1:])) for k, v in added.items())))


def _timesteps(t: Any, n: int, device: torch.device) -> torch.Tensor:
    t = t if isinstance(t, torch.Tensor) else torch.tensor(t, device=device)
    t = t.to(device).reshape(-1)
    return t.expand(n) if t.numel() == 1 else t


def call_together(calls: list[Parked]) -> tuple[list[Any], int]:
    """Run parked calls, batching those with the same key: one reply per call (a result, or the
    error to raise in that request), and how many batched calls that took."""
    replies: list[Any] = [None] * len(calls)
    shared = 0
    groups: dict[Any, list[int]] = {}
    for i, call in enumerate(calls):
        groups.setdefault(call.key if call.key is not None else ("alone", i), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            try:
                outputs = _batched(calls[members[0]].gate.denoiser, [calls[i].inputs for i in members])
            except Exception:  # noqa: BLE001 - e.g. out of memory at the larger batch: each alone
                logger.warning("a batched denoiser call of %d requests failed; running them one by one",
                               len(members), exc_info=True)
            else:
                shared += 1
                for i, out in zip(members, outputs):
                    replies[i] = out
                continue
        for i in members:
            try:
                replies[i] = calls[i].alone()
            except Exception as exc:  # noqa: BLE001 - that request fails with it, the others go on
                replies[i] = _Failed(exc)
    return replies, shared


def _batched(denoiser: Any, inputs: list[dict[str, Any]]) -> list[Any]:
    sizes = [x["sample"].shape[0] for x in inputs]
    device = inputs[0]["sample"].device
    merged: dict[str, Any] = {
        "sample": torch.cat([x["sample"] for x in inputs]),
        "timestep": torch.cat([_timesteps(x["timestep"], n, device) for x, n in zip(inputs, sizes)]),
        "encoder_hidden_states": torch.cat([x["encoder_hidden_states"] for x in inputs]),
        "return_dict": False,
    }
    if inputs[0].get("timestep_cond") is not None:
        merged["timestep_cond"] = torch.cat([x["timestep_cond"] for x in inputs])
    if inputs[0].get("added_cond_kwargs"):
        merged["added_cond_kwargs"] = {k: torch.cat([x["added_cond_kwargs"][k] for x in inputs])
                                       for k in inputs[0]["added_cond_kwargs"]}
    out = denoiser(**merged)[0]
    replies = []
    for x, part in zip(inputs, torch.split(out, sizes)):
        if x.get("return_dict", True):
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            replies.append(UNet2DConditionOutput(sample=part))
        else:
            replies.append((part,))
    return replies
