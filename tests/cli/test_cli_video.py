"""``multistream video``: the clip, the contact sheet, the previews, the progress line, checks before load.

The command runs for real in a subprocess; its model is a scripted one (the seam
`multistream.cli.video.load_model`), so these tests need no weights and stay fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from repo_paths import ROOT

# Runs the real command line with a scripted video model in place of the embedded one.
_RUNNER = """
import sys
import multistream.cli.video as video
from multistream.cli import main
from multistream.testing import ScriptedVideoModel

def load_model(name, device):
    if name is not None:
        raise SystemExit(f"unexpected --model {name}")
    return ScriptedVideoModel(steps=6, num_frames=8, size=32, delay_s=0.02)

video.load_model = load_model
sys.exit(main(sys.argv[1:]))
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", _RUNNER, "video", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)


def _frames(path: Path) -> list[Image.Image]:
    import av

    with av.open(str(path)) as container:
        return [f.to_image() for f in container.decode(video=0)]


def test_video_writes_the_clip_and_the_sheet(tmp_path: Path) -> None:
    out = _run(tmp_path, "a red circle moving right on a blue background", "--out", "sub/clip.webm",
               "--sheet", "sheet.jpg", "--seed", "0")
    assert out.returncode == 0, out.stderr
    clip, sheet = tmp_path / "sub" / "clip.webm", tmp_path / "sheet.jpg"
    frames = _frames(clip)
    assert len(frames) == 8 and frames[0].size == (32, 32)
    assert Image.open(sheet).format == "JPEG" and Image.open(sheet).size == (3 * 32, 3 * 32)  # ceil(sqrt(8)) a row
    lines = out.stderr.strip().splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    # One line per preview it read (a slow reader skips to the newest), the last step always among them.
    assert progress and progress[-1].startswith("step 6/6") and all("ms/step" in line for line in progress)
    assert "eta 0.0 s" in progress[-1]
    assert lines[-1].startswith("done: 8 frames 32x32 at 8 fps, video/webm, 6 steps")
    assert lines[-1].endswith("finish: stop -> sub/clip.webm, sheet.jpg")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["clip.webm", "sheet.jpg", "sub"]  # no temporary files left


def test_mp4_suffix_makes_an_mp4_and_previews_go_to_a_folder(tmp_path: Path) -> None:
    out = _run(tmp_path, "a red circle moving left", "--out", "clip.mp4", "--previews", "steps",
               "--preview-format", "sheet", "--steps", "3")
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "clip.mp4", "rb") as fh:
        assert fh.read(12)[4:8] == b"ftyp"  # an MP4 container
    assert len(_frames(tmp_path / "clip.mp4")) == 8
    previews = sorted(p.name for p in (tmp_path / "steps").iterdir())
    # A slow reader gets the newest preview only, so a step may be missing; the last is always there.
    assert set(previews) <= {"step_001.jpg", "step_002.jpg", "step_003.jpg"} and "step_003.jpg" in previews
    assert Image.open(tmp_path / "steps" / "step_003.jpg").size == (3 * 32, 3 * 32)  # a contact sheet of 8 frames


def test_default_out_and_json(tmp_path: Path) -> None:
    out = _run(tmp_path, "a red circle", "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "multistream-video.webm").is_file()
    out = _run(tmp_path, "a red circle", "--steps", "2", "--json")
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["type"] for e in events] == ["video"] * len(events) and events[-1]["is_final"]
    assert events[-1]["mime"] == "video/webm" and events[-1]["data"]


@pytest.mark.parametrize(("args", "message"), [
    (["--out", "clip.gif"], "--out clip.gif: .gif is not a format this command writes; give a video file ending in .mp4, .webm"),
    (["--out", "c.webm", "--sheet", "s.bmp"], "--sheet s.bmp: .bmp is not a format this command writes"),
    (["--steps", "0"], "--steps"),
    (["--preview", "fancy"], "--preview"),
    # The embedded model's sizes are known without loading it (a newcomer's --width 100 waited 7 s).
    # Named by its flag first, as every other refused option is, and in the command line's spelling.
    (["--width", "100"], "multistream video: --width 100 is not a multiple of 16: this model makes sides that "
     "are multiples of 16 from 16 to 128 pixels, native 64x64"),
    (["--width", "100"], "; use e.g. --width 96 or 112"),
    (["--height", "1000"], "multistream video: --height 1000 is above 128"),
])
def test_bad_arguments_are_refused_before_the_model_loads(args: list[str], message: str,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import multistream.cli.video as video
    from multistream.cli import main

    loaded: list[str] = []
    monkeypatch.setattr(video, "load_model", lambda *a: loaded.append("loaded"))
    assert main(["video", "a red circle", *args]) == 2 and not loaded
    assert message in capsys.readouterr().err


def test_video_is_a_subcommand() -> None:
    from multistream.cli import build_parser

    args = build_parser().parse_args(["video", "a red circle", "--out", "c.mp4"])
    assert args.command == "video" and args.out == "c.mp4"


@pytest.mark.model
def test_video_command_on_a_real_diffusers_pipeline_folder(tmp_path: Path) -> None:
    """The command as a user runs it, on a real `VideoModel`: a tiny random Wan 2.1 pipeline saved
    as a folder, its ``video.json`` giving the defaults (as the embedded model's does)."""
    from multistream.testing._random_video import tiny_wan_pipeline

    folder = tmp_path / "wan"
    tiny_wan_pipeline().save_pretrained(folder)
    (folder / "video.json").write_text(json.dumps({"num_frames": 9, "height": 16, "width": 16, "steps": 3}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "multistream", "video", "a red circle moving right", "--model",
                          str(folder), "--device", "cpu", "--preview", "latent", "--out", "clip.mp4", "--sheet",
                          "sheet.png"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert len(_frames(tmp_path / "clip.mp4")) == 9
    assert Image.open(tmp_path / "sheet.png").size == (3 * 16, 3 * 16)
    lines = out.stderr.strip().splitlines()
    assert any(line.startswith("step 3/3") for line in lines)
    assert lines[-1].startswith("done: 9 frames 16x16") and "video/mp4, 3 steps" in lines[-1]
