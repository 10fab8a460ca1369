"""Declared dependencies (issue 26, item 1): every import in multistream/ is declared in pyproject.toml,
deptry fails on one that is not, and the optional extras are reached only through their layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from repo_paths import ROOT

pytest.importorskip("deptry")


def _deptry(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deptry", "multistream", "--no-ansi"], cwd=root,
                          capture_output=True, text=True, timeout=120)


def test_every_import_of_the_package_is_declared() -> None:
    result = _deptry(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def _project_copy(tmp_path: Path, pyproject: str, module: str) -> Path:
    (tmp_path / "pyproject.toml").write_text(pyproject)
    (tmp_path / "multistream").mkdir()
    (tmp_path / "multistream" / "__init__.py").write_text(module)
    return tmp_path


def test_an_undeclared_import_fails(tmp_path: Path) -> None:
    # greenlet is what the image engine needs and what a fresh install lacked before it was declared.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"greenlet>=3",' in pyproject
    root = _project_copy(tmp_path, pyproject.replace('"greenlet>=3",', ""), "from greenlet import getcurrent\n")
    result = _deptry(root)
    assert result.returncode == 1
    assert "DEP003 'greenlet' imported but it is a transitive dependency" in result.stdout + result.stderr


def test_a_missing_package_and_a_test_only_package_fail(tmp_path: Path) -> None:
    root = _project_copy(tmp_path, (ROOT / "pyproject.toml").read_text(),
                         "import not_a_package_anywhere\nimport pytest\n")
    out = _deptry(root)
    text = out.stdout + out.stderr
    assert out.returncode == 1
    assert "DEP001 'not_a_package_anywhere'" in text
    assert "DEP004 'pytest' imported but declared as a dev dependency" in text


def test_the_families_import_no_optional_extra() -> None:
    # The base API (text, image, engine, composition) must not need the server, demo, notebook or
    # scale extras: those are imported only by server/, ui/ and the command line's subcommands.
    extras = ["fastapi", "starlette", "uvicorn", "sse_starlette", "pydantic", "prometheus_client", "gradio",
              "IPython", "redis", "ray", "httpx"]
    code = ("import sys\nimport multistream as ms, multistream.text, multistream.image, multistream.engine, "
            "multistream.compose, multistream.stream, multistream.events\n"
            f"print(sorted(m for m in {extras!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    command = readme.split("```bash\n", 1)[1].splitlines()[1]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command == ci
    assert "deptry multistream" in command and "python scripts/check_readme.py" in command

