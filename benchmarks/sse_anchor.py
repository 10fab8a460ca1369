"""SSE delivery at scale against an anchor: `multistream serve` vs a bare `sse-starlette` app.

The same client code (httpx, N concurrent ``POST /v1/text`` streams, TTFT = request sent -> first
``data:`` line) runs against two servers, each in its own subprocess:

- ``multistream``: `create_app` on a scripted text model (``--tokens`` tokens, ``--delay`` s apart);
- ``anchor``: a bare Starlette + `sse_starlette.EventSourceResponse` route that reads the same JSON
  body and streams the very bytes the scripted model's stream has on the wire (``id:``, ``event:``,
  ``data:`` of each event, recorded once at start), ``--delay`` s apart.

Rounds are interleaved (server order alternates each round) at every client count, so a noisy
machine slows both alike; the report is the median over rounds of each TTFT p50/p95 and of the
per-round ratio multistream / anchor (the target is <= 1.1).

    python benchmarks/sse_anchor.py                          # 10, 50, 200 clients, 5 rounds
    python benchmarks/sse_anchor.py --clients 200 --rounds 3
    python benchmarks/sse_anchor.py --baseline ../base       # + that checkout's server: before/after
    PYTHONPATH=../base python benchmarks/sse_anchor.py       # another checkout's server code only
    python benchmarks/sse_anchor.py --profile prof.out       # cProfile of the server's loop thread

The multistream server's code comes from ``PYTHONPATH`` when set, else from this checkout. Server
CPU per stream (from /proc) is the steadiest figure on a busy machine.

Where the time went (issue 35, profiled with ``--profile``: cProfile on the loop thread's CPU
time, and GC callbacks), 200 clients, before the fixes: h11's pure-Python parsing and writing of
every request and SSE chunk (14% of the loop's CPU; the anchor's uvicorn uses httptools); the
cyclic GC walking start-up's objects (14%, pauses up to 0.1 s); ``model.stream()`` on the loop,
where the scripted fake's ``Thread.start()`` waits for its thread under 200 busy ones (~2 ms of
loop wall time per request); per event ``to_json`` through ``dataclasses.fields`` and a new
JSONEncoder, `ServerSentEvent.encode`'s regex and StringIO, prometheus ``labels()`` lookups;
``inspect.signature`` per request; a worker-thread hop for the sync ``get_principal``
dependency. What is left is FastAPI's routing and dependencies, sse-starlette's task group per
response, and the two hops per event (model thread -> pump task -> subscriber) that a model in
its own threads needs.

The cyclic GC again (issue 35, the round after): with start-up frozen, what a burst's live streams
hold still made young and full collections in the middle of every 200-client round (1.6-1.8 s
over 15 rounds, a full collection of 50-60 ms each); `multistream.server.collector` now runs
them at a moment without a live stream. Switched off altogether (an experiment), the collector's
absence brought 200 clients to 1.0-1.15x; what is left is the server's own work per stream.

The scripted fake ran a thread per stream until issue 35's last round: 200 threads waking every
5 ms fought the loop for the GIL, and that was most of the gap at 200 clients (1.8x p50, 3.2x p95
against 1.2x with ``--model ticker``). It now runs all its streams from one thread
(`multistream.testing._scripted.scheduled_stream`), as the real engine runs its rows, so
``--model scripted`` and ``--model ticker`` measure the same server. What is left at 10 and 50
clients is a fixed cost per request (about 1.4 ms more than the anchor's before the response
starts: FastAPI's routing and dependencies, the body's validation, admission, the model start on
a worker thread), not delivery.

Per event, the round after: 200 in-process streams of 64 tokens (process CPU per delivered event)
cost 79-90 µs against the anchor's 17; the wire JSON was the largest share (a loop of ``getattr``
and a new C encoder per call), now written once per event class (`multistream._event_wire`), and
the record's subscribers wait on futures instead of a new ``asyncio.Event`` per event: 54-57 µs.
What was left per event is the two task hops, the event's construction, the filter and metrics,
and sse-starlette's cancel scope per send (which the anchor pays too). Per stream, sse-starlette
starts four tasks in a task group: with Starlette's plain `StreamingResponse` instead (an
experiment, no heartbeat or send timeout) the server's CPU fell from 2.10-2.15 to 1.75-1.80 ms a
stream. `multistream.server.http.event_stream.EventStream` now writes new native streams and
resumes with one helper task and one timer per connection, heartbeats and the send timeout
included: 200 clients 0.97x/1.03x and 1.01x/0.95x (two runs of 15 rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_load import one_stream, pct  # the same client and percentile as the load test

ROOT = Path(__file__).resolve().parent.parent


def _script(tokens: int) -> list[str]:
    return [f" t{i}" for i in range(tokens)]


class TickerModel:
    """A scripted text model that serves all its streams from ONE thread, as the real engine does.
    `ScriptedTextModel` does too now, but ran a thread per stream before issue 35's last round:
    ``--model ticker`` keeps a ``--baseline`` of such a checkout measuring its server, not 200
    producer threads contending for the GIL."""

    name = "ticker"

    def __init__(self, tokens: list[str], delay: float) -> None:
        import heapq
        import itertools
        import threading

        self.tokens, self.delay = tokens, delay
        self._heap: list[tuple[float, int, object, int]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._push = heapq.heappush
        self._pop = heapq.heappop
        threading.Thread(target=self._loop, daemon=True, name="ticker").start()

    def stream(self, prompt: str, max_new_tokens: int = 32, **_: object) -> object:
        from multistream.stream import Stream

        def submit(writer: object) -> None:
            with self._cond:
                self._push(self._heap, (time.perf_counter() + self.delay, next(self._order), writer, 0))
                self._cond.notify()

        return Stream(submit=submit, kind="text")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.perf_counter():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.perf_counter())
                due = []
                now = time.perf_counter()
                while self._heap and self._heap[0][0] <= now:
                    due.append(self._pop(self._heap))
            for when, _, w, i in due:
                if i < len(self.tokens) and not w.cancelled:  # type: ignore[attr-defined]
                    w.text(self.tokens[i], [i], i)  # type: ignore[attr-defined]
                    with self._cond:
                        self._push(self._heap, (when + self.delay, next(self._order), w, i + 1))
                else:
                    w.finish_text("", [], i, finish_reason="cancelled" if w.cancelled else "length",  # type: ignore[attr-defined]
                                  text="".join(self.tokens[:i]), usage={"prompt_tokens": 1, "completion_tokens": i},
                                  metrics={})


def serve_multistream(port: int, tokens: int, delay: float, profile: str | None, model_kind: str) -> None:
    from multistream.server import ServerSettings, create_app
    from multistream.server import serve as run
    from multistream.testing import ScriptedTextModel

    model: object = (TickerModel(_script(tokens), delay) if model_kind == "ticker"
                     else ScriptedTextModel(_script(tokens), delay_s=delay))
    # All simulated clients share one loopback address: lift the per-address quota; no queueing.
    settings = ServerSettings(text_concurrency=1024, queue_size=1024, heartbeat_s=15, client_concurrency=1024)
    app = create_app(text_model=model, settings=settings)
    _run(app, port, profile, lambda: run(app, host="127.0.0.1", port=port, log_level="warning"))


def serve_anchor(port: int, tokens: int, delay: float, profile: str | None) -> None:
    import uvicorn
    from sse_starlette import EventSourceResponse, ServerSentEvent
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from multistream.testing import ScriptedTextModel

    # The wire bytes of one scripted stream, recorded once: the anchor streams exactly these.
    recorded = [(ev.type, str(ev.seq), ev.to_json())
                for ev in ScriptedTextModel(_script(tokens), delay_s=delay).stream("bench", max_new_tokens=tokens)]

    async def text(request):  # type: ignore[no-untyped-def]
        await request.json()

        async def events():  # type: ignore[no-untyped-def]
            for kind, seq, data in recorded:
                await asyncio.sleep(delay)
                yield ServerSentEvent(data=data, event=kind, id=seq)

        return EventSourceResponse(events(), ping=15, headers={"Cache-Control": "no-store"})

    async def healthz(request):  # type: ignore[no-untyped-def]
        return JSONResponse({"ready": True})

    app = Starlette(routes=[Route("/v1/text", text, methods=["POST"]), Route("/healthz", healthz)])
    _run(app, port, profile, lambda: uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning"))


def _run(app: object, port: int, profile: str | None, start: object) -> None:
    if not profile:
        start()  # type: ignore[operator]
        return
    import cProfile
    import signal

    # The event loop thread's CPU time: what the loop spent, without the waits for the GIL.
    prof = cProfile.Profile(time.thread_time)

    def dump(*_: object) -> None:
        prof.disable()
        prof.dump_stats(profile)
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    prof.enable()
    start()  # type: ignore[operator]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_level(url: str, n: int, tokens: int) -> tuple[float, float, int]:
    """(TTFT p50 ms, p95 ms, events) of ``n`` concurrent streams."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        results = await asyncio.gather(*(one_stream(client, url, tokens) for _ in range(n)))
    ttfts = [r[0] * 1000 for r in results]
    return pct(ttfts, 0.5), pct(ttfts, 0.95), sum(r[1] for r in results)


