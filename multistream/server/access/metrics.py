"""Prometheus metrics with ``prometheus_client``, named in vLLM's style (``multistream:...``).

Each app has its own `CollectorRegistry` (several apps can live in one process, as in tests);
``GET /metrics`` renders it. Gauges read live state through callbacks at scrape time, so they
can never drift.

Example:
    >>> m = Metrics()
    >>> m.ttft.observe(0.12, kind="text")
    >>> "multistream:time_to_first_token_seconds_bucket" in m.render()
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)

Sample = Callable[[], Iterable[tuple[dict[str, str], float]]]


class _Labeled:
    """``metric.observe(value, kind="text")`` / ``metric.inc(kind=...)`` over a labelled metric."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        # The labelled children, looked up once: `labels()` validates and locks on every call,
        # and some of these are counted per event sent.
        self._children: dict[tuple[tuple[str, str], ...], Any] = {}

    def child(self, **labels: str) -> Any:
        """The prometheus child of these labels, for a caller that counts it per event
        (``child.observe(v)`` / ``child.inc()`` then skip the lookup)."""
        return self._child(labels)

    def _child(self, labels: dict[str, str]) -> Any:
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.metric.labels(**labels)
        return child

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def value(self, **labels: str) -> float:
        return float(self.metric.labels(**labels)._value.get())

    def count(self, **labels: str) -> int:
        for metric in self.metric.collect():
            for s in metric.samples:
                if s.name.endswith("_count") and all(s.labels.get(k) == v for k, v in labels.items()):
                    return int(s.value)
        return 0

    def total(self) -> float:
        return sum(s.value for m in self.metric.collect() for s in m.samples if s.name.endswith("_total"))


class _Gauges(Collector):
    def __init__(self) -> None:
        self.gauges: list[tuple[str, str, Sample]] = []

    def collect(self) -> Iterator[Metric]:
        for name, help, sample in [*self.gauges, *_gpu_gauges()]:
            samples = list(sample())
            if not samples:
                continue
            labels = sorted({k for lbl, _ in samples for k in lbl})
            family = GaugeMetricFamily(name, help, labels=labels)
            for lbl, value in samples:
                family.add_metric([str(lbl.get(k, "")) for k in labels], value)
            yield family


class Metrics:
    """The server's metric set."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def hist(name: str, help: str, buckets: tuple[float, ...]) -> _Labeled:
            return _Labeled(Histogram(name, help, ["kind"], buckets=buckets, registry=r))

        def counter(name: str, help: str, labels: list[str]) -> _Labeled:
            return _Labeled(Counter(name, help, labels, registry=r))

        self.ttft = hist("multistream:time_to_first_token_seconds",
                         "Time from request arrival to the first event of a stream (includes queueing).",
                         _LATENCY_BUCKETS)
        self.first_preview = hist("multistream:time_to_first_preview_seconds",
                                  "Time from request arrival to the first image preview.", _LATENCY_BUCKETS)
        self.inter_token = hist("multistream:inter_token_latency_seconds",
                                "Time between consecutive text events of a stream, as the server saw them.",
                                _LATENCY_BUCKETS)
        self.queue_wait = hist("multistream:queue_time_seconds", "Time a request waited for admission.",
                               _LATENCY_BUCKETS)
        self.preview_bytes = hist("multistream:preview_frame_bytes", "Encoded size of image preview frames.",
                                  _BYTES_BUCKETS)
        self.finished = counter("multistream:requests_finished", "Streams that ended, by finish reason.",
                                ["kind", "finish_reason"])
        self.interrupted = counter("multistream:streams_interrupted",
                                   "Streams whose client disconnected before the final event.", ["kind"])
        self.grace_cancelled = counter("multistream:streams_grace_cancelled",
                                       "Streams cancelled because no client came back within the grace period.",
                                       ["kind"])
        self.rejected = counter("multistream:requests_rejected", "Requests refused, by HTTP status and reason.",
                                ["status", "reason"])
        self.events_sent = counter("multistream:events", "Events produced by streams.", ["kind"])
        self.dropped_frames = counter("multistream:dropped_frames",
                                      "Preview frames dropped from a replay log because a newer one replaced it.",
                                      ["kind"])
        # Named as the issue asks (no vLLM colon): generation health, a text stream's detected loops.
        self.repetition_loops = counter("multistream_repetition_loops",
                                        "Text streams in which a repetition loop was detected (flagged on the final "
                                        "event; ended there with stop_on_repetition).", ["kind"])
        self.repetition_loops.metric.labels(kind="text")  # shown as 0 before the first loop
        # Exact lookahead (speculate): tokens drafted and accepted, as vLLM's spec_decode counters.
        self.drafted_tokens = counter("multistream:spec_decode_num_draft_tokens",
                                      "Tokens drafted by lookahead (prompt lookup) and verified.", ["kind"])
        self.accepted_tokens = counter("multistream:spec_decode_num_accepted_tokens",
                                       "Drafted tokens that were accepted (equal to what one token per step gives).",
                                       ["kind"])
        self.drafted_tokens.metric.labels(kind="text")
        self.accepted_tokens.metric.labels(kind="text")
        # Prompt tokens whose keys and values came from the prefix cache, as vLLM's prefix_cache_hits.
        self.prefix_cache_hit_tokens = counter("multistream:prefix_cache_hit_tokens",
                                               "Prompt tokens not prefilled: their KV rows came from an earlier "
                                               "prompt that began alike (the prefix cache).", ["kind"])
        self.prefix_cache_hit_tokens.metric.labels(kind="text")
        self._gauges = _Gauges()
        r.register(self._gauges)
        self.gauge("multistream:interrupted_stream_ratio", "Interrupted streams / finished streams since start.",
                   lambda: [({}, self.interrupted_rate())])

    def gauge(self, name: str, help: str, sample: Sample) -> None:
        self._gauges.gauges.append((name, help, sample))

    def interrupted_rate(self) -> float:
        done = self.finished.total()
        return self.interrupted.total() / done if done else 0.0

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")


def _gpu_gauges() -> list[tuple[str, str, Sample]]:
    # Only report when torch is already loaded by a model: importing it for a scrape would cost seconds.
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []

    def used() -> list[tuple[dict[str, str], float]]:
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append(({"device": f"cuda:{i}"}, float(total - free)))
        return out

    def total() -> list[tuple[dict[str, str], float]]:
        return [({"device": f"cuda:{i}"}, float(torch.cuda.mem_get_info(i)[1])) for i in range(torch.cuda.device_count())]

    return [("multistream:gpu_memory_used_bytes", "GPU memory in use (all processes).", used),
            ("multistream:gpu_memory_total_bytes", "GPU memory in total.", total)]
