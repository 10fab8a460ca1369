"""The server and the engine: priorities reach the model, admission follows the engine's capacity."""

from __future__ import annotations

from typing import Any

import httpx

from multistream.testing import ScriptedTextModel

from server_fixtures import make_server


class _RecordingModel:
    """A scripted text model with an engine-like ``capacity`` that records the priority it gets."""

    capacity = 3

    def __init__(self) -> None:
        self.inner = ScriptedTextModel()
        self.name = "recording"
        self.priorities: list[int] = []

    def count_tokens(self, prompt: Any) -> int:
        return self.inner.count_tokens(prompt)

    def stream(self, prompt: Any, *, priority: int = 0, **kwargs: Any) -> Any:
        self.priorities.append(priority)
        return self.inner.stream(prompt, **kwargs)


def test_priority_reaches_the_model_capped_and_concurrency_follows_capacity() -> None:
    model = _RecordingModel()
    with make_server(model, max_priority=5) as srv, httpx.Client(timeout=30) as client:
        for priority in (2, 50):
            with client.stream("POST", f"{srv.url}/v1/text", json={"prompt": "hi", "priority": priority}) as r:
                assert r.status_code == 200
                r.read()
        assert model.priorities == [2, 5]  # the ceiling applies before the engine sees it
        assert srv.state.gates["text"].concurrency == 3
