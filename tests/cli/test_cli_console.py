"""What the command line shows (issue 26, item 5): `--out o.png` is a file, the libraries' import-time
notices are filtered (real warnings kept), progress bars only on a terminal."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from multistream.cli._console import (
    LibraryNoticeFilter,
    loading_notice,
    quiet_library_notices,
    set_library_progress,
    show_progress,
)
from multistream.cli.image import out_target

from repo_paths import ROOT
from terminal import on_a_terminal


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_out_with_an_image_suffix_is_the_final_file() -> None:
    assert out_target("o.png", None) == (None, "o.png", "png")
    assert out_target("a/b.JPG", None) == (None, "a/b.JPG", "jpeg")
    assert out_target("o.webp", "webp") == (None, "o.webp", "webp")
    assert out_target("out", None) == ("out", None, "png")
    assert out_target("out.d", "jpeg") == ("out.d", None, "jpeg")
    assert out_target(None, None) == (None, None, "png")
    with pytest.raises(ValueError, match="--final-format is jpeg"):
        out_target("o.png", "jpeg")


def test_cli_out_png_writes_that_file_and_no_notices(tmp_path: Path) -> None:
    # A subprocess: the notices come at transformers' import, which this test process has done already.
    target = tmp_path / "sub" / "o.png"
    out = subprocess.run([sys.executable, "-m", "multistream", "image", "a red circle on a blue background",
                          "--steps", "3", "--seed", "0", "--out", str(target)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert target.is_file() and Image.open(target).format == "PNG" and Image.open(target).size == (64, 64)
    assert list(target.parent.iterdir()) == [target]  # no folder named o.png, no previews beside it
    assert "torchvision" not in out.stderr, out.stderr
    assert "Loading pipeline components" not in out.stderr  # not a terminal: no bars
    assert f"-> {target}" in out.stderr


def test_loading_the_image_and_video_models_in_python_prints_no_torchvision_notice_and_no_bars() -> None:
    """The library's own loaders drop transformers' notice about torchvision (an optional backend of
    image processors multistream never uses), as the command line does: a newcomer's Python snippet,
    server log and notebook printed two of them on every image or video model load. And the embedded
    models, which load in a fraction of a second, draw no loading bars; the libraries' own setting
    is back afterwards."""
    code = ("import multistream as ms; ms.load_image_model(); ms.load_video_model()\n"
            "import diffusers.utils.logging as d, transformers.utils.logging as t\n"
            "print('loaded', d.is_progress_bar_enabled(), t.is_progress_bar_enabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "loaded True True" in out.stdout, out.stderr[-2000:]
    assert "torchvision" not in out.stderr, out.stderr
    assert "Loading pipeline components" not in out.stderr and "Loading weights" not in out.stderr, out.stderr


def test_cli_out_jpg_is_a_jpeg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from multistream.cli import main

    target = tmp_path / "o.jpg"
    assert main(["image", "x", "--steps", "2", "--seed", "0", "--out", str(target)]) == 0
    assert Image.open(target).format == "JPEG"
    assert main(["image", "x", "--steps", "2", "--out", str(tmp_path / "p.png"), "--final-format", "webp"]) == 2
    assert "drop --final-format" in capsys.readouterr().err


def test_the_filter_drops_only_the_notices() -> None:
    quiet_library_notices()
    quiet_library_notices()  # idempotent
    logger = logging.getLogger("transformers.utils.import_utils")
    assert sum(isinstance(f, LibraryNoticeFilter) for f in logger.filters) == 1
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        logger.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to ...")
        logger.warning("a real problem: the tokenizer file is damaged")
    finally:
        logger.removeHandler(handler)
    assert seen == ["a real problem: the tokenizer file is damaged"]


def test_progress_bars_only_on_a_terminal() -> None:
    from transformers.utils import logging as hf_logging

    assert show_progress(_Tty()) is True
    assert show_progress(io.StringIO()) is False
    before = hf_logging.is_progress_bar_enabled()
    try:
        set_library_progress(True)
        assert hf_logging.is_progress_bar_enabled()
        set_library_progress(False)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        set_library_progress(before)


def test_loading_notice_on_a_terminal_only_and_erased_even_when_the_load_fails() -> None:
    tty = _Tty()
    with loading_notice("the embedded text model"):  # stderr is pytest's capture here: not a terminal
        pass
    with loading_notice("'my/model'", tty):
        assert tty.getvalue() == "loading 'my/model'..."
    assert tty.getvalue() == "loading 'my/model'...\r\x1b[2K"  # erased: the answer takes the line
    failed = _Tty()
    with pytest.raises(OSError), loading_notice("x", failed):
        raise OSError("no such file")
    assert failed.getvalue().endswith("\r\x1b[2K")  # the error message then starts on a clean line
    piped = io.StringIO()
    with loading_notice("x", piped):
        pass
    assert piped.getvalue() == ""  # nothing in a log or a pipe


@pytest.mark.model
def test_cli_text_says_the_model_is_loading_on_a_terminal_then_the_answer_takes_the_line() -> None:
    # A warm load still takes seconds (its libraries' imports): a newcomer saw a blank terminal.
    rc, seen = on_a_terminal(["text", "Hi", "--max-new-tokens", "4", "--seed", "0"])
    assert rc == 0, seen
    assert seen.startswith("loading the embedded text model (SmolLM2-135M-Instruct)..."), seen[:300]
    erased = seen.index("\r\x1b[2K")
    assert "[4 tokens, TTFT" in seen[erased:], seen  # the summary line comes after the erase
