"""The command line's output paths: checked before any model loads, written atomically.

A newcomer's ``speak --out missing/x.wav`` or ``text --speak x.xyz`` failed only after the audio (or
the whole answer) was made; ``image --out final.gif`` silently became a folder. So every output
flag is checked when the command starts (`check_output_file`, `check_output_folder`): the suffix
names a format the command writes, the path is a file or a folder as the flag means, and the
nearest existing folder above it can be written in (folders missing below it are made when the
file is written, as ``image --out new/o.png`` always did). And every file is written through a
temporary file in the same folder, moved over the target with `os.replace` (atomic on POSIX and
Windows), so a Ctrl-C, a full disk or a crash never leaves a half-written file: the target is the
old file or the new one (`atomic_write`, `atomic_path`, from `multistream._atomic`).

Example:
    >>> import tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> check_output_file(os.path.join(folder, "a.wav"), "--out", {".wav": "wav"}, "an audio file")
    'wav'
    >>> atomic_write(os.path.join(folder, "a.wav"), b"RIFF")
    >>> sorted(os.listdir(folder))
    ['a.wav']
"""

from __future__ import annotations

import mimetypes
import os
import tempfile
from collections.abc import Mapping

from .._atomic import WriteError, atomic_path, atomic_write
from ..errors import InvalidArgumentError

__all__ = ["WriteError", "atomic_path", "atomic_write", "check_input_folder", "check_output_file",
           "check_output_folder", "looks_like_a_file"]




def _suffixes(formats: Mapping[str, str]) -> str:
    return ", ".join(sorted(formats))


def _check_parent(path: str, what: str) -> None:
    """The nearest existing folder above ``path`` is a folder this process can write in; ``what``
    starts the error message (the flag and the path as given)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    if not os.path.isdir(parent):
        raise InvalidArgumentError(f"{what}: {parent} is a file, not a folder; choose a path in a folder")
    _probe(parent, what)


def _probe(folder: str, what: str) -> None:
    """Create (and at once remove) a file in ``folder``: the one test of writability that holds for
    root, read-only mounts and special file systems alike, where `os.access` can say yes."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InvalidArgumentError(f"{what}: cannot write in {folder} ({reason}); choose a folder you can write in") \
            from None


# Media types, and a few document types, that name a file whatever the context: a folder flag given
# one of them is a mistake (``--out o.txt``), while a folder named ``out.d`` or ``images.old`` (their
# suffixes have MIME types too) is a folder.
_FILE_TYPES = ("image/", "video/", "audio/", "text/plain", "text/csv", "text/html", "application/json",
               "application/pdf", "application/zip")


def looks_like_a_file(path: str) -> bool:
    """Whether ``path``'s suffix names a media or document file by the system's MIME table
    (``final.gif``, ``a.bmp``, ``clip.mp4``, ``o.txt``), so a flag that takes a folder can tell a
    file name from a folder name (``out``, ``out.d``, ``run-2``).

    Example:
        >>> [looks_like_a_file(p) for p in ("final.gif", "o.txt", "clip.mp4", "out.d", "runs", "run.2")]
        [True, True, True, False, False, False]
    """
    mime = mimetypes.guess_type(os.path.basename(path))[0] or ""
    return mime.startswith(_FILE_TYPES)


def check_output_file(path: str, flag: str, formats: Mapping[str, str], what: str, *,
                      default: str | None = None) -> str:
    """The format ``path`` will be written in (from its suffix, a key of ``formats``), or
    `InvalidArgumentError` naming the problem and the fix; ``default`` is the format of a path
    without a suffix (None: a suffix is required).

    Example:
        >>> check_output_file("t.xyz", "--out", {".wav": "wav", ".mp3": "mp3"}, "an audio file")
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: --out t.xyz: .xyz is not a format this command writes; give an audio file ending in .mp3, .wav
    """
    if not path:
        raise InvalidArgumentError(f"{flag} is empty; give {what} ending in {_suffixes(formats)}")
    suffix = os.path.splitext(path)[1].lower()
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise InvalidArgumentError(f"{flag} {path} is a folder; give {what} (e.g. {os.path.join(path, 'out')}"
                                   f"{next(iter(formats))})")
    if suffix in formats:
        fmt = formats[suffix]
    elif not suffix and default is not None:
        fmt = default
    else:
        what_suffix = f"{suffix} is not a format this command writes" if suffix else "the file name has no suffix"
        raise InvalidArgumentError(f"{flag} {path}: {what_suffix}; give {what} ending in {_suffixes(formats)}")
    _check_parent(path, f"{flag} {path}")
    return fmt


def check_output_folder(path: str, flag: str, file_hint: str = "") -> None:
    """``path`` is (or can be made as) a folder this process can write in."""
    if not path:
        raise InvalidArgumentError(f"{flag} is empty; give a folder name")
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(f"{flag} {path} is an existing file, not a folder; give a folder name"
                                   + (f" {file_hint}" if file_hint else ""))
    if os.path.isdir(path):
        _probe(path, f"{flag} {path}")
        return
    if looks_like_a_file(path):
        raise InvalidArgumentError(f"{flag} {path}: {os.path.splitext(path)[1]} names a file, and this flag takes a "
                                   "folder; give a folder name" + (f" {file_hint}" if file_hint else ""))
    _check_parent(os.path.join(path, "x"), f"{flag} {path}")


def check_input_folder(path: str | None, flag: str) -> None:
    """An input folder the command will read (e.g. ``--taesd``) exists."""
    if path is not None and not os.path.isdir(path):
        raise InvalidArgumentError(f"{flag} {path}: no such folder; give the folder that holds the files")


