"""The HTTP server against a real uvicorn on 127.0.0.1: SSE streaming, resume, grace period,
admission, auth, bad input, content filter, heartbeats, metrics and graceful shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest

from multistream import event_from_dict
from multistream.server import STOP

from repo_paths import ROOT, suite_path
from server_fixtures import (
    SPEECH_AND_VIDEO_OFF,
    ScriptedImageModel,
    ScriptedTextModel,
    iter_events,
    iter_sse,
    make_server,
    wait_until,
)

TOKENS = [f" w{i}" for i in range(12)]


def check_sequence(events: list[dict[str, Any]]) -> None:
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert [e["is_final"] for e in events].count(True) == 1 and events[-1]["is_final"]
    for e in events:
        event_from_dict(e)  # valid wire form
    if events[-1]["type"] == "text":
        assert "".join(e["delta"] for e in events) == events[-1]["text"]


def test_events_arrive_incrementally_with_ids_and_header() -> None:
    model = ScriptedTextModel(TOKENS, delay_s=0.25)
    with make_server(model) as srv, httpx.Client(timeout=30) as client:
        with client.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 8}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            stream_id = r.headers["x-stream-id"]
            raw = []
            for sse in iter_sse(r):
                if "comment" in sse:
                    continue
                if not raw:
                    # The first event is here while the model is still producing the rest.
                    record = srv.state.registry.get(stream_id)
                    assert record is not None and not record.done
                    assert model.active == 1
                raw.append(sse)
    events = [json.loads(s["data"]) for s in raw]
    check_sequence(events)
    assert [s["id"] for s in raw] == [str(e["seq"]) for e in events]
    assert [s["event"] for s in raw] == [e["type"] for e in events]
    assert {e["stream_id"] for e in events} == {stream_id}
    assert events[-1]["finish_reason"] == "length" and events[-1]["text"] == "".join(TOKENS[:8])


def test_image_stream_over_sse() -> None:
    with make_server(image=ScriptedImageModel(steps=5, size=32, delay_s=0.02)) as srv:
        with httpx.stream("POST", srv.url + "/v1/image", json={"prompt": "a red circle", "seed": 1}, timeout=30) as r:
            events = list(iter_events(r))
    check_sequence(events)
    final = event_from_dict(events[-1])
    assert final.mime == "image/png" and final.image.size == (32, 32) and final.finish_reason == "stop"
    assert all(e["mime"] == "image/jpeg" for e in events[:-1]) and len(events) >= 2


def test_image_body_takes_final_quality_and_unscaled_previews() -> None:
    """Every argument of ImageModel.stream that the protocol carries is in the body: a jpeg final at
    final_quality, previews at full size with preview_max_side null."""
    with make_server(image=ScriptedImageModel(steps=3, size=64)) as srv:
        def run(**extra: Any) -> list[dict[str, Any]]:
            body = {"prompt": "a red circle", "seed": 1, "final_format": "jpeg", "preview_max_side": None, **extra}
            with httpx.stream("POST", srv.url + "/v1/image", json=body, timeout=30) as r:
                assert r.status_code == 200, r.read()
                return list(iter_events(r))
        low, high = run(final_quality=10), run(final_quality=95)
    assert low[-1]["mime"] == "image/jpeg" and len(low[-1]["data"]) < len(high[-1]["data"])
    assert all(e["width"] == 64 for e in low[:-1]) and len(low) >= 2


def test_resume_after_dropped_connection_has_no_gap_or_duplicate() -> None:
    model = ScriptedTextModel(TOKENS, delay_s=0.1)
    with make_server(model, grace_period_s=20) as srv, httpx.Client(timeout=30) as client:
        first: list[dict[str, Any]] = []
        with client.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 12}) as r:
            stream_id = r.headers["x-stream-id"]
            token = r.headers["x-resume-token"]
            for ev in iter_events(r):
                first.append(ev)
                if len(first) == 3:
                    break  # drop the connection mid-stream
        client.headers["X-Resume-Token"] = token  # ownership: resuming needs the stream's token
        with client.stream("GET", f"{srv.url}/v1/streams/{stream_id}/events",
                           headers={"Last-Event-ID": str(first[-1]["seq"])}) as r:
            assert r.status_code == 200
            rest = list(iter_events(r))
        check_sequence(first + rest)
        assert rest[-1]["finish_reason"] == "length"  # not cancelled: the reconnect came within the grace period
        # ?after= works too, and a finished stream stays replayable.
        with client.stream("GET", f"{srv.url}/v1/streams/{stream_id}/events?after=-1") as r:
            assert list(iter_events(r)) == first + rest
        assert client.get(f"{srv.url}/v1/streams/{stream_id}/events",
                          headers={"Last-Event-ID": str(rest[-1]["seq"])}).status_code == 204
        # An EventSource reconnects to its original URL (?after=...) and adds Last-Event-ID: it wins.
        with client.stream("GET", f"{srv.url}/v1/streams/{stream_id}/events?after=-1",
                           headers={"Last-Event-ID": str(first[-1]["seq"])}) as r:
            assert list(iter_events(r)) == rest
        missing = client.get(f"{srv.url}/v1/streams/nope/events")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "stream_not_found"
        assert client.get(f"{srv.url}/v1/streams/{stream_id}/events?after=x").status_code == 400


def test_disconnect_cancels_the_model_after_the_grace_period() -> None:
    model = ScriptedTextModel([f" t{i}" for i in range(300)], delay_s=0.05)
    with make_server(model, grace_period_s=0.5) as srv, httpx.Client(timeout=30) as client:
        with client.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 300}) as r:
            stream_id = r.headers["x-stream-id"]
            token = r.headers["x-resume-token"]
            next(iter_events(r))
        wait_until(lambda: model.active == 0, what="the model to be cancelled")
        assert model.finish_reasons == ["cancelled"]
        with client.stream("GET", f"{srv.url}/v1/streams/{stream_id}/events?token={token}") as r:
            events = list(iter_events(r))
        check_sequence(events)
        assert events[-1]["finish_reason"] == "cancelled"
        metrics = client.get(srv.url + "/metrics").text
        assert 'multistream:streams_interrupted_total{kind="text"} 1.0' in metrics
        assert 'multistream:streams_grace_cancelled_total{kind="text"} 1.0' in metrics


def test_a_zero_grace_period_cancels_at_the_disconnect_not_before_the_first_read() -> None:
    # grace_period_s=0 once cancelled every stream as it was made, before its own request could read
    # it (the first-reader wait was the grace period): the answer was an empty "cancelled" final.
    model = ScriptedTextModel([f" t{i}" for i in range(300)], delay_s=0.02)
    with make_server(model, grace_period_s=0) as srv, httpx.Client(timeout=30) as client:
        with client.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 5}) as r:
            events = list(iter_events(r))
        assert events[-1]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 5
        with client.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 300}) as r:
            next(iter_events(r))
        wait_until(lambda: model.active == 0, what="the model to be cancelled")
        assert model.finish_reasons[-1] == "cancelled"


def _post_in_thread(url: str, body: dict[str, Any], out: list[Any]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            out.append((r.status_code, [ev for ev in iter_events(r)] if r.status_code == 200 else r.read()))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_queue_full_gives_429_and_priority_orders_the_queue() -> None:
    model = ScriptedTextModel(TOKENS, delay_s=0.05)
    with make_server(model, text_concurrency=1, queue_size=2) as srv:
        url = srv.url + "/v1/text"
        results: list[Any] = []
        threads = [_post_in_thread(url, {"prompt": "first", "max_new_tokens": 12}, results)]
        wait_until(lambda: model.active == 1, what="the first stream")
        threads.append(_post_in_thread(url, {"prompt": "low", "max_new_tokens": 2}, results))
        wait_until(lambda: srv.state.gates["text"].queued == 1, what="one queued request")
        threads.append(_post_in_thread(url, {"prompt": "high", "max_new_tokens": 2, "priority": 5}, results))
        wait_until(lambda: srv.state.gates["text"].queued == 2, what="two queued requests")
        r = httpx.post(url, json={"prompt": "too many"}, timeout=30)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "queue_full" and "queue is full" in r.json()["error"]["message"]
        for t in threads:
            t.join(60)
        assert [c["prompt"] for c in model.calls] == ["first", "high", "low"]
        assert all(status == 200 for status, _ in results)


def test_api_key_required() -> None:
    with make_server(ScriptedTextModel(TOKENS), api_key="s3cret") as srv, httpx.Client(timeout=30) as client:
        r = client.post(srv.url + "/v1/text", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        assert client.post(srv.url + "/v1/text", json={"prompt": "hi"},
                           headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(srv.url + "/metrics").status_code == 401
        assert client.post(srv.url + "/v1/chat/completions", json={}).json()["error"]["type"] == "authentication_error"
        assert client.get(srv.url + "/healthz").status_code == 200
        with client.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 2},
                           headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status_code == 200
            events = list(iter_events(r))
        check_sequence(events)
        stream_id = events[0]["stream_id"]
        # EventSource cannot send headers: the resume route also takes ?api_key=.
        assert client.get(f"{srv.url}/v1/streams/{stream_id}/events?after=-1&api_key=s3cret").status_code == 200
        assert client.get(f"{srv.url}/v1/streams/{stream_id}/events?after=-1").status_code == 401


BAD_TEXT_REQUESTS = [
    (b"{not json", 400, "invalid_json"),
    (b"", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b"\xff\xfe", 400, "invalid_json"),
    ({"max_new_tokens": 4}, 400, "missing_field"),
    ({"prompt": "hi", "bogus": 1}, 400, "unknown_field"),
    ({"prompt": 42}, 400, "invalid_type"),
    ({"prompt": [{"role": "user"}]}, 400, "invalid_argument"),  # content null is only for tool calls: named
    ({"prompt": "hi", "max_new_tokens": "5"}, 400, "invalid_type"),
    ({"prompt": "hi", "max_new_tokens": True}, 400, "invalid_type"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "invalid_type"),       # (null is valid: the model's default)
    ({"prompt": "hi", "max_new_tokens": 0}, 400, "invalid_argument"),      # caught by the model's own validation
    ({"prompt": "hi", "top_p": 7}, 400, "invalid_argument"),
    ({"prompt": "hi", "max_new_tokens": 10**6}, 400, "limit_exceeded"),
    ({"prompt": "x" * 5000}, 400, "limit_exceeded"),
    ({"prompt": "word " * 900}, 400, "prompt_too_long"),                  # over the model's context window
    ({"prompt": "hi", "stop": [1]}, 400, "invalid_type"),
    ({"prompt": "hi", "priority": 1.5}, 400, "invalid_type"),
]


def test_bad_input_gets_clear_4xx_and_disturbs_no_other_stream() -> None:
    model = ScriptedTextModel([f" t{i}" for i in range(40)], delay_s=0.03, context_length=800)
    image = ScriptedImageModel(steps=2, size=16)
    with make_server(model, image, max_prompt_chars=4800, max_body_bytes=20_000, max_steps=50) as srv, \
            httpx.Client(timeout=30) as client:
        good: list[Any] = []
        bystander = _post_in_thread(srv.url + "/v1/text", {"prompt": "bystander", "max_new_tokens": 40}, good)
        for body, status, kind in BAD_TEXT_REQUESTS:
            if isinstance(body, bytes):
                r = client.post(srv.url + "/v1/text", content=body, headers={"content-type": "application/json"})
            else:
                r = client.post(srv.url + "/v1/text", json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == kind and error["message"], (body, error)
        json_type = {"content-type": "application/json"}  # required on POST (a cross-site form cannot send it)
        huge = client.post(srv.url + "/v1/text", content=b'{"prompt": "' + b"a" * 50_000 + b'"}', headers=json_type)
        assert huge.status_code == 413 and "max_body_bytes" in huge.json()["error"]["message"]

        def chunks() -> Any:
            for _ in range(30):
                yield b" " * 1000  # chunked upload without Content-Length
        assert client.post(srv.url + "/v1/text", content=chunks(), headers=json_type).status_code == 413
        for body, kind in [({"prompt": "p", "steps": 500}, "limit_exceeded"), ({"prompt": "p", "height": 12}, "invalid_argument"),
                           ({"prompt": "p", "preview": "sharp"}, "invalid_argument"), ({"prompt": "p", "guidance_scale": -1}, "invalid_argument"),
                           ({"prompt": "p", "cfg": 1}, "unknown_field")]:
            r = client.post(srv.url + "/v1/image", json=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == kind, (body, r.text)
        assert "at most 50 (max_steps)" in client.post(srv.url + "/v1/image", json={"prompt": "p", "steps": 500}).json()["error"]["message"]
        assert client.get(srv.url + "/v1/nothing").status_code == 404
        bystander.join(60)
        (status, events), = good
        assert status == 200
        check_sequence(events)
        assert events[-1]["finish_reason"] == "length"
        assert client.get(srv.url + "/healthz").json()["ready"] is True


def test_model_failure_ends_stream_with_error_event() -> None:
    with make_server(ScriptedTextModel(TOKENS, fail_after=2)) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hi"}, timeout=30) as r:
            events = list(iter_events(r))
        assert [e["seq"] for e in events] == list(range(len(events)))
        # Internal failures reach the client as a generic message (the details stay in the log).
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "internal_error"
        assert "scripted failure" not in events[-1]["error"]["message"]
        assert events[-1]["stream_id"] in events[-1]["error"]["message"]
        assert 'finish_reason="error"' in httpx.get(srv.url + "/metrics").text


def test_content_filter_redacts_and_stops() -> None:
    def content_filter(text: str, part: str) -> Any:
        if "forbidden" in text:
            return STOP
        return text.replace("secret", "******")

    tokens = [" a", " secret", " b", " forbidden", " c"]
    model = ScriptedTextModel(tokens, delay_s=0.02)
    # No hold-back here, so what came before the STOP is sent (tests/server/test_server_hardening.py has the window).
    with make_server(model, content_filter=content_filter, filter_holdback_chars=0) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hi"}, timeout=30) as r:
            events = list(iter_events(r))
        check_sequence(events)
        assert events[-1]["finish_reason"] == "content_filter"
        assert events[-1]["text"] == " a ****** b"
        # The server wrote this final itself; its usage still counts the prompt.
        assert events[-1]["usage"]["prompt_tokens"] == model.count_tokens("hi") == 1
        wait_until(lambda: model.active == 0, what="the model to stop")
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "say forbidden things"}, timeout=30) as r:
            events = list(iter_events(r))
        assert len(events) == 1 and events[0]["finish_reason"] == "content_filter"
        assert len(model.calls) == 1  # the model never saw that prompt


def test_heartbeat_comments_on_idle_connection_and_metrics() -> None:
    model = ScriptedTextModel(TOKENS, delay_s=0.01, first_delay_s=1.2)
    with make_server(model, heartbeat_s=0.2) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 3}, timeout=30) as r:
            items = list(iter_sse(r))
        assert "comment" in items[0], "a heartbeat comes before the slow first token"
        metrics = httpx.get(srv.url + "/metrics").text
        for name in ("multistream:time_to_first_token_seconds_count", "multistream:inter_token_latency_seconds_bucket",
                     "multistream:queue_time_seconds_bucket",
                     'multistream:requests_finished_total{finish_reason="length",kind="text"} 1.0',
                     "multistream:num_requests_running", "multistream:num_requests_waiting"):
            assert name in metrics, name


def test_healthz_reports_loading_then_ready() -> None:
    gate = threading.Event()

    def factory() -> ScriptedTextModel:
        gate.wait(20)
        return ScriptedTextModel(TOKENS)

    with make_server(factory) as srv:
        health = httpx.get(srv.url + "/healthz").json()
        assert health["ready"] is False and health["models"]["text"]["state"] == "loading"
        r = httpx.post(srv.url + "/v1/text", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "model_loading" and "retry-after" in r.headers
        gate.set()
        wait_until(lambda: httpx.get(srv.url + "/healthz").json()["ready"], what="the model to load")
        assert httpx.post(srv.url + "/v1/image", json={"prompt": "x"}).status_code == 404


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigterm_drains_then_cancels_running_streams() -> None:
    port = _free_port()
    root = ROOT
    env = {**os.environ, "PYTHONPATH": suite_path()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "multistream", "serve", "--port", str(port), "--text-model",
         "server_fixtures:slow_text_model", "--image-model", "none", *SPEECH_AND_VIDEO_OFF, "--shutdown-deadline", "1",
         "--log-level", "warning"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), timeout=60, what="the server subprocess")
        events: list[dict[str, Any]] = []
        with httpx.stream("POST", url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 400}, timeout=60) as r:
            for ev in iter_events(r):
                events.append(ev)
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
                    wait_until(lambda: httpx.get(url + "/healthz").status_code == 503, what="draining")
                    refused = httpx.post(url + "/v1/text", json={"prompt": "late"})
                    assert refused.status_code == 503 and refused.json()["error"]["type"] == "shutting_down"
        check_sequence(events)
        assert events[-1]["finish_reason"] == "cancelled"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    assert "Traceback" not in output, output


def test_a_drain_that_fails_still_stops_the_server(caplog: pytest.LogCaptureFixture) -> None:
    # The drain task calls the runner's stop at its end; a drain that raised never did, and a
    # SIGTERM'd server stayed up with nothing in its log at warning level.
    with make_server(text=ScriptedTextModel(TOKENS, delay_s=0.1)) as srv:
        def broken(reason: str = "cancelled") -> None:
            raise RuntimeError("ending the streams broke")

        srv.state.registry.cancel_all = broken
        stopped = threading.Event()
        srv.state.loop.call_soon_threadsafe(lambda: srv.state.begin_drain(0.0, on_drained=stopped.set))
        assert stopped.wait(10), "the drain never told the server to stop"
        assert srv.state.drained.is_set()
    assert "draining: ending the streams failed; stopping anyway" in caplog.text


def _ready(url: str) -> bool:
    try:
        return bool(httpx.get(url + "/healthz", timeout=2).json()["ready"])
    except httpx.HTTPError:
        return False


@pytest.mark.model
def test_real_default_text_model_through_the_server() -> None:
    import multistream as ms

    llm = ms.load_text_model()
    with make_server(llm) as srv:
        with httpx.stream("POST", srv.url + "/v1/text", timeout=300,
                          json={"prompt": [{"role": "user", "content": "Say hello."}], "max_new_tokens": 12}) as r:
            assert r.status_code == 200
            events = list(iter_events(r))
        check_sequence(events)
        assert events[-1]["finish_reason"] in ("stop", "length") and events[-1]["text"].strip()
        # A second prompt begins with the same chat template: its start comes from the prefix cache,
        # which the final's metrics and /metrics report.
        with httpx.stream("POST", srv.url + "/v1/text", timeout=300,
                          json={"prompt": [{"role": "user", "content": "Say goodbye."}], "max_new_tokens": 4}) as r:
            again = list(iter_events(r))
        cached = again[-1]["metrics"]["cached_prompt_tokens"]
        assert cached >= 20
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'multistream:prefix_cache_hit_tokens_total{{kind="text"}} {float(cached)}' in metrics


def test_server_also_serves_the_demo_page_on_its_models():
    """`multistream serve` mounts the Gradio demo at /demo: one process, API and page."""
    import gradio_client

    from multistream.server import ServerSettings, create_app

    from server_fixtures import live_server

    app = create_app(text_model=ScriptedTextModel(), image_model=ScriptedImageModel(), settings=ServerSettings(),
                     demo_path="/demo")
    with live_server(app) as srv:
        page = httpx.get(srv.url + "/demo/", timeout=30)
        assert page.status_code == 200 and "gradio" in page.text.lower()
        client = gradio_client.Client(srv.url + "/demo/", verbose=False)
        answer = client.predict("hello", [], 32, 0.0, 1.0, -1, api_name="/chat")
        history = answer[0]
        content = history[-1]["content"]
        text = "".join(c.get("text", "") for c in content) if isinstance(content, list) else content
        assert text == "".join(ScriptedTextModel().tokens)
        # the API keeps working beside it
        assert httpx.get(srv.url + "/healthz", timeout=10).status_code == 200
