"""Per-thread torch settings the engine applies to its own thread, so users need none.

torch's threading settings are process-wide or per thread; these run once on each engine thread,
before its first step: inference only (no autograd bookkeeping on any tensor the engine makes).
"""

from __future__ import annotations

import torch

__all__ = ["engine_thread_setup"]


def engine_thread_setup() -> None:
    """Called on the engine thread before its first step."""
    torch.set_grad_enabled(False)
