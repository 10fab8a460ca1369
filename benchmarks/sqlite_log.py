"""What an embedded durable event log in SQLite (stdlib) would cost per event, before making it a
default for a single server without Redis (issue 27 asks to measure first).

Writes N text events' wire JSON (about 200 bytes each, the size of a one-token text event) into a
table keyed by (stream id, seq), in WAL mode, three ways: a commit per event with
``synchronous=FULL`` (durable against power loss), a commit per event with ``synchronous=NORMAL``
(durable against a process kill: what a restart needs), and one commit per 16 events (what a
batching writer, like the Redis one, does under load). Also times reading a stream back.

    python benchmarks/sqlite_log.py [--events 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import time


def _db(path: str, synchronous: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    db.execute("CREATE TABLE IF NOT EXISTS events (sid TEXT, seq INTEGER, j TEXT, PRIMARY KEY (sid, seq))")
    return db


def run(path: str, n: int, synchronous: str, batch: int) -> float:
    db = _db(path, synchronous)
    wire = json.dumps({"type": "text", "stream_id": "s" * 32, "seq": 0, "t": 0.1, "is_final": False,
                       "delta": " word", "token_ids": [1234], "index": 0, "offset": 0})
    sid = f"{synchronous}-{batch}"
    start = time.perf_counter()
    for i in range(0, n, batch):
        db.execute("BEGIN")
        db.executemany("INSERT INTO events VALUES (?, ?, ?)", [(sid, s, wire) for s in range(i, min(n, i + batch))])
        db.execute("COMMIT")
    per = (time.perf_counter() - start) / n
    db.close()
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=5000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "log.db")
        for synchronous, batch in (("FULL", 1), ("NORMAL", 1), ("NORMAL", 16)):
            per = run(path, args.events, synchronous, batch)
            print(f"synchronous={synchronous:6s} commit every {batch:2d} event(s): {per * 1e6:7.1f} us/event")
        db = _db(path, "NORMAL")
        start = time.perf_counter()
        rows = db.execute("SELECT j FROM events WHERE sid = ? AND seq > ? ORDER BY seq", ("NORMAL-1", -1)).fetchall()
        print(f"read back one stream of {len(rows)} events: {(time.perf_counter() - start) * 1e6 / len(rows):.1f} "
              "us/event")


if __name__ == "__main__":
    main()
