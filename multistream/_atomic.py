"""Files written whole: through a temporary file in the same folder, moved over the target with
`os.replace` (atomic on POSIX and Windows), so a Ctrl-C, a full disk or a crash never leaves a
half-written file: the target holds the old content or all of the new. The command line's outputs
and the events' ``save`` both write this way.

Example:
    >>> import tempfile, os
    >>> target = os.path.join(tempfile.mkdtemp(), "new", "a.bin")
    >>> atomic_write(target, b"RIFF")
    >>> os.listdir(os.path.dirname(target))
    ['a.bin']
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator

from .errors import MultistreamError

__all__ = ["WriteError", "atomic_path", "atomic_write"]


class WriteError(MultistreamError, OSError):
    """An output file could not be written (a full disk, a folder removed during the run); the
    target is left as it was."""


_PART = ".part"  # the temporary files' suffix; they start with "." so a folder listing hides them


def _mode() -> int:
    """The permissions a new file gets (0o666 less the umask), as `open` would give it;
    `tempfile` makes 0o600 files, which `os.replace` would keep."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path beside ``path`` to write to; moved over ``path`` when the block ends
    without an error, removed when it raises (Ctrl-C included), so ``path`` is never half written.

    Example:
        >>> import tempfile, os
        >>> target = os.path.join(tempfile.mkdtemp(), "d.bin")
        >>> with atomic_path(target) as tmp:
        ...     _ = open(tmp, "wb").write(b"x")
        >>> open(target, "rb").read()
        b'x'
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=_PART)
        os.close(fd)
    except OSError as exc:
        raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        yield tmp
        os.chmod(tmp, os.stat(path).st_mode & 0o7777 if os.path.exists(path) else _mode())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, MultistreamError):
            raise WriteError(f"cannot write {path}: {exc.strerror or exc} (left as it was)") from exc
        raise


def atomic_write(path: str, data: bytes | Iterable[bytes]) -> None:
    """Write ``data`` (bytes, or chunks of them) to ``path`` through a temporary file in the
    same folder and `os.replace`: ``path`` holds the old content or all of the new, never a part."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            fh.write(chunk)
    # No fsync: what this guards against is the process stopping (Ctrl-C, a crash, a full disk),
    # after which the kernel still holds every byte written; an fsync per preview would cost a
    # disk flush per denoising step.
