"""Start-up of the embedded text model, the CLI and the server, each in a new process.

    python benchmarks/startup.py [--rounds 5] --before ../base [--after .] [--importtime 15]

Each measurement starts a fresh Python (warm: the embedded model's converted cache and the
quantized-weights cache exist, which the first run of each tree writes; that run is discarded):

- ``load``: ``import multistream`` and ``ms.load_text_model()`` (seconds of each, in-process clock;
  ``cpu_s``: the process's CPU seconds for both, all threads: less sensitive to a busy machine),
- ``cli``: ``multistream text "Hi" --max-new-tokens 8``: time to the first byte on stdout (the
  first token) and to the exit, from the parent's clock,
- ``serve``: ``multistream serve`` until ``/healthz`` answers and until ``/readyz`` says ready;
  then its first and second ``POST /v1/text`` (one token), each to its first SSE event,
- ``first``: a process's first request of each kind after ``ms.load_text_model()``, a process each:
  plain, ``json_schema=`` and ``logprobs=True`` (8 tokens, greedy), to its first token: what a
  grammar or a logprob table adds to the first request (not in the default set).

Each tree is a ``PYTHONPATH`` (``--before``: e.g. a checkout of main; ``--after``: this one). Rounds
interleave the trees (their order alternating), so machine noise hits both alike; the report gives
medians and after/before ratios, with the load average (``os.getloadavg``) around the run.
``--importtime N`` also prints the N largest imports (``python -X importtime``, cumulative, top
level) of ``ms.load_text_model()`` for each tree.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

LOAD = ("import time; t0 = time.perf_counter(); import multistream as ms; t1 = time.perf_counter(); "
        "ms.load_text_model(); t2 = time.perf_counter(); "
        "import json; print(json.dumps({'import_s': t1 - t0, 'load_s': t2 - t1, 'cpu_s': time.process_time()}))")


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def measure_load(tree: Path) -> dict[str, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LOAD], env=_env(tree), cwd=tree, capture_output=True, text=True,
                         check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    figures["process_s"] = time.perf_counter() - start
    return figures


FIRST = ("import json, sys, time; import multistream as ms; llm = ms.load_text_model(); "
         "extra = {'plain': {}, 'json_schema': {'json_schema': {'type': 'object', 'properties': {'name': "
         "{'type': 'string'}, 'age': {'type': 'integer'}}, 'required': ['name', 'age']}}, "
         "'logprobs': {'logprobs': True, 'top_logprobs': 3}}[sys.argv[1]]; t = time.perf_counter(); "
         "first = next(time.perf_counter() - t for ev in llm.stream('Invent a person.', max_new_tokens=8, "
         "temperature=0.0, **extra) if ev.token_ids); print(json.dumps({'s': first})); llm.close()")


def measure_first(tree: Path) -> dict[str, float]:
    out = {}
    for kind in ("plain", "json_schema", "logprobs"):
        run = subprocess.run([sys.executable, "-c", FIRST, kind], env=_env(tree), cwd=tree, capture_output=True,
                             text=True, check=True).stdout
        out[f"{kind}_s"] = json.loads(run.strip().splitlines()[-1])["s"]
    return out


def measure_cli(tree: Path) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "multistream", "text", "Hi", "--max-new-tokens", "8"],
                            env=_env(tree), cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    first_s = time.perf_counter() - start
    proc.stdout.read()
    code = proc.wait()
    if code != 0 or not first:
        raise RuntimeError(f"multistream text exited with {code}")
    return {"first_byte_s": first_s, "total_s": time.perf_counter() - start}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, urllib.error.URLError):
        return None


def measure_serve(tree: Path, timeout_s: float = 600.0) -> dict[str, float]:
    port = _free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "multistream", "serve", "--port", str(port)], env=_env(tree),
                            cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    figures: dict[str, float] = {}
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"multistream serve exited with {proc.returncode}")
            if "health_s" not in figures and _status(f"http://127.0.0.1:{port}/healthz") == 200:
                figures["health_s"] = time.perf_counter() - start
            if "health_s" in figures and _status(f"http://127.0.0.1:{port}/readyz") == 200:
                figures["ready_s"] = time.perf_counter() - start
                figures["first_text_s"] = first_event_s(port)
                figures["second_text_s"] = first_event_s(port)
                return figures
            time.sleep(0.05)  # polling interval of the probe, not a synchronisation
        raise RuntimeError("multistream serve did not get ready")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def first_event_s(port: int) -> float:
    """Seconds from sending ``POST /v1/text`` (one token) to its first SSE ``data:`` line."""
    body = json.dumps({"prompt": "Hi", "max_new_tokens": 1})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/text", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        while not response.readline().startswith(b"data:"):
            pass
        return time.perf_counter() - start
    finally:
        conn.close()


def top_imports(tree: Path, n: int) -> list[tuple[float, str]]:
    """The ``n`` largest top-level imports (cumulative seconds) of loading the embedded model."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import multistream as ms; ms.load_text_model()"],
                         env=_env(tree), cwd=tree, capture_output=True, text=True, check=True).stderr
    rows = []
    for line in err.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if match and len(match[2]) <= 1:  # top level: imported by our code or the interpreter directly
            rows.append((int(match[1]) / 1e6, match[3]))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, required=True,
                        help="PYTHONPATH of the baseline tree (e.g. `git worktree add ../base <commit>`)")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="PYTHONPATH of the tree under test (default: this checkout)")
    parser.add_argument("--only", choices=("load", "cli", "serve", "first"), action="append",
                        help="measure only these (repeatable; default: load, cli and serve)")
    parser.add_argument("--importtime", type=int, default=0, metavar="N", help="print the N largest imports")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    kinds = {"load": measure_load, "cli": measure_cli, "serve": measure_serve, "first": measure_first}
    chosen = args.only or ["load", "cli", "serve"]

    load_before = os.getloadavg()
    for tree in trees.values():  # warm-up: writes each tree's caches, not counted
        measure_load(tree)
    results: dict[str, dict[str, list[float]]] = {label: {} for label in trees}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for kind in chosen:
            for label in order:
                for key, value in kinds[kind](trees[label]).items():
                    results[label].setdefault(f"{kind}.{key}", []).append(value)
        print(f"round {round_ + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.2f})", file=sys.stderr)
    load_after = os.getloadavg()

    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f} (1 and 5 min); {args.rounds} rounds, medians, seconds")
    print(f"{'measure':24} {'before':>8} {'after':>8} {'after/before':>13}")
    for key in results["before"]:
        before = statistics.median(results["before"][key])
        after = statistics.median(results["after"][key])
        print(f"{key:24} {before:8.3f} {after:8.3f} {after / before:13.2f}")
    if args.importtime:
        for label, tree in trees.items():
            print(f"\n-X importtime, {label} ({tree}): top {args.importtime} top-level imports (cumulative s)")
            for seconds, name in top_imports(tree, args.importtime):
                print(f"  {seconds:6.3f}  {name}")


if __name__ == "__main__":
    main()
