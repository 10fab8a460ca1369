"""Keys kept out of the logs: ``api_key=`` and ``token=`` values are blanked in uvicorn's and the
server's log lines (uvicorn's access log prints URLs, and a resume URL may carry a key).

Example:
    >>> install_log_redaction()
"""

from __future__ import annotations

import logging
import re

__all__ = ["install_log_redaction"]

_SECRET_QUERY = re.compile(r"((?:api_key|token)=)[^&\s\"]*", re.IGNORECASE)


class _RedactSecrets(logging.Filter):
    """Blank ``api_key=`` and ``token=`` values in log lines (uvicorn's access log prints URLs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(_SECRET_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str) and ("api_key=" in record.msg or "token=" in record.msg):
            record.msg = _SECRET_QUERY.sub(r"\1***", record.msg)
        return True


def install_log_redaction() -> None:
    for name in ("uvicorn.access", "uvicorn.error", "multistream.server"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _RedactSecrets) for f in log.filters):
            log.addFilter(_RedactSecrets())
