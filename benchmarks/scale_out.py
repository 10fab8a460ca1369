"""Scale-out figures (issue 13): the Redis event log's cost, replicas, failover.

    python benchmarks/scale_out.py [--kills 20] [--budget-s 300] [--skip-ray]

1. Redis log overhead per event: the event loop's own cost of logging one event (queue + JSON),
   and the Redis round trip of one unbatched XADD (p50/p95, µs); events/s one Redis takes from
   64 concurrent streams writing as the server does (pipelined batches).
2. Aggregate tok/s of 1 vs 2 replicas of the embedded text model behind the Ray Serve ingress,
   8 concurrent greedy streams. On a 2-core machine with no GPU this is a simulation: replicas
   share the same cores, so it shows overhead, not a speed-up.
3. Failover gap: a replica is killed (``ray.kill``) mid-stream; time from its death to the next
   event the client gets (events produced before the kill are not counted), p50/p95 over
   ``--kills`` kills, fewer if ``--budget-s`` runs out (the output says how many). Each kill
   waits until Serve has noticed the previous one and runs 2 replicas again, so a survivor
   always exists (the gap of one replica failing over to another, not of a cold start).
4. Image failover: the same with 2 replicas of the embedded image model (``--image-kills``, 30
   steps, killed after the 6th preview): the gap to the next preview, and the step the surviving
   replica resumed from (its checkpoint in Redis) beside the last step the client had seen.

Starts its own redis-server and local Ray cluster on loopback; needs ``multistream[scale]`` and
Debian's ``redis-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import httpx  # noqa: E402

from multistream.events import TextEvent  # noqa: E402
from multistream.server import ServerSettings  # noqa: E402
from multistream.server.durable.event_log import RedisEventLog, entry_id
from redis_fixtures import free_port, redis_server  # noqa: E402
from server_fixtures import iter_events  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- 1. the Redis log ---------------------------------------------------------------------------

async def redis_figures(url: str) -> dict[str, Any]:
    settings = ServerSettings(event_log=url)
    log = RedisEventLog(url, settings)
    await log.redis.flushdb()
    ev = TextEvent(stream_id="b" * 32, seq=0, t=0.1, delta=" word", token_ids=[1234], index=0)
    wire = ev.to_json()

    # Unbatched: one XADD round trip per event (the worst case: a stream with one event in flight).
    rtt = []
    for i in range(3000):
        t0 = time.perf_counter()
        await log.redis.xadd(log.key("s", "rtt"), {"j": wire, "f": 0}, id=entry_id(i))
        rtt.append(time.perf_counter() - t0)
    rtt = rtt[200:]

    # The event loop's own cost per event: the writer's queueing, pipeline building and reply
    # parsing (CPU of this process), events arriving 8 per flush as from a live stream.
    class Rec:
        stream_id, token, owner, owner_keyed, kind, model_name, resumable, created = (
            "c" * 32, "tok", None, False, "text", "m", True, time.time())

    n = 8000
    evs = [dataclasses.replace(ev, seq=i, index=i) for i in range(n)]
    wires = [e.to_json() for e in evs]
    w = log.writer(Rec())  # type: ignore[arg-type]
    t0 = time.process_time()
    for i in range(n):
        w.append(evs[i], wires[i])
        if i % 8 == 7:
            await w.drain()
    await w.drain()
    per_event_cpu_us = (time.process_time() - t0) / n * 1e6

    # Throughput of one Redis: 64 streams, each writing pipelined batches of 16 events.
    stop = time.perf_counter() + 3.0
    count = 0

    async def writer(k: int) -> None:
        nonlocal count
        seq = 0
        key = log.key("s", f"tp{k}")
        while time.perf_counter() < stop:
            pipe = log.redis.pipeline(transaction=False)
            for _ in range(16):
                pipe.xadd(key, {"j": wire, "f": 0}, id=entry_id(seq), maxlen=100_000, approximate=True)
                seq += 1
            pipe.incrby(log.key("bytes"), 16 * 210)
            await pipe.execute()
            count += 16

    t0 = time.perf_counter()
    await asyncio.gather(*(writer(k) for k in range(64)))
    eps = count / (time.perf_counter() - t0)
    info = await log.redis.info("memory")
    per_event_mem = info["used_memory"] / max(1, count + 3000)
    await log.close()
    return {"xadd_rtt_us_p50": pct(rtt, 0.5) * 1e6, "xadd_rtt_us_p95": pct(rtt, 0.95) * 1e6,
            "loop_cpu_us_per_event": per_event_cpu_us, "events_per_s_one_redis": eps,
            "redis_bytes_per_text_event": per_event_mem, "events_measured": n}


# -- 2-3. Ray ------------------------------------------------------------------------------------

def wait_ready(url: str, kind: str | None = None, replicas: int | None = None, timeout: float = 300) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ok = httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            if ok and kind is not None:
                dep = serve.status().applications["multistream"].deployments[kind]
                running = dep.replica_states.get("RUNNING", 0)
                ok = str(getattr(dep.status, "value", dep.status)) == "HEALTHY" and running == replicas
            if ok:
                return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.5)
    raise TimeoutError("the application did not become ready")


def load(url: str, streams: int, tokens: int) -> float:
    counts = [0] * streams

    def one(i: int) -> None:
        with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/v1/text", json={
                "prompt": f"Tell me a fact about the number {i}.", "max_new_tokens": tokens, "temperature": 0}) as r:
            for ev in iter_events(r):
                counts[i] += len(ev.get("token_ids") or [])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def kill_replica_of(client: httpx.Client, url: str, sid: str, ray: Any) -> float:
    """Kill the model replica generating stream ``sid`` (asking the ingress replicas until one
    knows it); the perf_counter time of the kill."""
    replica = None
    for _ in range(50):
        replica = client.get(f"{url}/v1/_test/replica/{sid}").json().get("replica")
        if replica:
            break
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
    return time.perf_counter()


def kill_gap(url: str, ray: Any) -> float | None:
    """One stream; kill its replica after 3 events; seconds from the kill to the next new event."""
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/v1/text", json={
            "prompt": "Write two sentences about rivers.", "max_new_tokens": 24, "temperature": 0}) as r:
        sid = r.headers["x-stream-id"]
        offset = None
        killed = None
        for i, ev in enumerate(iter_events(r)):
            now = time.perf_counter()
            if offset is None:
                offset = now - ev["t"]
            if killed is not None and ev["t"] + offset > killed:
                return now - killed
            if i == 2:
                killed = kill_replica_of(c, url, sid, ray)
    return None


def image_kill(url: str, ray: Any) -> tuple[float, int, int] | None:
    """One 30-step image stream; kill its replica after the 6th preview: (seconds from the kill to
    the next event, last step seen before, step the new replica resumed from)."""
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/v1/image", json={
            "prompt": "a red circle on a blue background", "steps": 30, "seed": 3, "preview": "latent"}) as r:
        sid = r.headers["x-stream-id"]
        killed, seen, gap = None, 0, None
        for i, ev in enumerate(iter_events(r)):
            if killed is not None and gap is None:
                gap = time.perf_counter() - killed
            if ev.get("is_final"):
                resumed = int((ev.get("metrics") or {}).get("resumed_from_step", 0))
                return (gap, seen, resumed) if gap is not None else None
            if killed is None:
                seen = max(seen, int(ev.get("step") or 0))
            if i == 5:
                killed = kill_replica_of(c, url, sid, ray)
    return None


def _wait_noticed(serve: Any, kind: str) -> None:
    """Until the controller has noticed a death (or 10 s): otherwise the next round's wait_ready
    still sees 2 RUNNING, the next kill takes the survivor, and that "gap" is a replica start."""
    noticed_by = time.monotonic() + 10
    while time.monotonic() < noticed_by:
        try:
            dep = serve.status().applications["multistream"].deployments[kind]
            if dep.replica_states.get("RUNNING", 0) < 2 or str(getattr(dep.status, "value", dep.status)) != "HEALTHY":
                return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.1)


def ray_figures(redis_url: str, kills: int, budget_s: float, image_kills: int = 0) -> dict[str, Any]:
    import ray
    from ray import serve

    from multistream.server.ray import APP_NAME, build_app

    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
             _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServerSettings(event_log=redis_url, enable_test_hooks=True, text_concurrency=16)
    out: dict[str, Any] = {}
    try:
        for n in (1, 2):
            # One CPU per replica (a stand-in for one device each); a fresh app per count.
            serve.delete(APP_NAME)
            serve.run(build_app(settings, text_model="default", image_model=None, text_replicas=n,
                                text_actor_options={"num_cpus": 1}), name=APP_NAME, route_prefix="/",
                      blocking=False)
            wait_ready(url, "text", n)
            load(url, 2, 4)  # warm up
            out[f"tok_s_{n}_replica"] = load(url, 8, 32)
        gaps: list[float] = []
        start = time.monotonic()
        while len(gaps) < kills and time.monotonic() - start < budget_s:
            wait_ready(url, "text", 2)
            gap = kill_gap(url, ray)
            if gap is not None:
                gaps.append(gap)
            _wait_noticed(serve, "text")
        out["kills"] = len(gaps)
        out["kills_asked"] = kills
        out["gaps"] = sorted(gaps)
        if gaps:
            out["gap_s_p50"] = statistics.median(gaps)
            out["gap_s_p95"] = pct(gaps, 0.95)
            out["gap_s_max"] = max(gaps)
        if image_kills:
            serve.delete(APP_NAME)
            serve.run(build_app(settings, text_model=None, image_model="default", image_replicas=2,
                                image_actor_options={"num_cpus": 1}), name=APP_NAME, route_prefix="/",
                      blocking=False)
            images: list[tuple[float, int, int]] = []
            for _ in range(image_kills):
                wait_ready(url, "image", 2)
                result = image_kill(url, ray)
                if result is not None:
                    images.append(result)
                _wait_noticed(serve, "image")
            out["image_kills"] = images
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=300.0, help="time for the kill loop")
    ap.add_argument("--image-kills", type=int, default=5)
    ap.add_argument("--skip-ray", action="store_true")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, no GPU assumed; Python {sys.version.split()[0]}")
    with redis_server() as redis:
        r = asyncio.run(redis_figures(redis.url))
        print("\n== Redis event log (one redis-server on loopback) ==")
        print(f"server CPU to log an event (queue, pipeline, reply; 8 events a flush): "
              f"{r['loop_cpu_us_per_event']:.1f} us/event ({r['events_measured']} events)")
        print(f"unbatched XADD round trip: p50 {r['xadd_rtt_us_p50']:.0f} us, p95 {r['xadd_rtt_us_p95']:.0f} us")
        print(f"one Redis, 64 streams writing pipelined batches of 16: {r['events_per_s_one_redis']:,.0f} events/s "
              "(one Python client process on the same 2 cores: a lower bound for Redis)")
        print(f"Redis memory per text event (incl. stream overhead): ~{r['redis_bytes_per_text_event']:.0f} B")
        if args.skip_ray:
            return
        f = ray_figures(redis.url, args.kills, args.budget_s, args.image_kills)
        print("\n== Ray Serve (local cluster, num_cpus=2, embedded SmolLM2-135M, CPU) ==")
        print(f"aggregate tok/s, 8 concurrent greedy streams x 32 tokens: 1 replica {f['tok_s_1_replica']:.1f}, "
              f"2 replicas {f['tok_s_2_replica']:.1f}  (one CPU core per replica standing in for a device: a simulation)")
        print(f"failover gap (replica death -> next new event), {f['kills']} of {f['kills_asked']} kills "
              f"(budget {args.budget_s:.0f} s): "
              + (f"p50 {f['gap_s_p50']:.2f} s, p95 {f['gap_s_p95']:.2f} s, max {f['gap_s_max']:.2f} s"
                 if f.get("kills") else "none measured"))
        if f.get("gaps"):
            print("each gap, sorted (s): " + " ".join(f"{g:.2f}" for g in f["gaps"]))
        if "image_kills" in f:
            kills = f["image_kills"]
            print(f"image failover, 2 replicas of the embedded model, 30 steps, {len(kills)} of {args.image_kills} kills:")
            if kills:
                gaps = [g for g, _, _ in kills]
                print(f"  gap to the next preview p50 {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s; "
                      "last step seen -> resumed from checkpoint step: "
                      + ", ".join(f"{seen}->{resumed}" for _, seen, resumed in kills))


if __name__ == "__main__":
    main()
