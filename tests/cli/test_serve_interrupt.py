"""Ctrl-C on ``multistream serve``: the first one says what it waits for, the second stops at once.

A user's first Ctrl-C, with a video job running, waited silently for the drain deadline; the second
printed uvicorn's CancelledError tracebacks and exited 0. Each test runs a real server process on
the scripted text model (`server_fixtures.slow_text_model`: 400 tokens, 20 s).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from repo_paths import suite_path
from server_fixtures import SPEECH_AND_VIDEO_OFF, iter_events, wait_until

pytest.importorskip("uvicorn")

NOTICE = ("multistream serve: stopping; waiting up to 20 s for 1 running stream to finish "
          "(Ctrl-C again to stop now)")


class _Server:
    """A ``multistream serve`` process whose output lines are collected as they come."""

    def __init__(self, model: str = "server_fixtures:slow_text_model", *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        # SIGINT as at a terminal: a suite started in the background has it ignored, and a child
        # started so keeps ignoring it (see tests/cli/test_cli_checks.py).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "multistream", "serve", "--port", self.url.rsplit(":", 1)[1], "--no-demo",
             "--text-model", model, "--image-model", "none", *SPEECH_AND_VIDEO_OFF,
             "--shutdown-deadline", "20", "--log-level", "warning", *flags],
            env={**os.environ, "PYTHONPATH": suite_path()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(f, lines), daemon=True)
                         for f, lines in ((self.proc.stderr, self.stderr), (self.proc.stdout, self.stdout))]
        for reader in self._readers:
            reader.start()
        wait_until(self._ready, timeout=60, what="the server to be ready")

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "\n".join(self.stderr)
        try:
            return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def exit_status(self, within_s: float) -> int:
        code = self.proc.wait(within_s)
        for reader in self._readers:
            reader.join(5)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.stderr + self.stdout)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def _start_stream(url: str) -> tuple[list[dict[str, Any]], threading.Thread]:
    """A text stream read in a thread; returns its events so far (a growing list) and the thread."""
    events: list[dict[str, Any]] = []

    def read() -> None:
        try:
            with httpx.stream("POST", url + "/v1/text", json={"prompt": "hi", "max_new_tokens": 400},
                              timeout=60) as r:
                events.extend(iter_events(r))
        except httpx.HTTPError:  # a forced exit may cut the response; the tests check what came
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: len(events) >= 2, what="the stream's first events")
    return events, reader


def test_the_first_ctrl_c_says_what_it_waits_for_and_the_second_stops_quietly(server: _Server) -> None:
    events, reader = _start_stream(server.url)
    server.interrupt()
    wait_until(lambda: NOTICE in server.stderr, what="the notice on stderr")
    assert not any(ev.get("is_final") for ev in events)  # said while the stream still runs
    assert reader.is_alive()

    server.interrupt()
    start = time.monotonic()
    code = server.exit_status(within_s=10)
    assert time.monotonic() - start < 5  # not the 20 s deadline, nor uvicorn's graceful 5 s
    assert code == 130, server.output
    reader.join(5)
    assert events[-1]["is_final"] and events[-1]["finish_reason"] == "cancelled"  # the client is told
    assert server.stderr == [NOTICE, "multistream serve: stopping now; 1 running stream cancelled"], server.output
    assert "Traceback" not in server.output and "CancelledError" not in server.output


def test_ctrl_c_pressed_several_times_at_once_stops_quietly(server: _Server) -> None:
    # The third signal is uvicorn's force exit (no wait for connections, no app shutdown): what it
    # cancels must not print tracebacks either.
    _start_stream(server.url)
    for _ in range(4):
        server.interrupt()
        time.sleep(0.02)  # separate signals, not one coalesced pending signal
    assert server.exit_status(within_s=10) == 130, server.output
    assert "Traceback" not in server.output and "CancelledError" not in server.output
    assert len(server.stderr) <= 2, server.output


def test_ctrl_c_with_no_stream_running_stops_at_once_with_nothing_to_say(server: _Server) -> None:
    server.interrupt()
    assert server.exit_status(within_s=10) == 0, server.output
    assert server.stderr == [], server.output


def model_with_a_thread_that_never_ends() -> Any:
    """Factory for the server below: the scripted text model, and a thread (not a daemon) that never
    ends, as a library's teardown that hangs would: the interpreter's exit waits for it forever."""
    from multistream.testing import ScriptedTextModel

    threading.Thread(target=threading.Event().wait, name="never-ending", daemon=False).start()
    return ScriptedTextModel()


def test_a_shutdown_that_never_ends_exits_anyway_and_says_where_it_is_stuck() -> None:
    srv = _Server("test_serve_interrupt:model_with_a_thread_that_never_ends", "--shutdown-stall-s", "1")
    try:
        srv.proc.send_signal(signal.SIGTERM)
        # Without the watch the process waits for its thread forever (measured: still running after 60 s).
        assert srv.exit_status(within_s=30) == 0, srv.output
        assert "the shutdown is still under way 1 s after the streams were drained (threads still running " \
               "besides the main one: never-ending); exiting anyway" in srv.output, srv.output
        assert "most recent call first" in srv.output  # every thread's stack follows
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
