"""Where multistream keeps what it converts or fits once: one cache directory for every family.

Example:
    >>> import os; os.environ["MULTISTREAM_CACHE"] = "/tmp/ms-cache"
    >>> str(cache_dir())
    '/tmp/ms-cache'
    >>> del os.environ["MULTISTREAM_CACHE"]
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Where converted models are kept: ``$MULTISTREAM_CACHE``, else ``$XDG_CACHE_HOME/multistream``,
    else ``~/.cache/multistream``."""
    explicit = os.environ.get("MULTISTREAM_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "multistream"
