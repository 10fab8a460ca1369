"""A denoising command's progress (``multistream image`` and ``multistream video``): a tqdm bar of
the steps on a terminal, showing the model's own estimate of the time left (``eta_s``: measured
step times plus the final decode) rather than tqdm's; elsewhere one status line per preview.

Example:
    >>> from multistream.cli._step_progress import StepProgress
    >>> with StepProgress() as progress:       # doctest: +SKIP
    ...     for ev in stream:
    ...         if ev.type == "image" and not ev.is_final:
    ...             progress.preview(ev)
"""

from __future__ import annotations

import sys
from typing import Any

from ._console import show_progress, status_line

__all__ = ["StepProgress"]


class StepProgress:
    """The steps of one denoising stream, shown as its previews arrive."""

    def __init__(self) -> None:
        self._bar: Any = None
        if show_progress():
            from tqdm import tqdm

            # mininterval=0: a preview comes at most once a step, and each one's step and ETA is shown.
            self._bar = tqdm(total=None, desc="denoising", unit="step", file=sys.stderr, leave=False, mininterval=0,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        self._last_t, self._last_step = 0.0, 0

    def preview(self, ev: Any) -> None:
        """Show a preview event's step, its time per step and the model's ETA."""
        # Steps between two previews may be several (preview_every, or a slow reader's skipped ones).
        ms_per_step = (ev.t - self._last_t) * 1e3 / max(1, ev.step - self._last_step)
        self._last_t, self._last_step = ev.t, ev.step
        if self._bar is None:
            eta = f"  eta {ev.eta_s:.1f} s" if ev.eta_s is not None else ""
            status_line(f"step {ev.step}/{ev.total_steps}  {ms_per_step:.0f} ms/step  {len(ev.data)} bytes{eta}")
            return
        if self._bar.total != ev.total_steps:
            self._bar.total = ev.total_steps
        eta = "ETA --" if ev.eta_s is None else f"ETA {ev.eta_s:.1f} s"
        self._bar.set_postfix_str(f"{eta}, {ms_per_step:.0f} ms/step", refresh=False)
        self._bar.update(ev.step - self._bar.n)

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
