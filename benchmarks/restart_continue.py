"""Time from a restart to the first continued event: ``multistream serve --event-log redis://...``
killed (-9) mid-generation, started again on the same Redis and port; a client resumes with
``Last-Event-ID`` as soon as the port answers.

    python benchmarks/restart_continue.py [--rounds 2] [--model scripted|default] [--image]

Needs ``redis-server`` (scripts/setup.sh --test). Prints per round: the new process's start to
its port answering (``/healthz``), restart (process start) to the first continued event, kill to the first continued
event, and whether the whole text arrived with no gap or duplicate. ``--model scripted`` is a fake
model (30 ms a token; the server's own start and the claim dominate); ``--model default`` the
embedded one on its defaults (int4 kernels: one arithmetic makes the re-prefilled continuation
exact), whose load is part of the figure.

``--image`` also runs an image round per round: the embedded image model (CPU, 20 steps, each
denoiser call held 0.1 s longer so the kill lands mid-run), killed after its 5th preview; it
reports the same times, the step the continuation resumed from (its checkpoint), whether the
events came with no duplicate and the final PNG equals an uninterrupted run's, and the
checkpoints' cost on the first server's run (writes, bytes, milliseconds per write).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

from multistream.testing import ScriptedTextModel

WORDS = [f" w{i}" for i in range(200)]


def scripted() -> ScriptedTextModel:
    """The subprocess servers' model (``restart_continue:scripted``)."""
    return ScriptedTextModel(WORDS, delay_s=0.03)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slow_image() -> Any:
    """The image round's model (``restart_continue:slow_image``): the embedded one, each denoiser
    call held 0.1 s longer."""
    import multistream as ms

    model = ms.load_image_model(device="cpu")
    model.pipeline.unet.register_forward_hook(lambda *args: time.sleep(0.1))
    return model


def _serve(redis_url: str, port: int, model: str) -> subprocess.Popen[bytes]:
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])}
    if model == "image":
        return subprocess.Popen([sys.executable, "-m", "multistream", "serve", "--port", str(port), "--no-demo",
                                 "--text-model", "none", "--image-model", "restart_continue:slow_image",
                                 "--event-log", redis_url, "--log-level", "warning"], env=env)
    extra = ["--text-model", "restart_continue:scripted"] if model == "scripted" else []
    return subprocess.Popen([sys.executable, "-m", "multistream", "serve", "--port", str(port), "--no-demo",
                             "--image-model", "none", "--event-log", redis_url, "--log-level", "warning", *extra],
                            env=env)