def start_server(which: str, tokens: int, delay: float, profile: str | None, model: str = "scripted",
                 code: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """The ``which`` server ("multistream" or "anchor") in a subprocess, the multistream code
    from ``code`` (a checkout's root) or this one; returns it once ``/healthz`` says ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve", which, "--port", str(port), "--tokens", str(tokens),
           "--delay", str(delay), "--model", model]
    if profile:
        cmd += ["--profile", profile]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": code or str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=2).json()["ready"]:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"the {which} server did not start")
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], profile: bool) -> None:
    import signal

    proc.send_signal(signal.SIGUSR1 if profile else signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 50, 200])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    ap.add_argument("--delay", type=float, default=0.005, help="seconds per token")
    ap.add_argument("--model", choices=["scripted", "ticker"], default="scripted",
                    help="scripted: ScriptedTextModel (all its streams on one thread; a thread each in checkouts "
                         "before issue 35's last round); ticker: this file's one-thread model, the same in any "
                         "checkout (for --baseline of an older one)")
    ap.add_argument("--baseline", metavar="CHECKOUT",
                    help="also run the multistream server of this checkout (e.g. a git worktree of an earlier commit), interleaved: before/after")
    ap.add_argument("--profile", help="cProfile the multistream server's loop thread into this file (skews its figures)")
    ap.add_argument("--serve", choices=["multistream", "anchor"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve == "multistream":
        serve_multistream(args.port, args.tokens, args.delay, args.profile, args.model)
        return
    if args.serve == "anchor":
        serve_anchor(args.port, args.tokens, args.delay, None)
        return

    code = os.environ.get("PYTHONPATH") or str(ROOT)
    servers = {"multistream": start_server("multistream", args.tokens, args.delay, args.profile, args.model, code)}
    if args.baseline:
        servers["baseline"] = start_server("multistream", args.tokens, args.delay, None, args.model, args.baseline)
    servers["anchor"] = start_server("anchor", args.tokens, args.delay, None)
    names = list(servers)
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    counts: dict[str, list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    med = statistics.median
    try:
        print(f"uptime: {os.popen('uptime').read().strip()}")
        print(f"multistream: {code}" + (f"; baseline: {args.baseline}" if args.baseline else "") +
              f"; {os.cpu_count()} CPUs; {args.model} model, {args.tokens} tokens x {args.delay * 1000:g} ms; "
              f"{args.rounds} interleaved rounds")
        for _, url in servers.values():
            asyncio.run(run_level(url, 10, args.tokens))  # warm-up
        for r in range(args.rounds):
            for n in args.clients:
                shift = (r + n) % len(names)
                for which in names[shift:] + names[:shift]:  # each server goes first in turn
                    proc, url = servers[which]
                    before = cpu_s(proc.pid)
                    p50, p95, events = asyncio.run(run_level(url, n, args.tokens))
                    results.setdefault((which, n), []).append((p50, p95))
                    cpu.setdefault((which, n), []).append((cpu_s(proc.pid) - before) / n * 1000)
                    counts.setdefault(which, []).append(events / n)
        print("median over rounds; ratio = the median of each round's server / anchor ratio; CPU = server "
              "process CPU ms per stream")
        print(f"{'clients':>7} {'server':>12} {'TTFT p50 ms':>12} {'p95 ms':>8} {'ratio p50':>10} {'p95':>6} {'CPU ms':>7}")
        for n in args.clients:
            an = results[("anchor", n)]
            for which in names:
                mine = results[(which, n)]
                r50 = med(a[0] / b[0] for a, b in zip(mine, an))
                r95 = med(a[1] / b[1] for a, b in zip(mine, an))
                print(f"{n:>7} {which:>12} {med(x[0] for x in mine):>12.1f} {med(x[1] for x in mine):>8.1f} "
                      f"{r50:>9.2f}x {r95:>5.2f}x {med(cpu[(which, n)]):>7.2f}")
        print("events per stream (text deltas merge when a reader lags): "
              + ", ".join(f"{k} {statistics.mean(v):.1f}" for k, v in counts.items()))
        print(f"uptime: {os.popen('uptime').read().strip()}")
    finally:
        for which, (proc, _) in servers.items():
            stop(proc, bool(args.profile) and which == "multistream")


if __name__ == "__main__":
    main()
