"""Prometheus metrics, hand-written (no dependency): histograms, counters and gauges with labels.

``GET /metrics`` renders `Metrics.render()` in the Prometheus text format (version 0.0.4).

Example:
    >>> m = Metrics()
    >>> m.ttft.observe(0.12, kind="text")
    >>> "multistream_ttft_seconds_bucket" in m.render()
    True
"""

from __future__ import annotations

import bisect
import math
import sys
import threading
from collections.abc import Callable, Iterable

__all__ = ["Counter", "Gauge", "Histogram", "Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str) -> None:
        self.name = name
        self.help = help
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self._values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def total(self) -> float:
        return sum(self._values.values())

    def lines(self) -> list[str]:
        with self._lock:
            items = list(self._values.items())
        return self.header() + [f"{self.name}{_labels(dict(k))} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    """A gauge whose samples come from a callback at scrape time (so it can never drift)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, sample: Callable[[], Iterable[tuple[dict[str, str], float]]]) -> None:
        super().__init__(name, help)
        self._sample = sample

    def lines(self) -> list[str]:
        samples = list(self._sample())
        if not samples:
            return []
        return self.header() + [f"{self.name}{_labels(lbl)} {_num(v)}" for lbl, v in samples]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        super().__init__(name, help)
        self.buckets = tuple(buckets)
        self._series: dict[tuple[tuple[str, str], ...], list[float]] = {}  # counts per bucket + [sum, count]

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = [0.0] * (len(self.buckets) + 2)
            i = bisect.bisect_left(self.buckets, value)  # first bound >= value: Prometheus 'le'
            if i < len(self.buckets):
                series[i] += 1
            series[-2] += value
            series[-1] += 1

    def count(self, **labels: str) -> int:
        series = self._series.get(tuple(sorted(labels.items())))
        return int(series[-1]) if series else 0

    def lines(self) -> list[str]:
        out = self.header()
        with self._lock:
            items = [(k, list(v)) for k, v in self._series.items()]
        for key, series in items:
            labels = dict(key)
            running = 0.0
            for bound, n in zip(self.buckets, series):
                running += n
                out.append(f"{self.name}_bucket{_labels({**labels, 'le': _num(bound)})} {_num(running)}")
            out.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {_num(series[-1])}")
            out.append(f"{self.name}_sum{_labels(labels)} {_num(series[-2])}")
            out.append(f"{self.name}_count{_labels(labels)} {_num(series[-1])}")
        return out


class Metrics:
    """The server's metric set. Gauges read live state through callbacks set by the app."""

    def __init__(self) -> None:
        self.ttft = Histogram("multistream_ttft_seconds",
                              "Time from request arrival to the first event, per stream (includes queueing).",
                              _LATENCY_BUCKETS)
        self.inter_token = Histogram("multistream_inter_token_latency_seconds",
                                     "Time between consecutive text events of a stream, as the server saw them.",
                                     _LATENCY_BUCKETS)
        self.queue_wait = Histogram("multistream_queue_wait_seconds", "Time a request waited for admission.",
                                    _LATENCY_BUCKETS)
        self.preview_bytes = Histogram("multistream_preview_frame_bytes", "Encoded size of image preview frames.",
                                       _BYTES_BUCKETS)
        self.finished = Counter("multistream_streams_finished_total", "Streams that ended, by finish reason.")
        self.interrupted = Counter("multistream_streams_interrupted_total",
                                   "Streams whose client disconnected before the final event.")
        self.grace_cancelled = Counter("multistream_streams_grace_cancelled_total",
                                       "Streams cancelled because no client came back within the grace period.")
        self.rejected = Counter("multistream_requests_rejected_total", "Requests refused, by HTTP status and reason.")
        self.events_sent = Counter("multistream_events_total", "Events produced by streams.")
        self._gauges: list[Gauge] = []

    def gauge(self, name: str, help: str, sample: Callable[[], Iterable[tuple[dict[str, str], float]]]) -> None:
        self._gauges.append(Gauge(name, help, sample))

    def interrupted_rate(self) -> float:
        done = self.finished.total()
        return self.interrupted.total() / done if done else 0.0

    def render(self) -> str:
        lines: list[str] = []
        for metric in (self.ttft, self.inter_token, self.queue_wait, self.preview_bytes, self.finished,
                       self.interrupted, self.grace_cancelled, self.rejected, self.events_sent):
            lines += metric.lines()
        lines += Gauge("multistream_interrupted_stream_ratio",
                       "Interrupted streams / finished streams since start.",
                       lambda: [({}, self.interrupted_rate())]).lines()
        for gauge in [*self._gauges, *_gpu_gauges()]:
            lines += gauge.lines()
        return "\n".join(lines) + "\n"


def _gpu_gauges() -> list[Gauge]:
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

    return [Gauge("multistream_gpu_memory_used_bytes", "GPU memory in use (all processes).", used),
            Gauge("multistream_gpu_memory_total_bytes", "GPU memory in total.", total)]
