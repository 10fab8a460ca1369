"""The content filter: a hook over prompts and the *accumulated* output, with a hold-back window.

A filter that saw each delta alone would let a banned word through when the model writes it in
two tokens ("sec" + "ret"). `OutputFilter` runs the hook over the whole text so far and holds
back the last ``holdback`` characters (as `multistream.text._stop_strings.StopMatcher` holds back a
possible stop string) until more text shows what they become; at the end everything is released.
An event whose text the filter changed loses its ``token_ids`` (they no longer match the text).

`Blocklist` is a ready hook: words or phrases, case-insensitive, replaced by asterisks.

Example:
    >>> f = OutputFilter(Blocklist(["secret"]), holdback=8)
    >>> [f.feed(d)[0] for d in ["the sec", "ret is", " out"]] + [f.finish()]
    ['', 'the *', '****', '* is out']
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Union

from ...errors import InvalidArgumentError

__all__ = ["STOP", "Blocklist", "ContentFilter", "OutputFilter", "load_blocklist"]


class _Stop:
    """Return `STOP` from a content filter to end the stream with ``finish_reason="content_filter"``."""

    _instance: _Stop | None = None

    def __new__(cls) -> _Stop:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "STOP"


STOP = _Stop()

# fn(text, part) -> replacement text, None (unchanged) or STOP. part is "prompt" (each prompt or
# chat message) or "output" (all the output so far; called again as it grows).
ContentFilter = Callable[[str, str], Union[str, None, _Stop]]


class Blocklist:
    """A content filter that masks words or phrases, case-insensitively, wherever they appear.

    Example:
        >>> Blocklist(["secret", "top secret"])("My Top Secret plan", "output")
        'My ********** plan'
    """

    def __init__(self, phrases: Iterable[str]) -> None:
        self.phrases = sorted({p.strip().lower() for p in phrases if p.strip()}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(p) for p in self.phrases), re.IGNORECASE) if self.phrases else None

    @property
    def holdback(self) -> int:
        """Characters to hold back so a phrase split across events is caught."""
        return max((len(p) for p in self.phrases), default=1) - 1

    def __call__(self, text: str, part: str) -> str | None:
        if self._pattern is None:
            return None
        return self._pattern.sub(lambda m: "*" * len(m.group(0)), text)


def load_blocklist(path: str) -> Blocklist:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the blocklist {path!r}: {exc.strerror}") from None
    return Blocklist(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def chain(*filters: ContentFilter | None) -> ContentFilter | None:
    """One filter that runs each in turn (STOP wins)."""
    active = [f for f in filters if f is not None]
    if not active:
        return None
    if len(active) == 1:
        return active[0]

    def run(text: str, part: str) -> str | _Stop | None:
        out = text
        for f in active:
            r = f(out, part)
            if r is STOP:
                return STOP
            if isinstance(r, str):
                out = r
        return out

    run.holdback = max(getattr(f, "holdback", 0) for f in active)  # type: ignore[attr-defined]
    return run


class OutputFilter:
    """Incremental: ``feed(delta)`` -> ``(text safe to emit, stopped)``; ``finish()`` -> the rest."""

    def __init__(self, hook: ContentFilter, holdback: int = 32) -> None:
        self.hook = hook
        # The hook may say how much it needs (a blocklist: its longest phrase); never less than asked.
        self.holdback = max(0, int(holdback), int(getattr(hook, "holdback", 0) or 0))
        self.raw = ""
        self.emitted = ""
        self.stopped = False

    def _run(self) -> str | None:
        try:
            out = self.hook(self.raw, "output")
        except Exception:  # noqa: BLE001 - a failing filter fails closed
            import logging

            logging.getLogger("multistream.server").exception("the content filter raised; stopping the stream")
            out = STOP
        if out is STOP:
            self.stopped = True
            return None
        return self.raw if out is None else str(out)

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.raw += delta
        filtered = self._run()
        if filtered is None:
            return "", True
        if not filtered.startswith(self.emitted):
            # The filter changed text already sent (its phrase was longer than the hold-back):
            # it cannot be taken back, so end the stream rather than leak the rest.
            self.stopped = True
            return "", True
        end = len(filtered) if final else max(len(self.emitted), len(filtered) - self.holdback)
        out = filtered[len(self.emitted):end]
        self.emitted += out
        return out, False

    def rewind(self, offset: int) -> int:
        """The model rewound its output to character ``offset``: forget the text from there on.

        Returns where the client's text is now cut (at most what was emitted). Filters that keep
        lengths (a blocklist masks with as many asterisks) keep the positions exact.
        """
        offset = max(0, offset)
        self.raw = self.raw[:offset]
        self.emitted = self.emitted[:offset]
        return len(self.emitted)

    def finish(self) -> str:
        """Release what was held back (call at the end of the output)."""
        out, _ = self.feed("", final=True)
        return out

    @property
    def text(self) -> str:
        return self.emitted
