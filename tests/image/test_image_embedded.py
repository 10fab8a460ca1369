"""The embedded shapes model (multistream/_models/shapes), loaded offline with no argument."""

from __future__ import annotations

import numpy as np
import pytest

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from test_image import Lockstep, one_thread  # noqa: F401

import multistream as ms
from multistream.image import EMBEDDED_MODEL_DIR

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        not (EMBEDDED_MODEL_DIR / "model_index.json").is_file(), reason="the embedded image model is not installed"
    ),
]

PROMPT = "a red circle on a blue background"


def _run(model: ms.ImageModel, preview: str, steps: int = 12) -> list:
    lock = Lockstep()
    return lock.events(model.stream(PROMPT, steps=steps, seed=0, preview=preview, preview_format="png",
                                    callback_on_step_end=lock.callback))  # fmt: skip


def _distances(events: list) -> list[float]:
    final = events[-1].image.convert("RGB")
    out = []
    for ev in events[:-1]:
        preview = ev.image.convert("RGB")
        target = np.asarray(final.resize(preview.size, resample=2), dtype=np.float32)  # bilinear
        out.append(float(np.abs(np.asarray(preview, dtype=np.float32) - target).mean()))
    return out


def test_loads_offline_with_its_latent_rgb(shapes: ms.ImageModel) -> None:
    assert shapes.latent_rgb.source.startswith("file:") and shapes.latent_rgb.channels == shapes.latent_channels
    assert shapes.default_size == (64, 64)


def test_streams_previews_and_a_64px_final(shapes: ms.ImageModel) -> None:
    events = _run(shapes, "latent")
    previews, final = events[:-1], events[-1]
    assert [e.step for e in previews] == list(range(1, len(previews) + 1)) and len(previews) >= 12
    assert all(e.total_steps == len(previews) for e in previews)
    assert final.is_final and final.finish_reason == "stop" and final.mime == "image/png"
    assert final.image.size == (final.width, final.height) == (64, 64)


def test_previews_approach_the_final_image(shapes: ms.ImageModel) -> None:
    noisy = _distances(_run(shapes, "vae"))
    latent, x0, x0_vae = _distances(_run(shapes, "latent")), _distances(_run(shapes, "x0")), _distances(_run(shapes, "x0+vae"))
    # The decoded noisy latent walks to the final image, step after step (the first, noisiest
    # steps may wobble once).
    assert sum(after >= before for before, after in zip(noisy, noisy[1:])) <= 1, noisy
    assert noisy[-1] < 0.1 * noisy[0]
    # At the first step the noisy latent is mostly noise; the model's estimate already shows the scene.
    assert x0[0] < 0.75 * latent[0]
    # The estimates converge too, though at high noise (and guidance 7.5) they swing from step to step.
    half = len(x0_vae) // 2
    assert x0_vae[-1] < 0.25 * x0_vae[0]
    assert sum(x0_vae[half:]) / (len(x0_vae) - half) < sum(x0_vae[:half]) / half


def test_x0_previews_converge_on_the_final_image(shapes: ms.ImageModel) -> None:
    """The README's example: ``preview="x0"`` shows the model's estimate through the best cheap
    decoder it has (the shipped fitted one), so the previews end on the final image. Through the
    linear map they stopped near 28/255 away and drifted off again over the last steps."""
    lock = Lockstep()
    events = lock.events(shapes.stream(PROMPT, steps=20, seed=0, preview="x0", preview_format="png",
                                       preview_max_side=None, callback_on_step_end=lock.callback))  # fmt: skip
    assert [e.step for e in events[:-1]] == list(range(1, 21)) and events[-1].finish_reason == "stop"
    distances = _distances(events)  # mean absolute difference from the final image, 0-255
    third = len(distances) // 3
    first, middle, last = distances[:third], distances[third:-third], distances[-third:]
    # Falling over the run: each third closer than the one before, and a negative trend throughout.
    assert sum(last) / len(last) < sum(middle) / len(middle) < sum(first) / len(first), distances
    steps = np.arange(len(distances))
    assert np.polyfit(steps, distances, 1)[0] < 0, distances
    # Settling: over the last quarter it never moves away again (beyond rounding of the pixels).
    tail = distances[-len(distances) // 4 :]
    assert all(b <= a + 0.5 for a, b in zip(tail, tail[1:])), distances
    assert distances[-1] <= 12, distances


def test_a_long_prompt_is_one_short_warning_of_ours() -> None:
    """A prompt longer than the CLIP text encoder reads (22 tokens on the embedded model) printed
    transformers' length warning and diffusers' notice quoting the whole cut text (10.8 KB for
    2,400 tokens). Now it is one line on the "multistream" logger; the libraries' notices are
    dropped only for our own pipeline call: the user's own call of the same pipeline still warns."""
    import os
    import subprocess
    import sys

    from repo_paths import ROOT

    code = (
        "import sys, multistream as ms\n"
        "sd = ms.load_image_model(device='cpu')\n"
        "long = ' '.join(['red circle blue background'] * 600)\n"
        "final = sd.generate(long, steps=2, seed=0)\n"
        "assert final.finish_reason == 'stop'\n"
        "print('--- the user calls the pipeline', file=sys.stderr, flush=True)\n"
        "sd.pipeline.encode_prompt(long, 'cpu', 1, False)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, _, users = proc.stderr.partition("--- the user calls the pipeline\n")
    lines = [line for line in ours.splitlines() if line.strip()]
    assert lines == ["prompt is 2400 tokens; the image model reads the first 22 (the rest is ignored)"], ours[:3000]
    assert max(len(line) for line in lines) <= 300
    assert "truncated because CLIP can only handle sequences up to 24 tokens" in users


def test_the_final_reports_a_large_seed_exactly(shapes: ms.ImageModel) -> None:
    """``metrics["seed"]`` was a float, which is not exact above 2**53 (seeds up to 2**63 are taken)."""
    seed = 2**62 + 1
    final = shapes.generate("a red circle", steps=1, seed=seed, preview="none")
    assert final.metrics["seed"] == seed and isinstance(final.metrics["seed"], int)
    assert ms.event_from_dict(final.to_dict()).metrics["seed"] == seed  # and on the wire
