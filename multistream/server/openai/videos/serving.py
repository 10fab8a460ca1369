"""OpenAI's Videos API over a video stream: a pure translator from `VideoEvent`s to the job object
the SDK polls, and the assets it downloads. No server, no I/O: the router feeds it events.

OpenAI's video generation is a job: ``POST /v1/videos`` answers at once with ``status`` "queued",
``GET /v1/videos/{id}`` shows ``status`` ("queued" | "in_progress" | "completed" | "failed") and
``progress`` (0-100), and ``GET /v1/videos/{id}/content?variant=`` downloads the clip
(``video``), one frame (``thumbnail``, WebP) or all frames on one JPEG (``spritesheet``). Here a job
is one video stream: its previews move ``progress`` (``step / total_steps``), its final is the
clip, an error event fails it. `VideoJob.fold` reads only the events it has not seen, so the
router can hand it a stream's whole event list on every poll.

`VideoJobStore` keeps the jobs (bounded, oldest dropped first, like stored Responses); a job's
assets expire ``retention_s`` after it ends, as the stream's events do.

Example:
    >>> from multistream.events import VideoEvent
    >>> job = VideoJob(id="video_s1", stream_id="s1", model="shapes", prompt="a red circle moving right",
    ...                size="64x64", seconds="2", created_at=1700000000)
    >>> preview = VideoEvent(stream_id="s1", seq=0, t=0.1, step=5, total_steps=20, num_frames=16, fps=8,
    ...                      width=64, height=64, mime="image/webp", data=b"...")
    >>> job.fold([preview], now=1700000001).to_object()["status"], job.progress
    ('in_progress', 25)
"""

from __future__ import annotations

import io
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from ....events import ErrorEvent, Event, VideoEvent
from ...http.problems import Problem

__all__ = ["VARIANTS", "VIDEO_ID_PREFIX", "VideoAsset", "VideoJob", "VideoJobStore", "video_id"]

VIDEO_ID_PREFIX = "video_"

#: What ``GET /v1/videos/{id}/content?variant=`` serves: the clip itself (its own type, ``video/mp4``
#: or ``video/webm``), a frame of it, all its frames on one sheet (OpenAI's types for the two images).
VARIANTS: dict[str, str | None] = {"video": None, "thumbnail": "image/webp", "spritesheet": "image/jpeg"}

Status = Literal["queued", "in_progress", "completed", "failed"]

# Finals that are not a finished clip: the job failed, with this code.
_FAILED_REASONS = {"cancelled": "the generation was cancelled before it finished",
                   "content_filter": "the prompt was stopped by this server's content filter"}


def video_id(stream_id: str) -> str:
    """The job id OpenAI clients see for a stream (``video_`` + the stream's id)."""
    return VIDEO_ID_PREFIX + stream_id


@dataclass(frozen=True)
class VideoAsset:
    """One downloadable asset: its bytes and media type."""

    data: bytes
    media_type: str


@dataclass
class VideoJob:
    """One ``POST /v1/videos`` job: what it was asked (the fields the Video object repeats) and
    what its stream's events made of it so far."""

    id: str
    stream_id: str
    model: str
    prompt: str
    size: str
    seconds: str
    created_at: int
    owner: str | None = None
    owner_keyed: bool = False
    token: str = field(default="", repr=False)
    status: Status = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, Any] | None = None
    eta_s: float | None = None
    final: VideoEvent | None = field(default=None, repr=False)
    last_seq: int = -1
    retention_s: float | None = None
    _assets: dict[str, VideoAsset] = field(default_factory=dict, repr=False)

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed")

    @property
    def nbytes(self) -> int:
        """The bytes this job keeps: its clip and the assets made from it."""
        return (len(self.final.data) if self.final is not None else 0) + sum(len(a.data) for a in self._assets.values())

    def apply(self, ev: Event, now: float) -> None:
        """Fold one event in (events at or below ``last_seq`` were seen already and are skipped)."""
        if ev.seq <= self.last_seq or self.done:
            return
        self.last_seq = ev.seq
        if isinstance(ev, ErrorEvent):
            self._end("failed", now, {"code": str(ev.error.get("type") or "server_error"),
                                      "message": str(ev.error.get("message") or "the generation failed")})
            return
        if not isinstance(ev, VideoEvent):
            return
        self.eta_s = ev.eta_s
        if not ev.is_final:
            self.status = "in_progress"
            if ev.total_steps > 0:
                # Never 100 before the clip exists: the final's encoding comes after the last step.
                self.progress = max(self.progress, min(99, math.floor(100 * ev.step / ev.total_steps)))
            return
        reason = ev.finish_reason or "stop"
        if reason in _FAILED_REASONS or not ev.mime.startswith("video/"):
            self._end("failed", now, {"code": reason, "message": _FAILED_REASONS.get(reason, f"the stream ended "
                                      f"({reason}) without a clip")})
            return
        self.final = ev
        self.progress = 100
        self._end("completed", now, None)

    def fold(self, events: Iterable[Event], now: float | None = None) -> VideoJob:
        """Apply every event not seen yet (a stream's whole event list may be passed each time)."""
        at = time.time() if now is None else now
        for ev in events:
            self.apply(ev, at)
        return self

    def admitted(self) -> None:
        """Its stream got a slot and runs: "in_progress" from now (before its first step's event)."""
        if self.status == "queued":
            self.status = "in_progress"

    def fail(self, code: str, message: str, now: float) -> None:
        """End the job as failed (e.g. its request was refused while it waited for a slot)."""
        if not self.done:
            self._end("failed", now, {"code": code, "message": message})

    def _end(self, status: Status, now: float, error: dict[str, Any] | None) -> None:
        self.status, self.error, self.eta_s = status, error, 0.0
        self.completed_at = int(now)
        if self.retention_s is not None:
            self.expires_at = int(now + self.retention_s)

    def to_object(self) -> dict[str, Any]:
        """The ``Video`` object (``openai.types.Video``) for this job now."""
        return {
            "id": self.id, "object": "video", "created_at": self.created_at, "completed_at": self.completed_at,
            "expires_at": self.expires_at, "model": self.model, "progress": self.progress, "prompt": self.prompt,
            "remixed_from_video_id": None, "seconds": self.seconds, "size": self.size, "status": self.status,
            "error": self.error,
        }

    def poll_after_ms(self) -> int:
        """How soon a poller should ask again (the ``openai-poll-after-ms`` header the SDK's
        ``poll``/``create_and_poll`` honour): half the estimated time left, 100 ms to 2 s, so a
        short clip is seen done within a fraction of its run and a long one is not polled in a
        busy loop."""
        if self.eta_s is None:
            return 250
        return int(min(2000, max(100, self.eta_s * 500)))

    def content(self, variant: str | None) -> VideoAsset:
        """The asset ``variant`` names (None: the clip), made once and kept. A 400 names the
        variants; a 409 says the job has no clip (yet, or ever)."""
        name = "video" if variant is None else variant
        if name not in VARIANTS:
            raise Problem(400, "invalid_argument", f"unknown variant {str(name)[:40]!r}; use one of "
                          f"{', '.join(VARIANTS)}", param="variant")
        if self.final is None:
            why = (f"it failed ({self.error['code']})" if self.status == "failed" and self.error
                   else f"it is {self.status} ({self.progress}%); download it when status is 'completed'")
            raise Problem(409, "video_not_ready", f"video {self.id} has no content: {why}")
        asset = self._assets.get(name)
        if asset is None:
            asset = self._assets[name] = self._make(name, self.final)
        return asset

    @staticmethod
    def _make(name: str, final: VideoEvent) -> VideoAsset:
        if name == "video":
            return VideoAsset(final.data, final.mime)
        frames = final.frames  # decoded from the clip (PyAV), once
        if name == "thumbnail":
            out = io.BytesIO()
            frames[0].save(out, format="WEBP", quality=90)
            return VideoAsset(out.getvalue(), "image/webp")
        from ....video import encode_sheet

        return VideoAsset(encode_sheet(frames, "JPEG"), "image/jpeg")


