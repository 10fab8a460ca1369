"""A restart continues what was running: real ``multistream serve`` subprocesses on a real
``redis-server``; the first is killed (-9) mid-generation, a second starts on the same Redis and
port, and clients resuming with ``Last-Event-ID`` (native SSE) or ``starting_after`` (a background
Responses stream) get the rest: no gap, no duplicate, the text of an uninterrupted run. The
scripted model (no native resume: the regenerated part is trimmed, as on a Ray replica) keeps the
machinery fast; the default embedded model (int4 on the native kernels: one arithmetic for decode and
re-prefill) shows greedy text equal to an uninterrupted run after a re-prefill of prompt + logged tokens."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import Any

import httpx
import openai
import pytest

from redis_fixtures import free_port, needs_redis, redis_server
from server_fixtures import SPEECH_AND_VIDEO_OFF, ScriptedTextModel, iter_events, serve_subprocess, wait_until

pytestmark = needs_redis

WORDS = [f" w{i}" for i in range(50)]


def restart_text_model() -> ScriptedTextModel:
    """Factory for the subprocess servers: 50 tokens, 60 ms apart (3 s in all)."""
    return ScriptedTextModel(WORDS, delay_s=0.06)


def _serve(redis_url: str, port: int, *extra: str, model: str = "test_restart:restart_text_model",
           wait_s: float = 60) -> subprocess.Popen[bytes]:
    return serve_subprocess(port, "--text-model", model, "--image-model", "none", *SPEECH_AND_VIDEO_OFF,
                            "--event-log", redis_url, *extra,
                            wait_s=wait_s)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def _first(client: httpx.Client, url: str, body: dict[str, Any], n: int) -> tuple[str, str, list[dict[str, Any]]]:
    with client.stream("POST", f"{url}/v1/text", json=body) as r:
        assert r.status_code == 200
        sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
        events = []
        for ev in iter_events(r):
            events.append(ev)
            if len(events) == n:
                break
    return sid, token, events


def _rest(client: httpx.Client, url: str, sid: str, token: str, last: int) -> list[dict[str, Any]]:
    with client.stream("GET", f"{url}/v1/streams/{sid}/events",
                       headers={"Last-Event-ID": str(last), "X-Resume-Token": token}) as r:
        assert r.status_code == 200, r.read()
        return list(iter_events(r))


def test_killed_server_native_sse_and_background_response_continue() -> None:
    with redis_server() as redis:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(redis.url, port)
        try:
            with httpx.Client(timeout=30) as client:
                oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
                bg = oa.responses.create(model="default", input="hi", background=True, max_output_tokens=50)
                sid, token, first = _first(client, url, {"prompt": "hi", "max_new_tokens": 50}, 5)
                # Kill mid-answer: the background response has words in the log too.
                wait_until(lambda: oa.responses.retrieve(bg.id).output_text, what="the background response's words")
                _kill(proc)
                killed_at = time.monotonic()
                proc = _serve(redis.url, port)
                rest = _rest(client, url, sid, token, first[-1]["seq"])
                events = first + rest
                assert [e["seq"] for e in events] == list(range(len(events)))  # no gap, no duplicate
                assert all(a["t"] <= b["t"] for a, b in zip(events, events[1:]))
                assert events[-1]["is_final"] and events[-1]["finish_reason"] == "length"
                assert "".join(e["delta"] for e in events) == events[-1]["text"] == "".join(WORDS)
                assert time.monotonic() - killed_at < 30
                # The background response: its typed events after N, then live, to the end.
                with oa.responses.retrieve(bg.id, stream=True, starting_after=4) as tail:
                    typed = list(tail)
                assert [e.sequence_number for e in typed] == list(range(5, 5 + len(typed)))
                assert typed[-1].type == "response.incomplete"
                assert typed[-1].response.output_text == "".join(WORDS)
                full = list(oa.responses.retrieve(bg.id, stream=True))
                deltas = "".join(e.delta for e in full if e.type == "response.output_text.delta")
                assert deltas == "".join(WORDS)
        finally:
            proc.kill()
            proc.wait(10)


def test_a_generation_that_keeps_killing_its_server_ends_with_an_error() -> None:
    """An orphan (its process gone) already continued MAX_RESTARTS times is not continued again:
    the next server ends it in the log with an error event, which resuming readers get."""
    import asyncio

    from multistream.server import ServerSettings
    from multistream.server.durable.continuation import MAX_RESTARTS
    from multistream.server.durable.event_log import RedisEventLog, entry_id

    from server_fixtures import make_server

    sid, token = "f" * 32, "tok"
    first = {"type": "text", "stream_id": sid, "seq": 0, "t": 0.0, "is_final": False, "delta": " w0",
             "token_ids": [0], "index": 0}

    async def orphan(url: str) -> None:
        log = RedisEventLog(url, ServerSettings())
        await log.redis.hset(log.key("m", sid), mapping={
            "token": token, "owner": "", "proc": "gone", "keyed": 0, "kind": "text", "model": "default", "resumable": 1,
            "created": time.time(), "done": 0, "hb": time.time(), "restarts": MAX_RESTARTS,
            "req": json.dumps({"prompt": "hi", "max_new_tokens": 50})})
        await log.redis.xadd(log.key("s", sid), {"j": json.dumps(first), "f": 0}, id=entry_id(0))
        await log.redis.sadd(log.key("live"), sid)
        await log.close()

    with redis_server() as redis:
        asyncio.run(orphan(redis.url))
        with make_server(restart_text_model(), event_log=redis.url) as srv, httpx.Client(timeout=30) as client:
            deadline = time.monotonic() + 10
            while sid not in srv.app.state.continuer.ended and time.monotonic() < deadline:
                time.sleep(0.1)
            rest = _rest(client, srv.url, sid, token, 0)
            assert [e["seq"] for e in rest] == [1]
            assert rest[-1]["type"] == "error" and rest[-1]["error"]["type"] == "generation_lost"
            assert srv.app.state.continuer.continued == []


@pytest.mark.model
def test_continuing_logged_tokens_equals_an_uninterrupted_run(text_model) -> None:  # type: ignore[no-untyped-def]
    """What a restarted server runs for an orphan (`continuation_stream`: the prompt and the logged
    tokens re-prefilled, then decoding on), on the embedded model: greedy text and token ids equal
    to an uninterrupted run, on the default model."""
    import asyncio

    from multistream.server.durable.continuation import continuation_stream

    llm = text_model
    kwargs = {"prompt": [{"role": "user", "content": "Write one sentence about the sea."}], "max_new_tokens": 16,
              "temperature": 0}
    reference = [ev for ev in llm.stream(**kwargs)]
    logged = []
    with llm.stream(**kwargs) as cut:
        for ev in cut:
            logged.append(ev)
            if len(logged) == 5:
                break

    async def rest() -> list[Any]:
        return [ev async for ev in await continuation_stream(llm, kwargs, logged, cut.stream_id)]

    continued = asyncio.run(rest())
    final, ref = continued[-1], reference[-1]
    assert final.text == ref.text and final.finish_reason == ref.finish_reason
    assert "".join(ev.delta for ev in logged + continued) == ref.text
    ids = [t for ev in logged + continued for t in ev.token_ids]
    assert ids == [t for ev in reference for t in ev.token_ids]
    assert continued[0].index == sum(len(ev.token_ids) for ev in logged)
    assert continued[0].offset == sum(len(ev.delta) for ev in logged)
