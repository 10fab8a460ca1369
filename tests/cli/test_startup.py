"""Start-up work that is ours to avoid: the command line does not import the server to build its
flags, and a plain load of the embedded model prints no "Loading weights" bar. (How long start-up
takes is a benchmark figure: benchmarks/startup.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from repo_paths import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_the_text_command_does_not_import_the_server() -> None:
    pytest.importorskip("fastapi")
    # sys.modules, not -X importtime: a module's lazy __getattr__ imports with importlib, which
    # importtime does not log.
    code = ("import sys; from multistream.cli import build_parser; build_parser().parse_args(['text', 'hi']); "
            "print(' '.join(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = set(proc.stdout.split())
    assert "multistream.server.settings" in imported  # the serve flags are still built from ServerSettings
    assert not {"multistream.server.app", "fastapi", "starlette", "uvicorn"} & imported


@pytest.mark.model
def test_loading_the_embedded_model_prints_no_progress_bar(text_model) -> None:
    # text_model: the session's load has written the caches, so this load is a warm one.
    code = "import multistream as ms; llm = ms.load_text_model(); print(llm.quantization.mode)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "int4"
    assert "Loading weights" not in proc.stderr, proc.stderr[-2000:]


def test_the_serve_flags_name_every_family_of_the_server() -> None:
    """`multistream serve` spells the families' names (so that building the parser does not import the
    server); they are the names of the server's family table."""
    from multistream.cli.serve import FAMILY_NAMES
    from multistream.server.families import FAMILIES

    assert FAMILY_NAMES == tuple(f.name for f in FAMILIES)


def test_the_text_command_does_not_import_diffusers() -> None:
    """`multistream text` switches transformers' progress bars only: importing diffusers' logging
    module imports diffusers (about 0.3 s of a start-up beyond what transformers imports)."""
    # The load is a stand-in that fails: what is imported before it is the command's own doing.
    code = ("import sys, multistream.text as t; from multistream.errors import ModelLoadError\n"
            "def load(*a, **k): raise ModelLoadError('stand-in')\n"
            "t.load_text_model = load; from multistream.cli import main\n"
            "print(main(['text', 'hi']), 'diffusers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr[-2000:])


@pytest.mark.model
def test_the_text_command_on_the_embedded_model_imports_no_transformers(text_model) -> None:
    """A warm ``multistream text`` (the embedded model converted already) imports no transformers:
    neither the load (`EmbeddedTokenizer`, `KVCache`) nor the command's progress-bar set-up, which
    imported it to switch bars that a warm load never shows (0.6 s of a 2.2 s command)."""
    code = ("import sys; from multistream.cli import main; "
            "rc = main(['text', 'Hi', '--max-new-tokens', '2'], own_process=True); "
            "print(rc, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["0", "False"], proc.stdout + proc.stderr[-2000:]
