"""A server whose model fails to load says so (issue 26, item 3): `multistream serve` exits with status 1
within seconds, the log has the reason and the fix; `--allow-partial` serves the models that loaded and
`/readyz` reports "degraded", naming the failed model and why; a failed model is never "loading"."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from repo_paths import ROOT, suite_path
from server_fixtures import iter_events, make_server, missing_module_model, slow_failing_model, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": suite_path()}
    return subprocess.Popen([sys.executable, "-m", "multistream", "serve", "--port", str(port), "--no-demo", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


def test_serve_exits_with_status_1_when_a_model_fails_to_load() -> None:
    start = time.monotonic()
    proc = _serve(_free_port(), "--text-model", "multistream.testing:ScriptedTextModel",
                  "--image-model", "server_fixtures:missing_module_model")
    try:
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    assert rc == 1, output
    assert time.monotonic() - start < 60
    assert "the image model server_fixtures:missing_module_model failed to load: ModuleNotFoundError: " \
           "No module named 'greenlet'" in output, output
    assert "Fix: install it (pip install greenlet" in output and "--allow-partial" in output, output
    assert "exiting with status 1" in output


def test_exit_status_is_1_while_another_model_is_still_loading() -> None:
    start = time.monotonic()
    # Models load one at a time (text first): the text model fails, the image model is then loading.
    proc = _serve(_free_port(), "--text-model", "server_fixtures:missing_module_model",
                  "--image-model", "server_fixtures:slow_loading_model")
    try:
        rc = proc.wait(25)  # well before the text model's 30 s load ends
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    assert rc == 1, output
    assert time.monotonic() - start < 25


def test_allow_partial_serves_the_models_that_loaded_and_readyz_says_degraded() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, "--allow-partial", "--text-model", "multistream.testing:ScriptedTextModel",
                  "--image-model", "server_fixtures:missing_module_model", "--video-model", "none", "--log-level",
                  "warning")
    try:
        deadline = time.monotonic() + 60
        while (r := _get(url + "/readyz")) is None or r.status_code != 200:
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            assert time.monotonic() < deadline, "the partial server never became ready"
            time.sleep(0.1)
        health = r.json()
        assert health["status"] == "degraded" and health["ready"] is True
        assert health["models"]["text"]["state"] == "ready"
        image = health["models"]["image"]
        assert image["state"] == "failed" and image["error"] == "ModuleNotFoundError"
        assert "No module named 'greenlet'" in image["reason"] and "Fix:" in image["reason"]
        with httpx.stream("POST", url + "/v1/text", json={"prompt": "hi"}, timeout=30) as resp:
            assert resp.status_code == 200
            events = list(iter_events(resp))
        assert events[-1]["is_final"] and events[-1]["finish_reason"]
        refused = httpx.post(url + "/v1/image", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "model_failed"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    assert "serving degraded" in output and "Traceback" in output  # the failed load's traceback, once


def test_allow_partial_still_exits_when_no_model_loaded() -> None:
    proc = _serve(_free_port(), "--allow-partial", "--text-model", "server_fixtures:missing_module_model",
                  "--image-model", "none", "--speech-model", "none", "--video-model", "none")
    try:
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    assert "no model loaded" in output, output


def test_a_failed_model_is_degraded_never_loading() -> None:
    # In process (create_app without the runner): readiness stays 503, the status says why. The
    # load fails when the test says so, after it saw "loading" (a load that failed after a fixed
    # second lost the race to a busy machine's server start).
    import threading

    release = threading.Event()

    def failing_when_released() -> Any:
        release.wait(30)
        raise OSError("no file named model.safetensors in ./nowhere")

    states: list[Any] = []
    with make_server(failing_when_released, image=None) as srv:
        health = httpx.get(srv.url + "/readyz").json()
        states.append((health["status"], health["models"]["text"]["state"]))
        release.set()
        deadline = time.monotonic() + 20
        while True:
            health = httpx.get(srv.url + "/readyz").json()
            states.append((health["status"], health["models"]["text"]["state"]))
            if health["models"]["text"]["state"] == "failed" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        r = httpx.get(srv.url + "/readyz")
        assert r.status_code == 503 and r.json()["status"] == "degraded"
        assert "no file named model.safetensors" in r.json()["models"]["text"]["reason"]
        assert "Fix: check --text-model" in r.json()["models"]["text"]["reason"]
    assert states[0] == ("loading", "loading") and states[-1] == ("degraded", "failed")
    assert all(status != "loading" for status, state in states if state == "failed")


def test_partial_readiness_waits_for_every_model_to_settle() -> None:
    with make_server(slow_failing_model, image=missing_module_model, allow_partial=True) as srv:
        # The image model failed at once while the text one loads: degraded, but not ready until it settles.
        deadline = time.monotonic() + 20
        while srv.state.models["image"].state != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        health = httpx.get(srv.url + "/readyz")
        if srv.state.models["text"].state == "loading":
            assert health.status_code == 503 and health.json()["status"] == "degraded"
        while srv.state.models["text"].state != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.get(srv.url + "/readyz").status_code == 503  # nothing loaded: not ready


def test_models_load_one_at_a_time() -> None:
    # accelerate's init_empty_weights patches torch.nn.Module for the whole process while diffusers
    # loads; a text model built meanwhile in the other thread got meta tensors. Loads are serialized.
    import threading

    from multistream.testing import ScriptedImageModel, ScriptedTextModel

    running: list[str] = []
    overlap: list[bool] = []
    lock = threading.Lock()

    def loader(kind: str, model: Any) -> Any:
        def load() -> Any:
            with lock:
                running.append(kind)
                overlap.append(len(running) > 1)
            time.sleep(0.5)
            with lock:
                running.remove(kind)
            return model
        return load

    with make_server(loader("text", ScriptedTextModel(["x"])), image=loader("image", ScriptedImageModel())) as srv:
        deadline = time.monotonic() + 20
        while httpx.get(srv.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert overlap == [False, False]


# The demo page is built after the server listens (issue 34, item 2): Gradio's import alone took
# 2-8 s, which /healthz, /readyz and the API waited for. The first request to /demo builds it.
_DEMO_AFTER_LISTEN = '''
import sys, threading, httpx
from multistream.server import create_app
from multistream.testing import ScriptedImageModel, ScriptedTextModel
from server_fixtures import live_server

release = threading.Event()

def still_loading():
    release.wait(120)
    return ScriptedTextModel()

app = create_app(text_model=still_loading, image_model=ScriptedImageModel(), demo_path="/demo")
print("gradio after create_app:", "gradio" in sys.modules, flush=True)
with live_server(app) as s:
    health = httpx.get(s.url + "/healthz", timeout=10)
    print("healthz:", health.status_code, "gradio:", "gradio" in sys.modules, flush=True)
    page = httpx.get(s.url + "/demo/", timeout=120)  # the text model still loads: this request builds the page
    print("demo:", page.status_code, "gradio" in page.text.lower(), flush=True)
    release.set()
'''


def test_the_server_listens_before_the_demo_page_is_built_and_the_first_visit_builds_it() -> None:
    env = {**os.environ, "PYTHONPATH": suite_path()}
    done = subprocess.run([sys.executable, "-c", _DEMO_AFTER_LISTEN], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gradio after create_app: False" in done.stdout, done.stdout
    assert "healthz: 200 gradio: False" in done.stdout, done.stdout
    assert "demo: 200 True" in done.stdout, done.stdout


def test_a_deferred_app_that_fails_to_build_answers_503_with_the_cause_and_the_api_keeps_serving() -> None:
    import asyncio
    import contextlib

    from fastapi import FastAPI

    from multistream.server.http.deferred import DeferredApp

    from server_fixtures import live_server

    def build() -> Any:
        raise RuntimeError("no gradio today")

    deferred = DeferredApp(build, name="demo page")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        deferred.attach(asyncio.get_running_loop())
        yield
        await deferred.aclose()

    app = FastAPI(lifespan=lifespan)
    app.get("/ping")(lambda: {"ok": True})
    app.mount("/demo", deferred)
    with live_server(app) as s:
        page = httpx.get(s.url + "/demo/", timeout=30)
        assert page.status_code == 503
        assert "the demo page failed to start (RuntimeError: no gradio today)" in page.json()["error"]["message"]
        assert httpx.get(s.url + "/ping").json() == {"ok": True}


def test_requests_that_arrive_while_a_deferred_app_builds_wait_for_it() -> None:
    import asyncio
    import contextlib
    import threading

    from fastapi import FastAPI
    from starlette.responses import PlainTextResponse

    from multistream.server.http.deferred import DeferredApp

    from server_fixtures import live_server, wait_until

    release = threading.Event()
    builds = []

    def build() -> Any:
        builds.append(1)
        release.wait(60)
        return PlainTextResponse("built"), None

    deferred = DeferredApp(build, name="page")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        deferred.attach(asyncio.get_running_loop())
        deferred.start()
        yield

    app = FastAPI(lifespan=lifespan)
    app.mount("/page", deferred)
    with live_server(app) as s, httpx.Client(timeout=60) as client:
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(client.get, s.url + "/page/") for _ in range(3)]
            wait_until(lambda: builds == [1], what="the build to start")
            assert not any(a.done() for a in answers)  # waiting, not refused
            release.set()
            assert [a.result().text for a in answers] == ["built"] * 3
        assert builds == [1]  # built once


def test_the_first_requests_find_every_route_built_at_start_up(monkeypatch: Any) -> None:
    """FastAPI builds a router's route state (a pydantic adapter per parameter and body) when the
    first request is matched against it: 50-100 ms that the server's first client used to wait
    (the first ``POST /v1/text`` 86-91 ms to its first event against 4-5 ms later; the first
    ``/healthz`` 96-100 ms). The server builds them as it starts (`server.http.warmup`), so the
    first requests of every surface build none."""
    import pydantic

    from multistream.testing import ScriptedTextModel

    built: list[object] = []
    adapter_init = pydantic.TypeAdapter.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(args[0] if args else kwargs.get("type"))
        adapter_init(self, *args, **kwargs)

    with make_server(text=ScriptedTextModel([" a", " b"], delay_s=0)) as server:
        wait_until(lambda: server.app.state.warm_up.done(), what="the start-up warm-up")
        monkeypatch.setattr(pydantic.TypeAdapter, "__init__", counting_init)
        with httpx.stream("POST", server.url + "/v1/text", json={"prompt": "x", "max_new_tokens": 2},
                          timeout=10) as r:
            assert r.status_code == 200
            assert [ev["type"] for ev in iter_events(r)][-1] == "text"
        assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                          json={"model": "default", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
    assert built == [], f"the first requests built {len(built)} adapters: {built[:5]}"


def test_the_demo_page_is_built_unasked_only_once_clients_are_quiet(monkeypatch: Any) -> None:
    """Gradio's import holds the GIL for seconds: built the moment the models were in, it slowed the
    first API requests of a client that waited for /readyz (first tokens 0.6-1.9 s instead of
    30-40 ms on 2 cores). The page is now built unasked only once the models have settled and no
    stream has run for `DEMO_BUILD_QUIET_S` (a visit to /demo still builds it at once)."""
    import threading

    from multistream.server import app as app_module

    monkeypatch.setattr(app_module, "DEMO_BUILD_QUIET_S", 0.05)

    class Page:
        started = False

        def start(self) -> None:
            self.started = True

    class Slot:
        settled = threading.Event()

    page, slot, stop = Page(), Slot(), threading.Event()
    busy, polls = [True], []

    def idle_for(seconds: float) -> bool:
        polls.append(seconds)
        return not busy[0]

    app_module._start_when_settled(page, [slot], idle_for, stop)  # type: ignore[arg-type]
    try:
        slot.settled.set()  # the models are in, and a client's streams run
        wait_until(lambda: len(polls) >= 3, what="the builder to look at the clients a few times")
        assert not page.started, "built while streams ran"
        busy[0] = False  # the client is done
        wait_until(lambda: page.started, what="the page to be built once quiet")
    finally:
        stop.set()


def test_the_registry_says_when_no_stream_has_run_for_a_while() -> None:
    from multistream.testing import ScriptedTextModel

    with make_server(text=ScriptedTextModel([" a", " b", " c"], delay_s=0.2)) as server:
        registry = server.state.registry
        assert registry.idle_for(0.0)
        with httpx.stream("POST", server.url + "/v1/text", json={"prompt": "x", "max_new_tokens": 3}, timeout=10) as r:
            events = iter_events(r)
            next(events)  # the stream runs
            assert not registry.idle_for(0.0)
            assert [ev for ev in events if ev.get("is_final")]
        wait_until(lambda: registry.idle_for(0.0), what="the stream to end")
        assert not registry.idle_for(60.0)  # it ended just now


def _ready_then_stopped(port: int, *args: str) -> str:
    """``multistream serve ARGS`` until /readyz says ready, then SIGTERM: everything it printed."""
    proc = _serve(port, *args)
    try:
        wait_until(lambda: (r := _get(f"http://127.0.0.1:{port}/readyz")) is not None and r.status_code == 200,
                   timeout=60, what="the server to be ready")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.communicate()[0].decode(errors="replace")


def test_serve_logs_each_model_ready_with_its_load_time_in_uvicorns_format() -> None:
    # These INFO lines were dropped (nobody configured the multistream logger): an operator saw
    # "Uvicorn running on ..." and then nothing while the models loaded, and nothing when they had.
    models = ("--text-model", "multistream.testing:ScriptedTextModel", "--image-model", "none",
              "--speech-model", "none", "--video-model", "none")
    output = _ready_then_stopped(_free_port(), *models)
    ready = [line for line in output.splitlines() if "text model" in line and "is ready (loaded in " in line]
    assert len(ready) == 1 and ready[0].startswith("INFO:") and ready[0].rstrip().endswith(" s)"), output
    quiet = _ready_then_stopped(_free_port(), *models, "--log-level", "warning")
    assert "is ready" not in quiet, quiet  # --log-level is the server's, for multistream's lines too


@pytest.mark.model
def test_a_loaded_text_model_is_warmed_up_so_the_first_chat_starts_from_a_cached_system_prompt() -> None:
    """The server warms a text model up once it has loaded (`TextModel.warm_up`): the first user's chat
    request then finds SmolLM2's 30-token system prompt in the prefix cache (0.19 -> 0.04 s to its
    first event, `benchmarks/startup.py`)."""
    import multistream as ms

    with make_server(lambda: ms.load_text_model()) as srv:
        wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, timeout=120)
        with httpx.stream("POST", srv.url + "/v1/text", timeout=120,
                          json={"prompt": [{"role": "user", "content": "Name a colour."}], "max_new_tokens": 2}) as r:
            events = list(iter_events(r))
    assert events[-1]["metrics"]["cached_prompt_tokens"] >= 20


def test_a_warm_up_that_fails_is_logged_and_the_model_still_serves(caplog: pytest.LogCaptureFixture) -> None:
    from multistream.testing import ScriptedTextModel

    class ColdModel(ScriptedTextModel):
        def warm_up(self) -> None:
            raise RuntimeError("no warm-up here")

    with caplog.at_level(logging.WARNING, logger="multistream"), make_server(lambda: ColdModel(["ok"])) as srv:
        wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, timeout=30)
        with httpx.stream("POST", srv.url + "/v1/text", timeout=30, json={"prompt": "hi"}) as r:
            assert r.status_code == 200 and list(iter_events(r))[-1]["is_final"]
    assert any("warming up the ColdModel model failed" in rec.getMessage() for rec in caplog.records)
