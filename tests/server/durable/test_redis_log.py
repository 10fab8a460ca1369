"""The Redis event log (issue 13, part 1): a real redis-server on a loopback port.

Resume from another process (a second server sharing the log), across a restart of the
single-process server (``multistream serve --event-log redis://...``), retention, and a Redis
outage: 503s at once, no hang, recovery when it returns.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import pytest

from multistream.server import ServerSettings
from multistream.server.durable.event_log import RedisEventLog, entry_id

from redis_fixtures import free_port, needs_redis, redis_server
from server_fixtures import (
    SPEECH_AND_VIDEO_OFF,
    ScriptedImageModel,
    ScriptedTextModel,
    iter_events,
    make_server,
    serve_subprocess,
    wait_until,
)

pytestmark = needs_redis

TOKENS = [f" w{i}" for i in range(30)]


def _post_text(client: httpx.Client, url: str, n: int | None = None, **body: object) -> tuple[str, str, list[dict]]:
    """POST /v1/text; read ``n`` events (all when None); return (stream id, token, events)."""
    events: list[dict] = []
    with client.stream("POST", f"{url}/v1/text", json={"prompt": "hi", **body}) as r:
        assert r.status_code == 200, r.read()
        sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
        for ev in iter_events(r):
            events.append(ev)
            if n is not None and len(events) >= n:
                break
    return sid, token, events


def _resume(client: httpx.Client, url: str, sid: str, token: str, after: int) -> list[dict]:
    with client.stream("GET", f"{url}/v1/streams/{sid}/events",
                       headers={"Last-Event-ID": str(after), "X-Resume-Token": token}) as r:
        assert r.status_code == 200, r.read()
        return list(iter_events(r))


def test_resume_from_another_server_sharing_the_log() -> None:
    """Server A generates; the client drops after 5 events and resumes on server B: no gap, no duplicate."""
    with redis_server() as redis:
        model = ScriptedTextModel(TOKENS, delay_s=0.02)
        with make_server(model, event_log=redis.url) as a, make_server(ScriptedTextModel(), event_log=redis.url) as b, \
                httpx.Client(timeout=20) as client:
            sid, token, first = _post_text(client, a.url, n=5)
            rest = _resume(client, b.url, sid, token, first[-1]["seq"])
            events = first + rest
            assert [e["seq"] for e in events] == list(range(len(events)))
            assert events[-1]["is_final"] and events[-1]["text"] == "".join(TOKENS)
            assert "".join(e["delta"] for e in events) == "".join(TOKENS)
            # The wire JSON is byte-identical on both servers.
            again = _resume(client, b.url, sid, token, -1)
            assert again == events
            # Ownership holds on B too; status and the 204 at the end as well.
            r = client.get(f"{b.url}/v1/streams/{sid}/events", headers={"X-Resume-Token": "wrong"})
            assert r.status_code == 404
            r = client.get(f"{b.url}/v1/streams/{sid}/events",
                           headers={"X-Resume-Token": token, "Last-Event-ID": str(events[-1]["seq"])})
            assert r.status_code == 204
            info = client.get(f"{b.url}/v1/streams/{sid}", headers={"X-Resume-Token": token}).json()
            assert info["done"] and info["finish_reason"] == "stop" and info["events"] == len(events)


def test_a_stream_read_on_another_server_outlives_its_grace_period() -> None:
    """A client that resumed on server B reads the stream through the log and is no subscriber on
    server A, which runs it: A's grace period ended the stream under it ("cancelled" after 1 s here;
    a Ray failover whose new replica took over 30 s to start lost a stream so). B's reads mark the
    stream, and A keeps it while they do."""
    with redis_server() as redis:
        model = ScriptedTextModel(TOKENS, delay_s=0.1)  # 3 s of generation, three grace periods
        with make_server(model, event_log=redis.url, grace_period_s=1) as a, \
                make_server(ScriptedTextModel(), event_log=redis.url) as b, httpx.Client(timeout=30) as client:
            sid, token, first = _post_text(client, a.url, n=3)
            rest = _resume(client, b.url, sid, token, first[-1]["seq"])
            events = first + rest
            assert [e["seq"] for e in events] == list(range(len(events)))
            assert events[-1]["finish_reason"] == "stop" and events[-1]["text"] == "".join(TOKENS)


def test_a_server_that_read_a_live_stream_earlier_resumes_it_at_a_later_event() -> None:
    """Server B looks at a live stream of A (status, an edit) and caches what the log held then; a
    resume on B after a later event still works (B reads the entries appended since)."""
    with redis_server() as redis:
        model = ScriptedTextModel(TOKENS, delay_s=0.03)
        with make_server(model, event_log=redis.url) as a, make_server(ScriptedTextModel(), event_log=redis.url) as b, \
                httpx.Client(timeout=20) as client:
            events: list[dict] = []
            with client.stream("POST", f"{a.url}/v1/text", json={"prompt": "hi"}) as r:
                sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
                for ev in iter_events(r):
                    events.append(ev)
                    if len(events) == 2:
                        info = client.get(f"{b.url}/v1/streams/{sid}", headers={"X-Resume-Token": token}).json()
                        assert not info["done"]
                    if len(events) == 8:
                        break
            # A's log writer puts the 8th event in Redis soon: B sees it there.
            wait_until(lambda: client.get(f"{b.url}/v1/streams/{sid}",
                                          headers={"X-Resume-Token": token}).json()["events"] >= 8,
                       what="the 8th event in the shared log")
            rest = _resume(client, b.url, sid, token, events[-1]["seq"])
            events += rest
            assert [e["seq"] for e in events] == list(range(len(events)))
            assert events[-1]["is_final"] and events[-1]["text"] == "".join(TOKENS)


def test_cancel_on_another_server_reaches_the_producer() -> None:
    with redis_server() as redis:
        model = ScriptedTextModel([f" t{i}" for i in range(400)], delay_s=0.02)
        with make_server(model, event_log=redis.url) as a, make_server(ScriptedTextModel(), event_log=redis.url) as b, \
                httpx.Client(timeout=20) as client:
            sid, token, first = _post_text(client, a.url, n=3)
            r = client.delete(f"{b.url}/v1/streams/{sid}", headers={"X-Resume-Token": token})
            assert r.status_code == 200 and r.json()["cancelled"] is True
            rest = _resume(client, b.url, sid, token, first[-1]["seq"])
            assert rest[-1]["finish_reason"] == "cancelled"


def _serve(redis_url: str, port: int) -> subprocess.Popen[bytes]:
    return serve_subprocess(port, "--text-model", "server_fixtures:slow_text_model", "--image-model", "none",
                            *SPEECH_AND_VIDEO_OFF, "--event-log", redis_url)


def test_resume_after_a_restart_of_the_single_process_server() -> None:
    """`multistream serve --event-log redis://...`: a finished stream replays after a restart; a
    stream cut by the restart replays up to where it was, then ends with an error (no hang)."""
    with redis_server() as redis:
        port = free_port()
        proc = _serve(redis.url, port)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=30) as client:
                done_sid, done_token, done_events = _post_text(client, url, max_new_tokens=6)
                cut_sid, cut_token, cut_first = _post_text(client, url, n=4, max_new_tokens=300)
                proc.terminate()
                proc.wait(30)
                proc = _serve(redis.url, port)
                assert _resume(client, url, done_sid, done_token, 2) == done_events[3:]
                assert done_events[-1]["finish_reason"] == "length"
                # The interrupted one runs on through the drain (or is handed off to the new server): its log ends
                # with a final.
                rest = _resume(client, url, cut_sid, cut_token, cut_first[-1]["seq"])
                seqs = [e["seq"] for e in cut_first + rest]
                assert seqs == list(range(len(seqs)))
                assert rest[-1]["is_final"]
        finally:
            proc.terminate()
            proc.wait(30)


def test_redis_down_gives_503_at_once_and_recovers() -> None:
    with redis_server() as redis:
        model = ScriptedTextModel(TOKENS[:5])
        with make_server(model, event_log=redis.url) as srv, httpx.Client(timeout=20) as client:
            sid, token, events = _post_text(client, srv.url)
            redis.stop()
            t0 = time.monotonic()
            r = client.post(f"{srv.url}/v1/text", json={"prompt": "hi"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "event_log_unavailable"
            assert r.headers["retry-after"]
            # A stream this process does not hold cannot be looked up: 503 too (not 404, not a hang).
            r = client.get(f"{srv.url}/v1/streams/{'0' * 32}/events", headers={"X-Resume-Token": "x"})
            assert r.status_code == 503
            # One this process holds still replays from memory.
            r = client.get(f"{srv.url}/v1/streams/{sid}/events", headers={"X-Resume-Token": token})
            assert r.status_code == 200
            assert time.monotonic() - t0 < 8, "a Redis outage must not make requests hang"
            assert 'multistream:event_log_up 0.0' in client.get(f"{srv.url}/metrics").text
            redis.start()  # the same port: the client reconnects by itself
            sid2, token2, events2 = _post_text(client, srv.url)
            assert events2[-1]["text"] == "".join(TOKENS[:5])


def test_retention_previews_and_bounds() -> None:
    """The log keeps the newest preview per image of a live stream; count bound evicts the oldest."""
    with redis_server() as redis:
        image = ScriptedImageModel(steps=6, size=32, delay_s=0.05)  # spaced: the client sees several previews
        with make_server(ScriptedTextModel(TOKENS[:3]), image, event_log=redis.url, max_retained_streams=2) as srv, \
                httpx.Client(timeout=20) as client:
            with client.stream("POST", f"{srv.url}/v1/image", json={"prompt": "a red circle", "steps": 6}) as r:
                isid = r.headers["x-stream-id"]
                events = list(iter_events(r))

            async def inspect(sids: list[str]) -> tuple[list[int], list[bool]]:
                log = RedisEventLog(redis.url, ServerSettings())
                entries = await log.redis.xrange(log.key("s", isid))
                exists = [bool(await log.redis.exists(log.key("s", s))) for s in sids]
                await log.close()
                return [int(e[0].decode().split("-")[1]) - 1 for e in entries], exists

            seqs, _ = asyncio.run(inspect([]))
            previews = [e for e in events if e["type"] == "image" and not e["is_final"]]
            assert len(previews) >= 2
            # Every preview but the newest was dropped from the log while the stream was live.
            assert previews[-1]["seq"] in seqs and previews[0]["seq"] not in seqs
            assert events[-1]["seq"] in seqs

            sids = [isid] + [_post_text(client, srv.url)[0] for _ in range(3)]
            deadline = time.monotonic() + 5
            while True:
                _, exists = asyncio.run(inspect(sids))
                if exists == [False, False, True, True] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert exists == [False, False, True, True]  # max_retained_streams=2: the oldest went
    assert entry_id(0) == "0-1"


def test_bad_event_log_url_is_refused() -> None:
    from multistream.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="redis://"):
        RedisEventLog("http://127.0.0.1:1", ServerSettings())
    assert ServerSettings(event_log="memory").event_log == "memory"


def test_a_follower_reads_again_after_a_late_answer() -> None:
    """A read of the log that times out (this process's event loop was busy past its deadline, a
    model loading, say) is read again, not taken for a Redis outage that ends the reader's stream."""
    from redis.exceptions import TimeoutError as ReadTimeout

    from multistream.events import TextEvent

    sid = "c" * 32
    events = [TextEvent(stream_id=sid, seq=i, t=0.01 * i, delta=f" w{i}", token_ids=[i], index=i,
                        is_final=i == 2, **({"finish_reason": "length", "text": " w0 w1 w2"} if i == 2 else {}))
              for i in range(3)]

    async def run(url: str) -> list[int]:
        log = RedisEventLog(url, ServerSettings(), block_ms=100)
        await log.redis.hset(log.key("m", sid), mapping={"token": "t", "kind": "text", "done": 0, "hb": time.time()})
        await log.redis.xadd(log.key("s", sid), {"j": events[0].to_json(), "f": 0}, id=entry_id(0))
        record = await log.load(sid)
        real, landing = log.redis.xread, events[1:]

        async def xread(*args, **kwargs):  # the first two reads: the event lands, the answer comes too late
            if landing:
                ev = landing.pop(0)
                await log.redis.xadd(log.key("s", sid), {"j": ev.to_json(), "f": int(ev.is_final)}, id=entry_id(ev.seq))
                raise ReadTimeout("Timeout reading from 127.0.0.1")
            return await real(*args, **kwargs)

        log.redis.xread = xread
        seqs = [ev.seq async for ev in record.subscribe(0)]
        await log.close()
        return seqs

    with redis_server() as redis:
        assert asyncio.run(run(redis.url)) == [1, 2]
