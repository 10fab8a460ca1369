"""Where the repository's parts are, for a test in any folder of the suite.

Example:
    >>> from repo_paths import ARTIFACTS, ROOT
    >>> (ROOT / "pyproject.toml").is_file()
    True
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: tests/ is one level below it
ARTIFACTS = ROOT / "artifacts"  # screenshots and logs the browser tests leave for people to look at


def suite_path() -> str:
    """A PYTHONPATH for a subprocess that imports this checkout and the suite's modules as the tests
    do (``--text-model test_restart:restart_text_model``): the root, tests/ and each folder of it."""
    tests = ROOT / "tests"
    folders = [ROOT, tests, *sorted(p.parent for p in tests.rglob("test_*.py"))]
    unique = list(dict.fromkeys(str(folder) for folder in folders))
    return os.pathsep.join(p for p in [*unique, os.environ.get("PYTHONPATH", "")] if p)
