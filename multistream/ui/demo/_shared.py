"""What the demo's tabs share: the models, the runs per session, errors and the live preview box.

Example:
    >>> runs = ActiveRuns()
    >>> runs.cancel(("some-session", "image"))      # nothing running: nothing to stop
    False
"""

from __future__ import annotations

import base64
import html
import logging
import threading
from dataclasses import dataclass
from typing import Any

import gradio as gr

from ...errors import MultistreamError
from ...events import ImageEvent, VideoEvent
from ...stream import Stream
from ..view import LiveView, ending_words

__all__ = [
    "PREVIEW_MODES",
    "PREVIEW_SIDE_PX",
    "STRIP_MAX",
    "ActiveRuns",
    "ModelSlot",
    "check_view",
    "data_url",
    "default_preview",
    "image_kwargs",
    "image_outputs",
    "preview_html",
    "progress_box",
    "run_key",
    "ui_error",
]

logger = logging.getLogger("multistream.ui.demo")

PREVIEW_MODES = ("tiny", "latent", "x0", "vae", "none")
PREVIEW_SIDE_PX = 320  # how large the preview box is drawn on the page
STRIP_MAX = 40  # frames kept in the strip; later ones are skipped so the page stays light


class ActiveRuns:
    """The stream each browser session is running per tab, so its Stop button can cancel it.

    Gradio's ``cancels=`` would only stop the Python generator; cancelling the Stream stops the
    model thread within one step, and the run then ends normally showing "cancelled".

    Example:
        >>> runs = ActiveRuns()
        >>> runs.get(("some-session", "chat")) is None
        True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], Stream] = {}

    def start(self, key: tuple[str, str], stream: Stream) -> None:
        with self._lock:
            old = self._runs.get(key)
            self._runs[key] = stream
        if old is not None:  # one run per session and tab: a new one replaces the old
            old.cancel()

    def end(self, key: tuple[str, str], stream: Stream) -> None:
        with self._lock:
            if self._runs.get(key) is stream:
                del self._runs[key]

    def get(self, key: tuple[str, str]) -> Stream | None:
        with self._lock:
            return self._runs.get(key)

    def cancel(self, key: tuple[str, str]) -> bool:
        with self._lock:
            stream = self._runs.get(key)
        if stream is None:
            return False
        stream.cancel()
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)


def run_key(request: gr.Request | None, tab: str) -> tuple[str, str]:
    """The ``ActiveRuns`` key of a browser session's run in ``tab``.

    Example:
        >>> run_key(None, "chat")
        ('anonymous', 'chat')
    """
    session = (getattr(request, "session_hash", None) or "anonymous") if request is not None else "anonymous"
    return session, tab


def ui_error(exc: BaseException) -> gr.Error:
    """A multistream error as the message box Gradio shows on the page.

    Example:
        >>> raise ui_error(MultistreamError("steps must be >= 1"))      # doctest: +SKIP
    """
    return gr.Error(str(exc) or type(exc).__name__)


def _load_default(kind: str) -> tuple[Any, str]:
    """Load an embedded default model; on failure return (None, why), so the rest of the page works."""
    try:
        if kind == "text":
            from ...text import load_text_model

            return load_text_model(), ""
        if kind == "speech":
            from ...speech import load_speech_model

            return load_speech_model(), ""
        from ...image import load_image_model  # type: ignore[import-not-found]

        return load_image_model(), ""
    except (ImportError, MultistreamError, OSError, RuntimeError) as exc:
        logger.warning("demo: no default %s model: %s", kind, exc)
        return None, f"{type(exc).__name__}: {exc}"


@dataclass
class ModelSlot:
    """One model the tabs draw on: the model, a zero-argument provider of it, or None (and why).

    A provider (e.g. the server's model slot, loaded in the background) is called per request.

    Example:
        >>> from multistream.testing import ScriptedTextModel
        >>> slot = ModelSlot("text", ScriptedTextModel())
        >>> slot.missing, type(slot.get()).__name__
        (False, 'ScriptedTextModel')
    """

    kind: str  # "text", "image", "speech" or "video": names the model in messages and the --<kind>-model flag
    model: Any = None
    why: str = ""  # why the embedded default could not load

    @classmethod
    def load(cls, kind: str, model: Any) -> ModelSlot:
        """``model`` as given, or the embedded default for ``kind`` when it is None."""
        if model is not None:
            return cls(kind, model)
        model, why = _load_default(kind)
        return cls(kind, model, why)

    @property
    def missing(self) -> bool:
        """True when no model (nor provider) is there: the tabs say why instead."""
        return self.model is None

    def get(self) -> Any:
        """The model for this request, or a page error that says why there is none."""
        model = self.model
        if model is not None and not hasattr(model, "stream") and callable(model):
            try:
                model = model()
            except Exception as exc:  # noqa: BLE001 - shown on the page rather than crashing it
                raise gr.Error(f"the {self.kind} model is not ready: {exc}") from exc
        if model is None:
            raise gr.Error(
                f"no {self.kind} model is loaded ({self.why or 'none given'}); start the demo with --{self.kind}-model PATH"
            )
        return model


def default_preview(image: ModelSlot) -> str:
    """The preview the tab's radio starts on: the model's own ("tiny", a fitted decoder, for the
    embedded model), else "latent" (also for a provider, which loads later).

    Example:
        >>> from multistream.testing import ScriptedImageModel
        >>> default_preview(ModelSlot("image", ScriptedImageModel()))
        'latent'
    """
    return str(getattr(image.model, "default_preview", "latent"))


def check_view(view: LiveView) -> None:
    """Raise the stream's error (an ``error`` event) as a page error."""
    if view.error is not None:
        raise gr.Error(f"{view.error.get('type')}: {view.error.get('message')}")


def image_kwargs(steps: float, seed: float | None, preview: str, every: float, quality: float,
                 side: float) -> dict[str, Any]:
    """The image model's ``stream()`` options from the page's controls (numbers come as floats).

    Example:
        >>> image_kwargs(20, -1, "latent", 1, 75, 256)["seed"] is None    # -1: a random seed
        True
    """
    if preview not in PREVIEW_MODES:
        raise gr.Error(f"preview must be one of {list(PREVIEW_MODES)}, got {preview!r}")
    return {
        "steps": int(steps),
        "seed": None if seed is None or int(seed) < 0 else int(seed),
        "preview": preview,
        "preview_every": int(every),
        "preview_format": "jpeg",
        "preview_quality": int(quality),
        "preview_max_side": int(side),
    }


def data_url(ev: ImageEvent | VideoEvent) -> str:
    """The frame inline (``data:`` URL): no file per frame in Gradio's cache, no request per frame."""
    return f"data:{ev.mime};base64,{base64.b64encode(ev.data).decode('ascii')}"


def preview_html(view: LiveView | None, elem: str, note: str = "") -> str:
    """The live preview box: the newest frame (or the final image), a progress bar and a step line.

    Example:
        >>> 'id="ms-image-preview-box"' in preview_html(None, "ms-image-preview")
        True
    """
    frame = view.images.get(0) if view is not None else None
    if frame is None:
        queued = view.queue_note() if view is not None else ""  # on a busy server: its place in the queue
        return progress_box(elem, None, 0.0, queued or "waiting", queued or note or "the preview appears here")
    ev = frame.ev
    pct = 100.0 * ev.step / ev.total_steps if ev.total_steps else 100.0
    kb = len(ev.data) / 1024
    if frame.final:
        secs = ((ev.metrics or {}).get("duration_ms") or ev.t * 1000) / 1000
        line = (f"{ending_words(ev.finish_reason)} · {ev.step}/{ev.total_steps} steps in {secs:.2f} s · final "
                f"{ev.width}x{ev.height} {ev.mime.split('/')[-1].upper()} ({kb:.1f} KB)")
    else:
        # The time left, when the event says (eta_s: image events of models that estimate it).
        eta = getattr(ev, "eta_s", None)
        left = f" · about {eta:.1f} s left" if isinstance(eta, (int, float)) else ""
        line = (f"step {ev.step}/{ev.total_steps}{left} · {ev.t:.2f} s · preview {ev.width}x{ev.height} "
                f"({kb:.1f} KB)")
    if note:
        line = f"{note} · {line}"
    return progress_box(elem, ev, pct, line)


def progress_box(elem: str, picture: ImageEvent | VideoEvent | None, pct: float, line: str, empty: str = "") -> str:
    """The live preview box: a picture (an image frame, or a clip's preview of every frame) or the
    ``empty`` note, a progress bar at ``pct`` percent and a status line.

    Example:
        >>> 'waiting' in progress_box("ms-x", None, 0.0, "waiting", "the preview appears here")
        True
    """
    side = PREVIEW_SIDE_PX
    box = (
        f"width:{side}px;height:{side}px;border-radius:10px;background:#e5e7eb;display:flex;"
        "align-items:center;justify-content:center;overflow:hidden;color:#6b7280;font-size:14px"
    )
    if picture is None:
        body = f'<div style="{box}">{html.escape(empty)}</div>'
    else:
        body = (
            f'<div style="{box}"><img class="ms-frame" alt="step {picture.step}" src="{data_url(picture)}" '
            f'style="width:{side}px;height:{side}px;object-fit:contain"/></div>'
        )
    return (
        f'<div id="{elem}-box" style="display:flex;flex-direction:column;gap:6px;width:{side}px">{body}'
        f'<div style="height:4px;border-radius:2px;background:rgba(127,127,127,.25)">'
        f'<div style="height:4px;border-radius:2px;width:{pct:.0f}%;background:#f97316"></div></div>'
        f'<div class="ms-step" style="font-size:13px;font-variant-numeric:tabular-nums">{html.escape(line)}</div></div>'
    )


def image_outputs(view: LiveView, elem: str, frames: list[str], keep_strip: bool,
                  note: str = "") -> tuple[str, Any, str]:
    """(preview box, final picture or None, strip of frames so far) for one update of an image run.

    With ``keep_strip``, each new preview frame is appended to ``frames`` (at most ``STRIP_MAX``).
    """
    frame = view.images.get(0)
    final_img = frame.ev.image if frame is not None and frame.final else None
    if keep_strip and frame is not None and not frame.final and len(frames) < STRIP_MAX:
        frames.append(
            f'<img src="{data_url(frame.ev)}" title="step {frame.ev.step}" '
            'style="display:inline-block;width:64px;height:64px;object-fit:cover;margin:2px;border-radius:4px"/>'
        )
    # Only ever appended to, so Gradio's streaming diff sends just the new <img> each update.
    return preview_html(view, elem, note), final_img, "".join(frames)
