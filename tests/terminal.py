"""Run ``multistream`` with stderr on a pseudo-terminal: what a user at a terminal sees.

Example:
    >>> from terminal import on_a_terminal
    >>> rc, seen = on_a_terminal(["--help"])            # doctest: +SKIP
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from repo_paths import ROOT


def on_a_terminal(args: list[str], timeout: float = 300) -> tuple[int, str]:
    """``python -m multistream ARGS`` with stderr on a 120-column pseudo-terminal (stdout discarded);
    returns its exit status and every byte it wrote there, decoded."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "multistream", *args], stderr=slave, stdout=subprocess.DEVNULL,
                            env=env)  # fmt: skip
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    return proc.wait(timeout), seen.decode(errors="replace")
