"""The procedural shapes data and the embedded text-to-image model built from it (issue 4)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from multistream._shapes import (
    COLORS,
    SHAPES,
    caption,
    draw_scene,
    make_dataset,
    parse_prompt,
    sample_scene,
)

from repo_paths import ROOT

MODEL_DIR = ROOT / "multistream" / "_models" / "shapes"


# --- dataset -------------------------------------------------------------------------------


def test_dataset_is_deterministic_from_seed() -> None:
    a, sa = make_dataset(16, seed=3)
    b, sb = make_dataset(16, seed=3)
    c, _ = make_dataset(16, seed=4)
    assert a.shape == (16, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and sa == sb
    assert not np.array_equal(a, c)


def test_dataset_covers_vocabulary() -> None:
    assert len(COLORS) >= 6 and set(SHAPES) >= {"circle", "square", "triangle", "star"}
    _, scenes = make_dataset(400, seed=0)
    assert {s.shape for s in scenes} == set(SHAPES)
    assert {s.color for s in scenes} == set(COLORS)
    assert all(s.color != s.background for s in scenes)


def _nearest(rgb: np.ndarray) -> str:
    return min(COLORS, key=lambda c: float(np.sum((np.array(COLORS[c]) - rgb) ** 2)))


def test_captions_match_what_is_drawn() -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        scene = sample_scene(rng)
        img = np.asarray(draw_scene(scene)).astype(float)
        # The shape's center pixel has its color (stars and triangles are solid there too);
        # the image corner farthest from the shape has the background's.
        cx, cy = int(scene.cx * 64), int(scene.cy * 64)
        corner = (0 if cy >= 32 else 63, 0 if cx >= 32 else 63)  # (row, col)
        assert _nearest(img[cy, cx]) == scene.color
        assert _nearest(img[corner]) == scene.background
        text = caption(scene, detail=3)
        assert parse_prompt(text) == (scene.shape, scene.color, scene.background)
        assert scene.size_word in text and scene.color in text and scene.shape in text


def test_caption_forms_and_parse_prompt() -> None:
    scene = sample_scene(
        np.random.default_rng(0), shape="star", color="yellow", background="black"
    )
    assert caption(scene, detail=0) == "a yellow star on a black background"
    assert caption(scene, detail=1).startswith(f"a {scene.size_word} yellow star")
    assert parse_prompt("A Red circle, on a BLUE background!") == (
        "circle",
        "red",
        "blue",
    )
    assert parse_prompt("a blue background with a white square") == (
        "square",
        "white",
        "blue",
    )
    assert parse_prompt("hello") == (None, None, None)
    with pytest.raises(ValueError, match="must differ"):
        sample_scene(np.random.default_rng(0), color="red", background="red")


# --- the shipped model ---------------------------------------------------------------------


def test_model_folder_is_small_and_safetensors_only() -> None:
    if not MODEL_DIR.exists():
        pytest.skip("model not trained yet: run scripts/train_shapes_model.py")
    files = [f for f in MODEL_DIR.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 15 * 1024 * 1024
    weights = [
        f for f in files if f.suffix in {".bin", ".pt", ".pth", ".ckpt", ".safetensors"}
    ]
    assert weights and all(f.suffix == ".safetensors" for f in weights)
    for sub in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (MODEL_DIR / sub).is_dir()
    index = json.loads((MODEL_DIR / "model_index.json").read_text())
    assert (
        index["safety_checker"] == [None, None]
        and index["requires_safety_checker"] is False
    )


def test_latent_rgb_json_is_shaped_right() -> None:
    if not MODEL_DIR.exists():
        pytest.skip("model not trained yet")
    data = json.loads((MODEL_DIR / "latent_rgb.json").read_text())
    vae = json.loads((MODEL_DIR / "vae" / "config.json").read_text())
    assert data["space"] == "scaled_latents_to_rgb_minus1_1"
    assert len(data["matrix"]) == vae["latent_channels"] == 4
    assert all(len(row) == 3 for row in data["matrix"]) and len(data["bias"]) == 3


@pytest.fixture(scope="module")
def pipe():
    if not MODEL_DIR.exists():
        pytest.skip("model not trained yet")
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    diffusers.utils.logging.set_verbosity_error()
    p = diffusers.StableDiffusionPipeline.from_pretrained(MODEL_DIR)
    p.set_progress_bar_config(disable=True)
    assert p.unet.dtype == torch.float32
    return p


def _run(pipe, prompt: str, seed: int = 0, steps: int = 4, **kw) -> np.ndarray:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = pipe(prompt, num_inference_steps=steps, generator=g, output_type="np", **kw)
    return out.images[0]


@pytest.mark.model
def test_model_generates_64px_deterministically(pipe) -> None:
    a = _run(pipe, "a red circle on a blue background", seed=1)
    b = _run(pipe, "a red circle on a blue background", seed=1)
    c = _run(pipe, "a red circle on a blue background", seed=2)
    assert a.shape == (64, 64, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.model
def test_model_tolerates_unknown_words_empty_and_negative_prompts(pipe) -> None:
    for prompt in [
        "a fluffy red dragon, on a blue background!",
        "",
        "ünïcödé 🙂 words",
    ]:
        img = _run(pipe, prompt, steps=2)
        assert img.shape == (64, 64, 3) and np.isfinite(img).all()
    img = _run(
        pipe,
        "a green star on a white background",
        steps=2,
        negative_prompt="blurry zebra",
    )
    assert img.shape == (64, 64, 3)


@pytest.mark.model
def test_model_follows_the_prompt_colors(pipe) -> None:
    # Cheap semantic check: the median pixel is the background, as asked.
    img = _run(pipe, "a small white square on a red background", steps=20)
    median = np.median(img.reshape(-1, 3), axis=0) * 255
    assert _nearest(median) == "red"
