"""The ingress's failover (`server.ray._handle.RemoteModel`) on a fake deployment handle: no Ray
cluster, only Ray's exception types, so the order of failures is the test's, not the scheduler's.

A full suite on 2 cores once took over 30 s to start the image replica that replaced a killed one;
meanwhile Serve answered `DeploymentUnavailableError`, and eight quick retries (2 s) ended the
stream with an error. Waiting for a replica that is starting is not a failure of one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.exceptions import RayActorError  # noqa: E402
from ray.serve.exceptions import DeploymentUnavailableError  # noqa: E402

from multistream.events import TextEvent  # noqa: E402
from multistream.server.ray import _handle  # noqa: E402
from multistream.server.ray._common import MAX_FAILOVERS  # noqa: E402


def _text(i: int, final: bool = False) -> TextEvent:
    extra: dict[str, Any] = {}
    if final:
        extra = {"is_final": True, "finish_reason": "length", "text": "".join(f" t{k}" for k in range(i + 1)),
                 "usage": {"prompt_tokens": 1, "completion_tokens": i + 1}, "metrics": {}}
    return TextEvent(stream_id="replica-side", seq=i, t=0.0, delta=f" t{i}", token_ids=[i], index=i, offset=None,
                     **extra)


class _Deployment:
    """``handle.options(stream=True).generate.remote(...)``: the first call streams two tokens and
    dies, the next ``unavailable`` calls find no replica up, the last one resumes to the end."""

    def __init__(self, unavailable: int) -> None:
        self.calls: list[dict[str, Any]] = []
        self.unavailable = unavailable
        self.generate = self

    def options(self, **_: Any) -> _Deployment:
        return self

    def remote(self, kwargs: dict[str, Any], resume: dict[str, Any], stream_id: str) -> Any:
        self.calls.append(resume)
        return self._attempt(len(self.calls), resume)

    async def _attempt(self, n: int, resume: dict[str, Any]) -> Any:
        if n == 1:
            yield _text(0)
            yield _text(1)
            raise RayActorError()
        if n <= 1 + self.unavailable:
            raise DeploymentUnavailableError("the deployment 'text' is unhealthy")
        done = len(resume["tokens"])
        for i in range(done, 3):
            yield _text(i)
        yield _text(3, final=True)


async def _run(deployment: _Deployment) -> list[Any]:
    model = _handle.RemoteModel("text", deployment)
    stream = model.stream(prompt="x", max_new_tokens=4)
    return [ev async for ev in stream]


def test_a_stream_waits_for_a_replica_that_is_starting_after_a_failover(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_handle, "WAITING_POLL_S", 0.01)
    deployment = _Deployment(unavailable=3 * MAX_FAILOVERS)  # far more polls than failovers allowed
    events = asyncio.run(_run(deployment))
    final = events[-1]
    assert final.is_final and final.finish_reason == "length", final
    assert final.text == " t0 t1 t2 t3"
    assert deployment.calls[-1]["tokens"] == [0, 1] and deployment.calls[-1]["failover"]


def test_replicas_that_keep_dying_still_end_the_stream_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Dying(_Deployment):
        async def _attempt(self, n: int, resume: dict[str, Any]) -> Any:
            yield _text(0)
            raise RayActorError()

    monkeypatch.setattr(_handle, "WAITING_POLL_S", 0.01)
    events = asyncio.run(_run(Dying(unavailable=0)))
    assert events[-1].type == "error" and "kept failing" in events[-1].error["message"]
