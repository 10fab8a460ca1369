"""`StreamView`: the local record (`StreamRecord`) and the one read from the shared log
(`RemoteRecord`) are both views of a stream, and share who may read it and how many may follow it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from multistream.server import ServerSettings
from multistream.server.access.metrics import Metrics
from multistream.server.durable.event_log import RemoteRecord
from multistream.server.http.problems import Problem
from multistream.server.streams.registry import Registry
from multistream.server.streams.view import StreamView
from multistream.testing import ScriptedTextModel


def test_a_local_record_is_a_stream_view_with_the_shared_access_rules() -> None:
    async def main() -> None:
        settings = ServerSettings(max_followers=1)
        registry = Registry(settings, Metrics())
        record = registry.start(ScriptedTextModel(["a", "b"]).stream("hi"), kind="text", owner="key-1",
                                owner_keyed=True)
        assert isinstance(record, StreamView)
        assert record.allows(None, record.token)  # its resume token
        assert record.allows(SimpleNamespace(id="key-1"), None) and not record.allows(SimpleNamespace(id="k2"), None)
        events = [ev async for ev in record.subscribe()]
        assert events[-1].is_final and record.done and record.final is events[-1]
        record.subscribers = 1
        with pytest.raises(Problem) as refused:
            record.check_follower_room()
        assert refused.value.status == 503

    asyncio.run(main())


def test_a_remote_record_is_a_stream_view_with_the_same_rules() -> None:
    settings = ServerSettings(max_followers=2)
    log = SimpleNamespace(settings=settings)
    record = RemoteRecord(log, "s1", {"token": "t0k", "kind": "text", "owner": "", "keyed": "0"}, [])  # type: ignore[arg-type]
    assert isinstance(record, StreamView)
    assert record.allows(None, "t0k") and not record.allows(None, "other") and not record.allows(None, None)
    record.subscribers = 1
    record.check_follower_room()  # one more may follow
    record.subscribers = 2
    with pytest.raises(Problem) as refused:
        record.check_follower_room()
    assert refused.value.status == 503 and "max_followers" in str(refused.value)
    assert record.events == [] and record.final is None and not record.done
