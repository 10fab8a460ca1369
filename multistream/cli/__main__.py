"""``python -m multistream.cli`` is the ``multistream`` command (as ``python -m multistream`` is)."""

from __future__ import annotations

import sys

from . import entry

sys.exit(entry())
