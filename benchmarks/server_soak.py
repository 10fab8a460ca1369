"""Soak the real server: many streams with random client drops, resumes, cancels and bad bodies
interleaved, against ``multistream serve``-style uvicorn in a subprocess on 127.0.0.1 with the
scripted models. Bounded in count and time; loopback only.

Figures: 5xx responses (must be 0), events lost or duplicated across resumes (must be 0), the
server's RSS at stream 100 and at the end, its open file descriptors at the end.

    $ python benchmarks/server_soak.py --streams 1000 --workers 8 --max-seconds 600
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
SERVER = """
import sys
from multistream.server import ServerSettings, create_app, serve
from multistream.testing import ScriptedImageModel, ScriptedTextModel
text = ScriptedTextModel([f" w{i}" for i in range(40)], delay_s=0.004)
image = ScriptedImageModel(steps=8, size=16, delay_s=0.004)
settings = ServerSettings(grace_period_s=5, text_concurrency=8, image_concurrency=2, queue_size=256,
                          client_concurrency=64, max_retained_streams=128, enable_test_hooks=False)
serve(create_app(text, image, settings=settings), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""

BAD_BODIES: list[bytes] = [
    b"[" * 100_000, b'{"prompt": "hi", "max_new_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "\\ud800"}',
    b'{"prompt": "hi", "temperature": NaN}', b"{not json", b"", b'{"prompt": 5}', b'{"prompt": "x", "bogus": 1}',
    b'{"prompt": [{"role": "user"}]}', b'{"prompt": "hi", "max_new_tokens": 0}',
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line == "" and data:
            out.append(json.loads("\n".join(data)))
            data = []
            if limit is not None and len(out) >= limit:
                break
    return out


class Soak:
    def __init__(self, url: str, pid: int) -> None:
        self.url = url
        self.proc = psutil.Process(pid)
        self.lock = threading.Lock()
        self.statuses: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self.lost = 0
        self.duplicated = 0
        self.done = 0
        self.rss: dict[int, int] = {}
        self.problems: list[str] = []

    def record(self, status: int) -> None:
        with self.lock:
            self.statuses[status] += 1

    def check(self, events: list[dict[str, Any]], what: str) -> None:
        seqs = [e["seq"] for e in events]
        dup = len(seqs) - len(set(seqs))
        text = events and events[-1].get("type") == "text"
        # Text: every seq exactly once. Images: superseded previews may be skipped on a replay,
        # never repeated, and the final frame must be there.
        lost = (max(seqs) + 1 - len(set(seqs))) if (text and seqs) else 0
        final_ok = bool(events) and events[-1]["is_final"] and sum(e["is_final"] for e in events) == 1
        if text and final_ok and events[-1]["type"] == "text":
            if "".join(e["delta"] for e in events) != events[-1]["text"]:
                lost += 1
        with self.lock:
            self.duplicated += dup
            self.lost += lost + (0 if final_ok else 1)
            if dup or lost or not final_ok:
                self.problems.append(f"{what}: seqs {seqs[:60]}")

    def one(self, i: int, client: httpx.Client) -> None:
        rng = random.Random(i)
        roll = rng.random()
        kind = "image" if roll < 0.2 else "text"
        body: dict[str, Any] = ({"prompt": "a red circle", "seed": i} if kind == "image"
                                else {"prompt": f"hi {i}", "max_new_tokens": rng.randint(5, 40)})
        if roll > 0.9:
            raw = rng.choice(BAD_BODIES)
            r = client.post(self.url + "/v1/text", content=raw, headers={"content-type": "application/json"})
            self.record(r.status_code)
            self.kinds["bad_body"] += 1
            if not 400 <= r.status_code < 500:
                self.problems.append(f"bad body {raw[:30]!r} -> {r.status_code}")
            return
        mode = rng.choice(["full", "full", "drop", "drop", "cancel"])
        if roll > 0.8:
            mode = "openai"
        self.kinds[f"{kind}:{mode}"] += 1
        if mode == "openai":
            r = client.post(self.url + "/v1/chat/completions", json={
                "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "user": "soak"})
            self.record(r.status_code)
            return
        with client.stream("POST", f"{self.url}/v1/{kind}", json=body) as r:
            self.record(r.status_code)
            if r.status_code != 200:
                r.read()
                return
            stream_id, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
            first = _events(r, limit=rng.randint(1, 4) if mode in ("drop", "cancel") else None)
        if mode == "full":
            self.check(first, f"full {stream_id}")
            return
        headers = {"X-Resume-Token": token}
        if mode == "cancel":
            r2 = client.delete(f"{self.url}/v1/streams/{stream_id}", headers=headers)
            self.record(r2.status_code)
        if first and first[-1]["is_final"]:
            self.check(first, f"{mode} {stream_id}")
            return
        after = first[-1]["seq"] if first else -1
        with client.stream("GET", f"{self.url}/v1/streams/{stream_id}/events",
                           headers={**headers, "Last-Event-ID": str(after)}) as r:
            self.record(r.status_code)
            rest = _events(r) if r.status_code == 200 else []
            if r.status_code not in (200, 204):
                r.read()
                self.problems.append(f"resume {stream_id} -> {r.status_code}")
        self.check(first + rest, f"{mode} {stream_id}")

    def run(self, n: int, workers: int, max_seconds: float) -> None:
        deadline = time.monotonic() + max_seconds
        counter = iter(range(n))
        counter_lock = threading.Lock()

        def worker() -> None:
            with httpx.Client(timeout=60) as client:
                while time.monotonic() < deadline:
                    with counter_lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    try:
                        self.one(i, client)
                    except httpx.HTTPError as exc:
                        with self.lock:
                            self.problems.append(f"stream {i}: {type(exc).__name__}: {exc}")
                    with self.lock:
                        self.done += 1
                        if self.done in (100, n):
                            self.rss[self.done] = self.proc.memory_info().rss

        with ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(worker) for _ in range(workers)]:
                f.result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=600)
    args = parser.parse_args()
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.1)
        soak = Soak(url, proc.pid)
        started = time.perf_counter()
        soak.run(args.streams, args.workers, args.max_seconds)
        elapsed = time.perf_counter() - started
        time.sleep(1.0)  # let closed connections settle before counting descriptors
        fds = soak.proc.num_fds()
        five_xx = sum(n for status, n in soak.statuses.items() if status >= 500)
        mib = {k: round(v / 2**20, 1) for k, v in soak.rss.items()}
        print(f"streams: {soak.done} in {elapsed:.1f} s with {args.workers} clients")
        print(f"mix: {dict(sorted(soak.kinds.items()))}")
        print(f"statuses: {dict(sorted(soak.statuses.items()))}")
        print(f"5xx: {five_xx}")
        print(f"lost events: {soak.lost}  duplicated events: {soak.duplicated}")
        print(f"server RSS MiB: at 100: {mib.get(100)}  at {args.streams}: {mib.get(args.streams)}")
        print(f"server open file descriptors at the end: {fds}")
        for p in soak.problems[:10]:
            print("problem:", p)
        ok = five_xx == 0 and soak.lost == 0 and soak.duplicated == 0 and soak.done == args.streams
        return 0 if ok else 1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
