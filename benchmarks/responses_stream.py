"""Responses streaming overhead against ``/v1/chat/completions`` for the same generation.

A real uvicorn on 127.0.0.1 in this process; interleaved rounds (machine noise hits both alike) of
one streamed request each, read incrementally with httpx; medians over the rounds. The default
model is the scripted fake with no delay, so what is measured is the server's own cost per token
(event log, typed event folding, JSON, SSE); ``--model default`` runs the embedded model instead
(greedy, the same prompt and token count on both routes).

    python benchmarks/responses_stream.py [--tokens 512] [--rounds 7] [--model scripted|default] [--event-log URL]

Prints per route: wall time per request, this process's CPU time (server and client) per request
and per text delta, SSE bytes per delta, time to the first text delta; and the Responses/chat ratios.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from typing import Any

import httpx
import uvicorn

from multistream.server import ServerSettings, create_app, uvicorn_config
from multistream.testing import ScriptedTextModel


def _serve(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def one(client: httpx.Client, url: str, route: str, n: int) -> tuple[float, float, int, int, float]:
    """(seconds, seconds to the first delta, SSE bytes, text deltas, CPU seconds of this process:
    server and client) of one streamed request."""
    if route == "chat":
        path, body = "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Tell a story"}],
                                              "max_tokens": n, "stream": True, "temperature": 0}
        marker = '"content":"'
    else:
        path, body = "/v1/responses", {"model": "default", "input": "Tell a story", "max_output_tokens": n, "stream": True,
                                       "temperature": 0}
        marker = '"response.output_text.delta"'
    start, cpu = time.perf_counter(), time.process_time()
    first = None
    size = deltas = 0
    with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{path}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            size += len(line) + 1
            if line.startswith("data:") and marker in line and '"content":""' not in line:  # not chat's role chunk
                deltas += 1
                if first is None:
                    first = time.perf_counter() - start
    return time.perf_counter() - start, first or 0.0, size, deltas, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default="scripted", help="scripted (server cost only) or default (the embedded model)")
    ap.add_argument("--event-log", default=None, help="redis://HOST:PORT/DB: with the shared log (events go out once "
                    "logged)")
    args = ap.parse_args()
    if args.model == "scripted":
        # 2 ms a token: each token its own event (with no delay a reader that lags gets merged deltas).
        model: Any = ScriptedTextModel([f" w{i}" for i in range(args.tokens)], delay_s=0.002)
    else:
        import multistream as ms

        model = ms.load_text_model(None if args.model == "default" else args.model)
    app = create_app(text_model=model, settings=ServerSettings(max_new_tokens=max(4096, args.tokens),
                                                                     event_log=args.event_log))
    url, server, thread = _serve(app)
    results: dict[str, list[tuple[float, float, int, int, float]]] = {"chat": [], "responses": []}
    with httpx.Client(timeout=600) as client:
        for route in results:  # warm up both
            one(client, url, route, min(args.tokens, 16))
        for _ in range(args.rounds):
            for route in results:
                results[route].append(one(client, url, route, args.tokens))
    server.should_exit = True
    thread.join(10)
    print(f"model={args.model} tokens={args.tokens} rounds={args.rounds} event_log={args.event_log} (medians)")
    med: dict[str, dict[str, float]] = {}
    for route, rows in results.items():
        wall = statistics.median(r[0] for r in rows)
        deltas = statistics.median(r[3] for r in rows)
        cpu = statistics.median(r[4] for r in rows)
        med[route] = {"wall": wall, "first": statistics.median(r[1] for r in rows), "cpu": cpu,
                      "bytes": statistics.median(r[2] for r in rows) / max(1, deltas), "per": cpu / max(1, deltas)}
        m = med[route]
        print(f"  {route:9s}  {m['wall'] * 1e3:8.1f} ms/request  CPU {m['cpu'] * 1e3:7.1f} ms "
              f"({m['per'] * 1e6:6.1f} us/delta)  {m['bytes']:5.0f} B/delta  first delta {m['first'] * 1e3:6.1f} ms  "
              f"({int(deltas)} deltas)")
    c, r = med["chat"], med["responses"]
    print(f"  responses/chat: wall {r['wall'] / c['wall']:.2f}x, CPU {r['cpu'] / c['cpu']:.2f}x, "
          f"bytes/delta {r['bytes'] / c['bytes']:.2f}x, first delta {r['first'] / max(c['first'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
