"""The README's openai SDK block, run as a reader runs it: in a plain ``python`` process, against a
real server with the embedded text and image models (check_readme skips the block: it needs a
server, which this test starts)."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from repo_paths import ROOT
from server_fixtures import make_server

pytestmark = pytest.mark.model

README_URL = "http://127.0.0.1:8000"


def readme_openai_block() -> str:
    """The README's python block that imports the openai SDK."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    found = [b for b in blocks if "from openai import OpenAI" in b]
    assert len(found) == 1, f"expected one openai SDK block in the README, found {len(found)}"
    return found[0]


def test_the_readmes_openai_block_streams_text_and_partial_images(text_model: Any) -> None:
    import multistream as ms

    code = readme_openai_block()
    assert README_URL in code
    with ms.load_image_model() as image_model, make_server(text_model, image_model) as srv:
        out = subprocess.run([sys.executable, "-c", code.replace(README_URL, srv.url)], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].strip(), out.stdout  # the streamed haiku
    kinds = [line.split()[0] for line in lines[1:]]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"], out.stdout
