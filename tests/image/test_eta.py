"""``eta_s`` on image events: the estimated seconds left, from the request's own step times.

The estimator is checked on a scripted clock (deterministic); the real embedded model's stream,
the wire form, the command line's progress bar and the notebook's progress line are checked as
users meet them. Also here: ``multistream fit-preview`` uses the embedded model's shipped
decoder instead of fitting one, and its fit reports progress at a useful grain.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest
from test_image import Lockstep, one_thread  # noqa: F401

import multistream as ms
from multistream._eta import PerPixelTime, StepEta
from multistream.errors import EventFormatError
from multistream.image import EMBEDDED_MODEL_DIR
from multistream.testing import ScriptedImageModel

from repo_paths import ROOT

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from terminal import on_a_terminal

PROMPT = "a red circle on a blue background"

needs_embedded = pytest.mark.skipif(not (EMBEDDED_MODEL_DIR / "model_index.json").is_file(),
                                    reason="the embedded image model is not installed")


# --- the estimator ----------------------------------------------------------------------------


def test_eta_is_unknown_before_two_steps_then_counts_down() -> None:
    eta = StepEta()
    eta.step(1, 10.0)
    assert eta.eta(9) is None
    left = []
    for step in range(2, 11):
        eta.step(step, 10.0 + 0.5 * (step - 1))
        left.append(eta.eta(10 - step, tail_s=0.2))
    assert left == [pytest.approx(0.5 * (10 - s) + 0.2) for s in range(2, 11)]
    assert left == sorted(left, reverse=True) and left[-1] == pytest.approx(0.2)


def test_eta_ignores_one_slow_step_and_follows_a_lasting_change() -> None:
    eta = StepEta(window=5)
    now = 0.0
    for step in range(1, 7):
        now += 5.0 if step == 4 else 1.0  # one step 5x slower (another request's step, a busy moment)
        eta.step(step, now)
    assert eta.eta(10) == pytest.approx(10.0)  # the median of 1, 1, 5, 1, 1 is 1
    for step in range(7, 10):
        now += 2.0  # a second request joined: every step now takes twice the wall time
        eta.step(step, now)
    assert eta.eta(10) == pytest.approx(20.0)


def test_eta_spreads_an_interval_over_steps_not_seen() -> None:
    eta = StepEta()
    eta.step(3, 0.0)
    eta.step(7, 2.0)  # steps 4..7 in 2 s (a resume or a skipped callback)
    assert eta.eta(4) == pytest.approx(2.0)


def test_decode_time_scales_with_pixels() -> None:
    timer = PerPixelTime()
    assert timer.estimate(100) is None
    timer.record(64 * 64, 0.08)
    assert timer.estimate(128 * 128) == pytest.approx(0.32)


# --- the wire form ----------------------------------------------------------------------------


def _image_event(**extra) -> ms.ImageEvent:
    return ms.ImageEvent(stream_id="s", seq=3, t=0.25, step=4, total_steps=20, width=8, height=8,
                         mime="image/jpeg", data=b"\xff\xd8", **extra)  # fmt: skip


@pytest.mark.parametrize("eta", [1.875, 0.0, None])
def test_eta_round_trips_through_the_wire_form(eta: float | None) -> None:
    ev = _image_event(eta_s=eta)
    wire = ev.to_dict()
    assert ("eta_s" in wire) == (eta is not None) and wire.get("eta_s") == eta
    again = ms.event_from_json(json.dumps(wire))
    assert again == ev and again.eta_s == eta
    jsonschema.validate(wire, ms.event_json_schema())


def test_old_events_without_eta_still_parse_and_bad_ones_are_refused() -> None:
    wire = _image_event().to_dict()
    assert "eta_s" not in wire and ms.event_from_dict(wire).eta_s is None
    for bad in ("soon", -1.0, True):
        with pytest.raises(EventFormatError, match="'eta_s' must be a number >= 0"):
            ms.event_from_dict({**wire, "eta_s": bad})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**wire, "eta_s": -1.0}, ms.event_json_schema())
    assert ms.event_from_dict({**wire, "eta_s": 3}).eta_s == 3.0  # a JSON integer is a number too


# --- the models -------------------------------------------------------------------------------


def test_scripted_model_counts_down_too() -> None:
    model = ScriptedImageModel(steps=6, size=16, delay_s=0.01)
    events = list(model.stream("a red circle", preview_format="png"))
    previews, final = events[:-1], events[-1]
    assert previews[0].eta_s is None and all(e.eta_s is not None for e in previews[1:])
    assert final.eta_s == 0.0


@pytest.mark.model
@needs_embedded
def test_embedded_stream_carries_a_falling_eta_then_zero(shapes: ms.ImageModel) -> None:
    def run() -> list:
        lock = Lockstep()
        return lock.events(shapes.stream(PROMPT, steps=12, seed=0, callback_on_step_end=lock.callback))

    events = run()
    previews, final = events[:-1], events[-1]
    assert [e.step for e in previews] == list(range(1, 13))
    assert previews[0].eta_s is None  # one step: no step duration measured yet
    etas = [e.eta_s for e in previews[1:]]
    assert all(isinstance(v, float) and v >= 0 for v in etas)
    # Ten steps left at step 2, none at step 12: the model's first run knows no decode time yet.
    assert etas[0] > 0 and etas[-1] == 0.0
    assert final.is_final and final.eta_s == 0.0 and final.to_dict()["eta_s"] == 0.0
    # The next run of the model includes the final decode it measured: time is left at step 12.
    again = run()
    assert again[-2].step == 12 and again[-2].eta_s > 0 and again[-1].eta_s == 0.0


# --- where people see it ----------------------------------------------------------------------


@pytest.mark.model
@needs_embedded
def test_cli_shows_a_progress_bar_with_the_etaon_a_terminal(tmp_path) -> None:
    rc, seen = on_a_terminal(["image", PROMPT, "--steps", "8", "--seed", "0", "--out", str(tmp_path / "o")])
    assert rc == 0, seen
    # While the model loads (seconds, before any step) the terminal says so; the bar then takes the line.
    assert seen.startswith("loading the embedded image model..."), seen[:200]
    bars = [part for part in seen.split("\r") if part.startswith("denoising:")]
    assert any("8/8" in bar for bar in bars) and any("ETA " in bar and " s," in bar for bar in bars), seen
    assert "done: 64x64" in seen and (tmp_path / "o" / "final.png").is_file()


@pytest.mark.model
@needs_embedded
def test_cli_prints_the_eta_in_its_lines_off_a_terminal(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "multistream", "image", PROMPT, "--steps", "6", "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("step ")]
    assert lines and "eta" not in lines[0] and all(" eta " in line for line in lines[1:]), proc.stderr
    assert "\r" not in proc.stderr and "denoising:" not in proc.stderr  # no bar in a log


def test_notebook_progress_line_says_the_time_left() -> None:
    import io

    model = ScriptedImageModel(steps=5, size=16, delay_s=0.01)
    out = io.StringIO()
    out.isatty = lambda: True  # type: ignore[method-assign]
    final = ms.show(model.stream("a red circle"), file=out, max_fps=1e6)  # every event rendered
    assert final.eta_s == 0.0
    assert "estimating time left" in out.getvalue() and "s left]" in out.getvalue()


def test_notebook_html_caption_says_the_time_left() -> None:
    from multistream.ui.notebook import _render_html
    from multistream.ui.view import LiveView

    view = LiveView()
    view.apply(_image_event(eta_s=12.3))
    assert "step 4/20 · about 12 s left" in _render_html(view, 128)


# --- fit-preview ------------------------------------------------------------------------------


@needs_embedded
def test_fit_preview_uses_the_shipped_decoder_of_the_embedded_model(monkeypatch, tmp_path, capsys) -> None:
    import multistream.image._loading as loading
    from multistream import cli

    def must_not_load(*args, **kwargs):
        raise AssertionError("fit-preview loaded the model to fit a decoder it ships")

    # The package's lazy name first: read after the module's is patched, it would keep the patch.
    monkeypatch.setattr("multistream.image.load_image_model", must_not_load)
    monkeypatch.setattr(loading, "load_image_model", must_not_load)
    out = tmp_path / "dec.safetensors"
    assert cli.main(["fit-preview", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    shipped = EMBEDDED_MODEL_DIR / "preview_decoder.safetensors"
    assert "ships its preview decoder" in err and str(shipped) in err and "--force" in err
    assert out.read_bytes() == shipped.read_bytes()


@pytest.mark.model
@needs_embedded
def test_fit_reports_progress_through_its_slow_stages(shapes: ms.ImageModel) -> None:
    from multistream.diffusion._preview_decoder import collect_x0_latents, fit_preview_decoder

    steps_done: list[tuple[int, int]] = []
    x0 = collect_x0_latents(shapes.pipeline, count=2, steps=3, batch=2,
                            progress=lambda done, total: steps_done.append((done, total)), progress_steps=True)
    assert steps_done == [(2, 6), (4, 6), (6, 6)]  # every step of the batch of two runs
    reports = []
    fit_preview_decoder(shapes.pipeline.vae, num_images=16, latent_size=16, steps=2, cache=False, extra_latents=x0,
                        progress=reports.append)  # fmt: skip
    data = [(p.step, p.total) for p in reports if p.stage == "data"]
    # The decode of every training latent (70 here, in batches of 32) is most of the data stage:
    # it moves batch by batch, not in three coarse parts.
    total = 16 + 4 * 16 + len(x0)
    assert data[0] == (0, total) and data[-1] == (total, total)
    assert [s for s, _ in data] == [0, 16, 48, 80, total, total]
    assert [s for s, _ in data] == sorted(s for s, _ in data)
