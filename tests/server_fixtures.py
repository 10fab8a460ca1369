"""Shared helpers for server tests: a real uvicorn on 127.0.0.1 (free port) in a thread, and an
incremental SSE reader over httpx streaming (test clients that buffer bodies would hide streaming)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from multistream.server import ServerSettings, create_app, uvicorn_config
from multistream.testing import ScriptedImageModel, ScriptedTextModel

from repo_paths import suite_path


@dataclass
class LiveServer:
    url: str
    app: Any
    server: uvicorn.Server

    @property
    def state(self) -> Any:
        return self.app.state.multistream

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://")


@contextlib.contextmanager
def live_server(app: Any) -> Iterator[LiveServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def make_server(text: Any = None, image: Any = None, **settings: Any) -> contextlib.AbstractContextManager[LiveServer]:
    content_filter = settings.pop("content_filter", None)
    app = create_app(text_model=text, image_model=image, settings=ServerSettings(**settings),
                     content_filter=content_filter)
    return live_server(app)


# Flags that keep a `multistream serve` subprocess from loading the families a test does not use:
# speech and video are served by default when installed, and loading them (diffusers' import, the
# voice) is most of such a server's start-up.
SPEECH_AND_VIDEO_OFF = ("--speech-model", "none", "--video-model", "none")


def serve_subprocess(port: int, *args: str, wait_s: float = 60) -> subprocess.Popen[bytes]:
    """A real ``multistream serve`` process on 127.0.0.1:``port`` running this checkout's code (and
    able to import the tests' model factories), returned once ``/readyz`` answers 200."""
    env = {**os.environ, "PYTHONPATH": suite_path()}
    proc = subprocess.Popen([sys.executable, "-m", "multistream", "serve", "--port", str(port), "--no-demo",
                             "--log-level", "warning", *args], env=env)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "the server exited"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def wait_until(predicate: Any, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it is true (a test waits for a condition, never for a fixed time)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def iter_sse(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """Parse SSE incrementally: yields {"id", "event", "data", "comment"} per event or comment."""
    fields: dict[str, Any] = {}
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if data or fields:
                yield {**fields, "data": "\n".join(data)}
            fields, data = {}, []
            continue
        if line.startswith(":"):
            yield {"comment": line[1:].strip()}
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        else:
            fields[name] = value
    if data:
        yield {**fields, "data": "\n".join(data)}


def iter_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """Wire events (dicts) from an SSE response, skipping comments."""
    for sse in iter_sse(response):
        if "comment" in sse:
            continue
        yield json.loads(sse["data"])


__all__ = ["LiveServer", "ScriptedImageModel", "ScriptedTextModel", "iter_events", "iter_sse", "live_server",
           "make_server"]


def slow_text_model() -> ScriptedTextModel:
    """Factory for `multistream serve --text-model server_fixtures:slow_text_model` in subprocess tests."""
    return ScriptedTextModel([f" t{i}" for i in range(400)], delay_s=0.05)


def missing_module_model() -> ScriptedTextModel:
    """Factory that fails as a fresh install without greenlet did: `--image-model server_fixtures:missing_module_model`."""
    raise ModuleNotFoundError("No module named 'greenlet'", name="greenlet")


def slow_failing_model() -> ScriptedTextModel:
    """Factory that fails after a second of loading (the state goes loading -> failed, never back)."""
    time.sleep(1.0)
    raise OSError("no file named model.safetensors in ./nowhere")


def slow_loading_model() -> ScriptedTextModel:
    """Factory still loading when the other model has failed (the server must still exit with 1)."""
    time.sleep(30)
    return ScriptedTextModel(["late"])