def _wait(url: str, path: str, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{path} did not answer")


def _sse(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield json.loads(line[5:])


def _kill_and_resume(redis_url: str, model: str, route: str, body: dict[str, Any], client: httpx.Client
                     ) -> tuple[dict[str, Any], list[dict], list[dict], str, subprocess.Popen[bytes]]:
    """A server on a free port, a stream of ``body`` on ``route`` until its 5th event, a kill (-9),
    the same server again, and the client resuming with ``Last-Event-ID`` as soon as the port answers:
    (timings, the events before the kill, those after, the url, the running server)."""
    port = _port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(redis_url, port, model)
    try:
        _wait(url, "/readyz")
        with client.stream("POST", url + route, json=body) as r:
            sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
            first: list[dict] = []
            for ev in _sse(r):
                first.append(ev)
                if len(first) == 5:
                    break
        proc.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        proc.wait(10)
        proc = _serve(redis_url, port, model)
        started = time.perf_counter()
        _wait(url, "/healthz")
        listening = time.perf_counter()
        rest: list[dict] = []
        got_first = None
        with client.stream("GET", f"{url}/v1/streams/{sid}/events",
                           headers={"Last-Event-ID": str(first[-1]["seq"]), "X-Resume-Token": token}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"resume: {r.status_code} {r.read()[:300]!r}")
            for ev in _sse(r):
                rest.append(ev)
                got_first = got_first or time.perf_counter()
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    times = {"listening_s": listening - started, "restart_to_first_s": (got_first or 0) - started,
             "kill_to_first_s": (got_first or 0) - killed}
    return times, first, rest, url, proc


def one_round(redis_url: str, model: str) -> dict[str, float | bool]:
    body = {"prompt": "Tell a long story.", "max_new_tokens": 200 if model == "scripted" else 48, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        times, first, rest, _, proc = _kill_and_resume(redis_url, model, "/v1/text", body, client)
    proc.kill()
    proc.wait(10)
    events = first + rest
    exact = [e["seq"] for e in events] == list(range(len(events))) and \
        "".join(e.get("delta", "") for e in events) == events[-1].get("text")
    return {**times, "exact": exact, "final": events[-1].get("finish_reason")}


def image_round(redis_url: str) -> dict[str, Any]:
    body = {"prompt": "a red circle on a blue background", "steps": 20, "seed": 11, "preview": "x0"}
    with httpx.Client(timeout=300) as client:
        times, first, rest, url, proc = _kill_and_resume(redis_url, "image", "/v1/image", body, client)
        try:
            with client.stream("POST", url + "/v1/image", json=body) as r:  # the uninterrupted run
                whole = list(_sse(r))
        finally:
            proc.kill()
            proc.wait(10)
    events = first + rest
    seqs = [e["seq"] for e in events]
    steps = [e["step"] for e in events[:-1]]
    final, reference = events[-1], whole[-1]
    exact = (seqs == sorted(set(seqs)) and steps == sorted(set(steps)) and final.get("is_final")
             and final.get("data") == reference.get("data"))
    m = reference.get("metrics") or {}
    return {**times, "exact": bool(exact),
            "resumed_from_step": (final.get("metrics") or {}).get("resumed_from_step"),
            "killed_after_step": first[-1]["step"], "steps": body["steps"],
            "checkpoint_writes": m.get("checkpoint_writes"), "checkpoint_bytes": m.get("checkpoint_bytes"),
            "checkpoint_write_ms": m.get("checkpoint_write_ms"), "ms_per_step": m.get("ms_per_step")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="scripted", choices=["scripted", "default"])
    ap.add_argument("--image", action="store_true", help="also an image round per round (the embedded image model)")
    args = ap.parse_args()
    redis = shutil.which("redis-server")
    if redis is None:
        sys.exit("redis-server is not installed (scripts/setup.sh --test)")
    with tempfile.TemporaryDirectory() as tmp:
        rport = _port()
        rproc = subprocess.Popen([redis, "--port", str(rport), "--bind", "127.0.0.1", "--dir", tmp, "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            for i in range(args.rounds):
                r = one_round(f"redis://127.0.0.1:{rport}/0", args.model)
                print(f"round {i}: new process start -> listening {r['listening_s']:.2f} s, restart -> first continued event "
                      f"{r['restart_to_first_s']:.2f} s, kill -> first continued event {r['kill_to_first_s']:.2f} s, "
                      f"complete and exact: {r['exact']} (final: {r['final']})", flush=True)
                if args.image:
                    g = image_round(f"redis://127.0.0.1:{rport}/0")
                    print(f"image round {i}: new process start -> listening {g['listening_s']:.2f} s, restart -> first "
                          f"continued event {g['restart_to_first_s']:.2f} s, kill -> first continued event "
                          f"{g['kill_to_first_s']:.2f} s; killed after step {g['killed_after_step']}/{g['steps']}, "
                          f"resumed from checkpoint step {g['resumed_from_step']}; no duplicate and final PNG equal "
                          f"to an uninterrupted run's: {g['exact']}; checkpoints on an uninterrupted run: "
                          f"{g['checkpoint_writes']:.0f} writes of {g['checkpoint_bytes']:.0f} B, "
                          f"{g['checkpoint_write_ms']:.2f} ms each (off the denoising thread; "
                          f"{g['ms_per_step']:.0f} ms a step)", flush=True)
        finally:
            rproc.terminate()
            rproc.wait(10)


if __name__ == "__main__":
    main()
