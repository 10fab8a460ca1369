"""Load test of `multistream serve` over loopback: N concurrent SSE clients on a fast scripted model.

Reports events/s, TTFT p50/p95 over the network vs in-process, and the server's RSS while it
serves 1,000 more streams (it must stay flat: finished streams are retained in bounded memory).

    python benchmarks/server_load.py                  # N = 10, 50, 200
    python benchmarks/server_load.py --clients 10 50 --tokens 64 --delay 0.002
    python benchmarks/server_load.py --default-model --clients 4    # the real embedded text model

The server runs in a subprocess (this file with --serve), so client and server do not share a GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def serve(port: int, tokens: int, delay: float, default_model: bool) -> None:
    sys.path.insert(0, str(ROOT))
    from multistream.server import ServerSettings, create_app, serve as run
    from multistream.testing import ScriptedTextModel

    model: object = "default" if default_model else ScriptedTextModel([f" t{i}" for i in range(tokens)], delay_s=delay)
    # The real model: admission follows its engine (max_batch); the scripted one: effectively unbounded.
    # All simulated clients share one loopback address: lift the per-address quota.
    settings = ServerSettings(text_concurrency=None if default_model else 512, queue_size=1024, heartbeat_s=15,
                              client_concurrency=1024)
    run(create_app(text_model=model, settings=settings), host="127.0.0.1", port=port, log_level="warning")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


async def one_stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, number of events) for one SSE stream, parsed incrementally."""
    t0 = time.perf_counter()
    ttft = -1.0
    events = 0
    async with client.stream("POST", url + "/v1/text", json={"prompt": "bench", "max_new_tokens": max_tokens}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events += 1
                if ttft < 0:
                    ttft = time.perf_counter() - t0
                if '"is_final":true' in line:
                    break
    return ttft, events


async def run_level(url: str, n: int, max_tokens: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, max_tokens) for _ in range(n)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] * 1000 for r in results]
    events = sum(r[1] for r in results)
    return {"clients": n, "events": events, "wall_s": wall, "events_per_s": events / wall,
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p95_ms": pct(ttfts, 0.95)}


def in_process_ttft(tokens: int, delay: float, max_tokens: int, runs: int = 30) -> tuple[float, float]:
    sys.path.insert(0, str(ROOT))
    from multistream.testing import ScriptedTextModel

    model = ScriptedTextModel([f" t{i}" for i in range(tokens)], delay_s=delay)
    ttfts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        stream = model.stream("bench", max_new_tokens=max_tokens)
        for ev in stream:
            ttfts.append((time.perf_counter() - t0) * 1000)
            break
        stream.close()
    return pct(ttfts, 0.5), pct(ttfts, 0.95)


async def memory_run(url: str, pid: int, total: int, concurrency: int, max_tokens: int) -> list[tuple[int, int]]:
    samples = [(0, rss_kib(pid))]
    done = 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        while done < total:
            await asyncio.gather(*(one_stream(client, url, max_tokens) for _ in range(concurrency)))
            done += concurrency
            if done % 200 == 0:
                samples.append((done, rss_kib(pid)))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 50, 200])
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    ap.add_argument("--delay", type=float, default=0.005, help="seconds per token of the scripted model")
    ap.add_argument("--memory-streams", type=int, default=1000)
    ap.add_argument("--default-model", action="store_true", help="use the real embedded text model")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.tokens, args.delay, args.default_model)
        return

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve", str(port), "--tokens", str(args.tokens), "--delay", str(args.delay)]
    if args.default_model:
        cmd.append("--default-model")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).json()["ready"]:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        model = "default text model" if args.default_model else f"scripted model, {args.tokens} tokens x {args.delay * 1000:g} ms"
        print(f"multistream server load test ({model}); {os.cpu_count()} CPUs; loopback SSE")
        asyncio.run(run_level(url, 5, args.tokens))  # warm-up
        print(f"{'clients':>8} {'events':>8} {'wall s':>8} {'events/s':>10} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12}")
        for n in args.clients:
            r = asyncio.run(run_level(url, n, args.tokens))
            print(f"{r['clients']:>8} {r['events']:>8} {r['wall_s']:>8.2f} {r['events_per_s']:>10.0f} "
                  f"{r['ttft_p50_ms']:>12.1f} {r['ttft_p95_ms']:>12.1f}")
        if not args.default_model:
            p50, p95 = in_process_ttft(args.tokens, args.delay, args.tokens)
            print(f"in-process TTFT (same model, no network): p50 {p50:.1f} ms, p95 {p95:.1f} ms")
            samples = asyncio.run(memory_run(url, proc.pid, args.memory_streams, 20, args.tokens))
            print("server RSS over streams served: " + ", ".join(f"{n}: {kib / 1024:.1f} MiB" for n, kib in samples))
            growth = (samples[-1][1] - samples[1][1]) / 1024 if len(samples) > 2 else 0.0
            print(f"RSS growth from stream 200 to {samples[-1][0]}: {growth:+.1f} MiB "
                  f"(retained streams are bounded by max_retained_streams/bytes)")
        metrics = httpx.get(url + "/metrics").text
        finished = [ln for ln in metrics.splitlines() if ln.startswith("multistream:requests_finished_total")]
        print("server metrics: " + "; ".join(finished))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
