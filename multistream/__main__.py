"""``python -m multistream`` is the ``multistream`` command."""

from __future__ import annotations

import sys

from .cli import entry

sys.exit(entry())
