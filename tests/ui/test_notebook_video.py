"""ms.show() on video streams: every frame's preview updated per step, then the clip in a <video>."""

from __future__ import annotations

import base64
import io
import os
import re
from pathlib import Path

import pytest

import multistream as ms
import multistream.ui.notebook as nb
from multistream.events import VideoEvent
from multistream.testing import ScriptedTextModel, ScriptedVideoModel
from multistream.ui.view import LiveView

from repo_paths import ROOT


def _data_urls(html: str, mime: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(rf'src="data:{re.escape(mime)};base64,([^"]+)"', html)]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_view_keeps_the_newest_preview_then_the_clip() -> None:
    vm = ScriptedVideoModel(steps=3, num_frames=4, size=16)
    view = LiveView()
    for ev in vm.stream("a red circle moving right"):
        view.apply(ev)
        if not ev.is_final:
            assert view.videos[0].ev is ev and not view.videos[0].final
    assert view.videos[0].final and view.videos[0].ev.mime == "video/webm"
    assert 1 <= view.frames <= 3 and not view.images


def test_show_video_updates_the_animated_preview_then_plays_the_clip(fake_jupyter: list[str]) -> None:
    vm = ScriptedVideoModel(steps=5, num_frames=6, size=16, delay_s=0.02)
    final = ms.show(vm.stream("a green square moving up on a black background"), max_fps=1000)
    assert isinstance(final, VideoEvent) and final.mime == "video/webm"
    previews = [h for h in fake_jupyter if "data:image/webp;base64," in h]
    assert previews  # how many depends on the reader's pace; each holds the newest step
    steps = [int(re.search(r"step (\d)/5 · 6 frames", h).group(1)) for h in previews]  # type: ignore[union-attr]
    assert steps == sorted(steps)
    for step, html in zip(steps, previews):
        assert html.count("<img") == 1 and "<video" not in html  # replaced in place, not appended
        (data,) = _data_urls(html, "image/webp")
        ev = VideoEvent(stream_id="s", seq=0, t=0.0, step=step, total_steps=5, num_frames=6, fps=8, width=16,
                        height=16, mime="image/webp", data=data)
        assert len(ev.frames) == 6  # the animated preview holds every frame
    last = fake_jupyter[-1]
    assert "<video" in last and "loop" in last and "<img" not in last and "streaming" not in last
    (clip,) = _data_urls(last, "video/webm")
    assert clip == final.data
    assert "done · 6 frames 16x16 at 8 fps · 5/5 steps · video/webm" in last


def test_show_video_contact_sheet_preview(fake_jupyter: list[str]) -> None:
    vm = ScriptedVideoModel(steps=2, num_frames=4, size=16)
    ms.show(vm.stream("a red circle", preview_format="sheet"), max_fps=1000)
    assert any("data:image/jpeg;base64," in h for h in fake_jupyter)


def test_show_video_chain_shows_the_written_prompt_and_the_clip(fake_jupyter: list[str]) -> None:
    llm = ScriptedTextModel(["a red circle ", "moving left"])
    vm = ScriptedVideoModel(steps=2, num_frames=4, size=16)
    final = ms.show(ms.chain(llm.stream("x"), lambda f: vm.stream(f.text)), max_fps=1000)
    assert isinstance(final, VideoEvent) and final.is_final
    assert "a red circle moving left" in fake_jupyter[-1] and "data:video/webm" in fake_jupyter[-1]


def test_show_video_prints_progress_then_a_summary_on_a_terminal() -> None:
    out = _Tty()
    final = ms.show(ScriptedVideoModel(steps=3, num_frames=4, size=16).stream("a red circle"), file=out,
                    max_fps=1000)
    text = out.getvalue()
    # The first preview it reads is always drawn (a slow reader may read step 3 first).
    assert re.search(r"\r\x1b\[K\[video 0: step [123]/3, (estimating time left|about [\d.]+ s left)\]", text), text
    assert text.endswith("[video 0: done · 4 frames 16x16 at 8 fps · 3/3 steps · video/webm · "
                         f"{final.metrics['duration_ms'] / 1000:.2f} s]\n")


def test_show_video_in_a_log_prints_only_the_summary() -> None:
    out = io.StringIO()
    ms.show(ScriptedVideoModel(steps=3, num_frames=4, size=16).stream("a red circle"), file=out)
    assert out.getvalue().startswith("[video 0: done · 4 frames") and "step 1/3" not in out.getvalue()


def test_notebook_kernel_runs_show_on_a_video_stream(tmp_path: Path) -> None:
    """A real kernel (nbclient): the cell's one output is updated in place per step, then holds the clip."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import multistream as ms\n"
        "from multistream.testing import ScriptedVideoModel\n"
        "vm = ScriptedVideoModel(steps=4, num_frames=6, size=32, delay_s=0.05)\n"
        "final = ms.show(vm.stream('a red circle moving right on a blue background'), max_fps=100)\n"
        "print(final.mime, len(final.frames))")])
    updates: list[str] = []
    env_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=180,
                                     resources={"metadata": {"path": str(tmp_path)}})
    original = client.process_message

    def record(msg: dict, cell: object, cell_index: int) -> object:
        if msg["header"]["msg_type"] == "update_display_data":
            updates.append(msg["content"]["data"].get("text/html", ""))
        return original(msg, cell, cell_index)

    client.process_message = record  # type: ignore[method-assign]
    # The kernel imports this checkout's multistream (a kernel is a fresh process).
    client.execute(env={**os.environ, "PYTHONPATH": env_path})
    outputs = notebook.cells[0].outputs
    assert not [o for o in outputs if o.output_type == "error"], outputs
    assert any(o.output_type == "stream" and "video/webm 6" in o.text for o in outputs)
    assert any("data:image/webp;base64," in u for u in updates)  # previews, updated in place
    assert "<video" in updates[-1] and "data:video/webm;base64," in updates[-1]
    displayed = [o for o in outputs if o.output_type == "display_data"]
    assert len(displayed) == 1 and "<video" in displayed[0]["data"]["text/html"]  # one area, now the clip


@pytest.mark.model
def test_show_a_real_video_model(fake_jupyter: list[str]) -> None:
    """A real `VideoModel` (a tiny random Wan 2.1 pipeline): previews of every frame, then the clip."""
    from multistream.testing._random_video import tiny_wan_pipeline
    from multistream.video import load_video_model

    vm = load_video_model(tiny_wan_pipeline(), defaults={"num_frames": 9, "height": 16, "width": 16})
    try:
        final = ms.show(vm.stream("a red circle moving right", steps=3, preview="latent"), max_fps=1000)
    finally:
        vm.close()
    assert isinstance(final, VideoEvent) and final.finish_reason == "stop" and len(final.frames) == 9
    assert any("data:image/webp;base64," in h and "9 frames" in h for h in fake_jupyter)
    assert "<video" in fake_jupyter[-1] and "9 frames 16x16" in fake_jupyter[-1]


def test_show_a_cancelled_clip_ends_on_its_newest_preview(fake_jupyter: list[str]) -> None:
    vm = ScriptedVideoModel(steps=200, num_frames=4, size=16, delay_s=0.01)
    stream = vm.stream("a red circle")
    for ev in stream:
        if not ev.is_final:
            stream.cancel()
    html = nb._render_html(_view_of(stream.final), 256)  # type: ignore[arg-type]
    assert stream.final.finish_reason == "cancelled" and "<video" not in html  # type: ignore[union-attr]
    assert "data:image/webp;base64," in html and "cancelled · 4 frames" in html


def _view_of(ev: VideoEvent) -> LiveView:
    view = LiveView()
    view.apply(ev)
    return view