class VideoJobStore:
    """The jobs by id: at most ``max_jobs`` (the oldest dropped first), ended jobs' clips and
    assets in at most ``max_bytes`` (the oldest ended ones dropped first), and an ended job for
    ``retention_s`` after its end (then it is gone, as its stream is).

    Example:
        >>> store = VideoJobStore(max_jobs=2, retention_s=60)
        >>> for i in range(3):
        ...     _ = store.add(VideoJob(id=f"video_{i}", stream_id=str(i), model="m", prompt="p", size="64x64",
        ...                            seconds="2", created_at=0))
        >>> [j.id for j in store.jobs()], store.get("video_0")
        (['video_1', 'video_2'], None)
    """

    def __init__(self, max_jobs: int, retention_s: float, max_bytes: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.max_jobs = max_jobs
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()

    def add(self, job: VideoJob) -> VideoJob:
        job.retention_s = self.retention_s
        self._jobs[job.id] = job
        while len(self._jobs) > self.max_jobs:
            self._jobs.popitem(last=False)
        return job

    def _expired(self, job: VideoJob) -> bool:
        return job.expires_at is not None and self.clock() >= job.expires_at

    def _trim(self) -> None:
        """Drop the expired jobs, then the oldest ended ones while the clips kept pass ``max_bytes``
        (a running job keeps no clip yet, so it is never dropped for its size)."""
        for job in [j for j in self._jobs.values() if self._expired(j)]:
            del self._jobs[job.id]
        if self.max_bytes is None:
            return
        total = sum(j.nbytes for j in self._jobs.values())
        for job in [j for j in self._jobs.values() if j.done]:
            if total <= self.max_bytes:
                break
            total -= job.nbytes
            del self._jobs[job.id]

    def get(self, job_id: str) -> VideoJob | None:
        """The job, unless it is unknown, dropped or expired."""
        self._trim()
        return self._jobs.get(job_id) if isinstance(job_id, str) else None

    def delete(self, job_id: str) -> VideoJob | None:
        return self._jobs.pop(job_id, None)

    def jobs(self) -> list[VideoJob]:
        """Every live job, oldest first."""
        self._trim()
        return list(self._jobs.values())

    def page(self, *, after: str | None = None, limit: int = 20, order: str = "desc",
             visible: Callable[[VideoJob], bool] = lambda job: True) -> dict[str, Any]:
        """``GET /v1/videos``: a cursor page (``data``, ``first_id``, ``last_id``, ``has_more``) of
        the jobs ``visible`` lets a caller see, newest first unless ``order="asc"``."""
        if order not in ("asc", "desc"):
            raise Problem(400, "invalid_argument", f"order must be 'asc' or 'desc', got {str(order)[:20]!r}",
                          param="order")
        if not 1 <= limit <= 100:
            raise Problem(400, "invalid_argument", f"limit must be 1..100, got {limit}", param="limit")
        jobs = [j for j in self.jobs() if visible(j)]
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise Problem(404, "not_found", f"no video {after[:80]!r} to list after", param="after")
            jobs = jobs[ids.index(after) + 1:]
        data = [j.to_object() for j in jobs[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}
