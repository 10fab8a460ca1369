"""Exact lookahead over HTTP: ``n`` choices of one chat request, and a generation a restarted server
continues, give with the default ``speculate`` the text, token ids and logprobs of ``speculate=0``.

Everything goes through HTTP (the OpenAI and native routes, ``/metrics``) and the shared fixtures;
the default embedded model drafts from the prompt it is asked to copy.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
from typing import Any

import httpx
import pytest

from lookahead_prompts import COPY
from redis_fixtures import free_port, needs_redis, redis_server
from server_fixtures import iter_events, make_server, serve_subprocess


def _accepted(url: str) -> float:
    """The server's count of accepted draft tokens (vLLM's spec_decode counter)."""
    metrics = httpx.get(url + "/metrics").text
    found = re.search(r'multistream:spec_decode_num_accepted_tokens_total\{kind="text"\} ([0-9.]+)', metrics)
    return float(found.group(1)) if found else 0.0


def _chat(client: httpx.Client, url: str, **body: Any) -> dict[str, Any]:
    r = client.post(url + "/v1/chat/completions", json={"model": "default", "messages": COPY, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _streamed_choices(client: httpx.Client, url: str, **body: Any) -> dict[int, tuple[str, str | None]]:
    """Each choice's streamed text (its deltas joined) and finish reason."""
    out: dict[int, tuple[str, str | None]] = {}
    with client.stream("POST", url + "/v1/chat/completions",
                       json={"model": "default", "messages": COPY, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                text, reason = out.get(choice["index"], ("", None))
                out[choice["index"]] = (text + (choice["delta"].get("content") or ""),
                                        choice.get("finish_reason") or reason)
    return out


@pytest.mark.model
def test_n_choices_over_http_are_exact_with_lookahead(text_model: Any) -> None:
    """Three seeded choices of one chat request (their prompt prefilled once, each row drafting on
    its own): content, logprobs and top alternatives equal those of ``speculate=0``, streamed or
    not, and drafts were accepted."""
    sampled = {"n": 3, "temperature": 0.8, "seed": 11, "max_tokens": 40}
    with make_server(text_model) as srv, httpx.Client(timeout=300) as client:
        off = _chat(client, srv.url, logprobs=True, top_logprobs=2, speculate=0, **sampled)
        before = _accepted(srv.url)
        on = _chat(client, srv.url, logprobs=True, top_logprobs=2, **sampled)  # speculate="auto", the default
        assert _accepted(srv.url) > before  # the copying answers took drafts
        assert [c["index"] for c in on["choices"]] == [0, 1, 2]
        assert on["choices"] == off["choices"]  # message, finish reason, logprob floats: all exact
        assert on["usage"] == off["usage"]
        assert len({c["message"]["content"] for c in on["choices"]}) > 1  # seeded choices differ
        streamed_off = _streamed_choices(client, srv.url, speculate=0, **sampled)
        streamed_on = _streamed_choices(client, srv.url, **sampled)
    assert streamed_on == streamed_off
    assert [streamed_on[i] for i in range(3)] == [(c["message"]["content"], c["finish_reason"]) for c in on["choices"]]


def _serve(redis_url: str, port: int) -> subprocess.Popen[bytes]:
    """A ``multistream serve`` process with the default text model, logging events to Redis."""
    return serve_subprocess(port, "--image-model", "none", "--speech-model", "none", "--video-model", "none",
                            "--event-log", redis_url, wait_s=180)


def _text_and_ids(events: list[dict[str, Any]]) -> tuple[str, list[int]]:
    text = ""
    for ev in events:
        text = text[: ev.get("offset") if ev.get("offset") is not None else len(text)] + ev["delta"]
    return text, [t for ev in events for t in ev.get("token_ids") or []]


@pytest.mark.model
@needs_redis
def test_a_restarted_server_continues_a_lookahead_generation_exactly() -> None:
    """A server is killed (-9) as the first tokens of two copying generations arrive, one with the
    default ``speculate`` and one with ``speculate=0``; a second server on the same Redis continues
    both (prompt and logged tokens re-prefilled, then drafting again). Resumed over SSE, each gives
    the text and token ids of an uninterrupted ``speculate=0`` run, with no gap or duplicate."""
    body = {"prompt": COPY, "max_new_tokens": 64, "temperature": 0}
    with redis_server() as redis:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(redis.url, port)
        try:
            with httpx.Client(timeout=300) as client:
                with client.stream("POST", url + "/v1/text", json={**body, "speculate": 0}) as r:
                    assert r.status_code == 200, r.read()
                    uninterrupted = list(iter_events(r))
                ref_text, ref_ids = _text_and_ids(uninterrupted)
                ref = uninterrupted[-1]
                assert ref["text"] == ref_text and len(ref_ids) > 20
                with contextlib.ExitStack() as opened:
                    # Both submitted before either is read, so they share the first server's batch.
                    started = [opened.enter_context(client.stream("POST", url + "/v1/text", json={**body, **extra}))
                               for extra in ({}, {"speculate": 0})]
                    firsts = []
                    for r in started:
                        assert r.status_code == 200
                        firsts.append((r.headers["x-stream-id"], r.headers["x-resume-token"], [next(iter_events(r))]))
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                proc = _serve(redis.url, port)
                finals = []
                for sid, token, first in firsts:
                    with client.stream("GET", f"{url}/v1/streams/{sid}/events",
                                       headers={"Last-Event-ID": str(first[-1]["seq"]), "X-Resume-Token": token}) as r:
                        assert r.status_code == 200, r.read()
                        events = first + list(iter_events(r))
                    assert [e["seq"] for e in events] == list(range(len(events)))  # no gap, no duplicate
                    final = events[-1]
                    assert final["is_final"] and final["finish_reason"] == ref["finish_reason"]
                    assert _text_and_ids(events) == (ref_text, ref_ids) and final["text"] == ref_text
                    assert final["usage"] == ref["usage"]
                    finals.append(final)
            # The kill came mid-answer: the second server ran only the speculate=0 stream's steps after its
            # logged tokens, fewer than the uninterrupted run's (the default stream shared that batch).
            assert finals[1]["metrics"]["decode_steps"] < ref["metrics"]["decode_steps"]
            # Each continuation kept its own speculate (only a drafting request reports drafts).
            assert "drafted_tokens" in finals[0]["metrics"] and "drafted_tokens" not in finals[1]["metrics"]
        finally:
            proc.kill()
            proc.wait(10)
