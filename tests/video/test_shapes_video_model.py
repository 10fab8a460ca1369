"""Moving-shapes clips, their judge, and the embedded text-to-video model trained on them (issue 33)."""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import pytest

from multistream._shapes import (
    COLORS,
    MOTIONS,
    SHAPES,
    Clip,
    Scene,
    all_video_words,
    all_words,
    clip_caption,
    draw_clip,
    judged_video_prompts,
    make_clip_dataset,
    parse_prompt,
    parse_video_prompt,
    sample_clip,
)
from multistream._shapes._judge import classify_shape, judge_clip, to_frames

from repo_paths import ROOT

MODELS = ROOT / "multistream" / "_models"
MODEL_DIR = MODELS / "shapes_video"

# --- data ----------------------------------------------------------------------------------


def test_clip_dataset_is_deterministic_and_covers_everything() -> None:
    a, ca = make_clip_dataset(6, seed=3)
    b, cb = make_clip_dataset(6, seed=3)
    c, _ = make_clip_dataset(6, seed=4)
    assert a.shape == (6, 16, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and ca == cb and not np.array_equal(a, c)
    _, clips = make_clip_dataset(300, seed=0, num_frames=2)
    assert {c.motion for c in clips} == set(MOTIONS)
    assert {c.scene.shape for c in clips} == set(SHAPES)
    assert {c.scene.color for c in clips} == set(COLORS)
    assert {c.scene.size_word for c in clips} == {"small", "large"}


def test_clip_moves_at_constant_velocity_and_stays_inside() -> None:
    rng = np.random.default_rng(1)
    for motion, (dx, dy) in MOTIONS.items():
        for _ in range(10):
            clip = sample_clip(rng, motion=motion)
            assert 0.2 <= clip.travel <= 0.5 + 1e-9
            centers = np.array([(clip.at(i / 15).cx, clip.at(i / 15).cy) for i in range(16)])
            steps = np.diff(centers, axis=0)
            assert np.allclose(steps, steps[0]) and np.allclose(steps[0], np.array([dx, dy]) * clip.travel / 15)
            r = clip.scene.r
            assert (centers - r >= 0).all() and (centers + r <= 1).all()
            frames = np.stack([np.asarray(f) for f in draw_clip(clip, num_frames=16)]).astype(int)
            # The shape stays whole in every frame: its area barely changes along the clip.
            bg = np.array(clip.scene.background_rgb)
            area = (np.abs(frames - bg).sum(-1) > 30).sum(axis=(1, 2))
            assert area.min() >= 0.93 * area.max()
            if clip.scene.shape != "triangle":
                # Its border is background. (A triangle is 1.15x wider than its radius and the
                # margin is sample_scene's, so its base corners may graze the side borders,
                # exactly as in the image data.)
                edges = np.concatenate([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], axis=1)
                assert np.abs(edges - bg).max() <= 1


def test_captions_and_parse() -> None:
    scene = Scene("star", "yellow", "black", 0.3, 0.5, 0.2)
    clip = Clip(scene, "moving right", 0.3)
    assert clip_caption(clip, detail=0) == "a yellow star moving right on a black background"
    assert clip_caption(clip, detail=1) == "a small yellow star moving right on a black background"
    assert parse_video_prompt("A Red circle, moving UP on a blue background!") == (
        "circle",
        "red",
        "blue",
        "moving up",
    )
    assert parse_video_prompt("a green square on a white background") == ("square", "green", "white", None)
    # The image parser is unchanged and ignores the motion.
    assert parse_prompt("a red circle moving left on a blue background") == ("circle", "red", "blue")
    rng = np.random.default_rng(2)
    for _ in range(40):
        c = sample_clip(rng)
        text = clip_caption(c, rng)
        assert parse_video_prompt(text) == (c.scene.shape, c.scene.color, c.scene.background, c.motion)
    assert set(all_words()) < set(all_video_words())
    assert {"moving", "up", "down"} <= set(all_video_words())


def test_bad_clip_arguments_name_the_problem() -> None:
    scene = Scene("circle", "red", "blue", 0.5, 0.5, 0.2)
    with pytest.raises(ValueError, match="unknown motion 'moving sideways'"):
        Clip(scene, "moving sideways", 0.2)
    with pytest.raises(ValueError, match="unknown motion"):
        sample_clip(np.random.default_rng(0), motion="spinning")
    with pytest.raises(ValueError, match="at least 2"):
        draw_clip(Clip(scene, "moving up", 0.2), num_frames=1)


# --- the judge -----------------------------------------------------------------------------


def test_judge_is_right_on_every_drawn_colour_shape_and_motion() -> None:
    rng = np.random.default_rng(5)
    names = list(COLORS)
    n = 0
    for ci, color in enumerate(names):
        for si, shape in enumerate(SHAPES):
            for motion in MOTIONS:
                background = names[(ci + si + 1) % len(names)]
                clip = sample_clip(rng, shape=shape, color=color, background=background, motion=motion)
                v = judge_clip(draw_clip(clip), clip_caption(clip, rng))
                assert v.ok, (clip, v)
                assert (v.color, v.shape, v.background, v.motion) == (color, shape, background, motion)
                assert v.visible == 1.0
                n += 1
    assert n == len(COLORS) * len(SHAPES) * len(MOTIONS)


def test_judge_rejects_what_the_clip_does_not_show() -> None:
    clip = sample_clip(np.random.default_rng(0), shape="circle", color="red", background="blue", motion="moving up")
    frames = draw_clip(clip)
    right = judge_clip(frames, "a red circle moving up on a blue background")
    assert right.ok and right.displacement[1] < 0
    assert judge_clip(frames, "a red circle moving down on a blue background").motion_ok is False
    assert judge_clip(frames, "a green circle moving up on a blue background").color_ok is False
    assert judge_clip(frames, "a red star moving up on a blue background").shape_ok is False
    assert judge_clip(frames, "a red circle moving up on a white background").background_ok is False
    # Played backwards it moves down; a still clip does not move at all.
    assert judge_clip(frames[::-1], "a red circle moving down").ok
    still = judge_clip([frames[0]] * 16, "a red circle moving up")
    assert still.motion is None and still.motion_ok is False and still.color_ok
    # What the prompt does not name is not judged.
    silent = judge_clip(frames, "something")
    assert (silent.color_ok, silent.shape_ok, silent.motion_ok, silent.background_ok) == (None,) * 4
    assert silent.ok and silent.motion == "moving up"


def test_judge_reads_pil_uint8_and_float_frames() -> None:
    clip = sample_clip(np.random.default_rng(3), motion="moving left")
    pil = draw_clip(clip)
    u8 = to_frames(pil)
    assert u8.shape == (16, 64, 64, 3) and u8.dtype == np.uint8
    prompt = clip_caption(clip, detail=0)
    verdicts = [judge_clip(x, prompt) for x in (pil, u8, u8.astype(np.float32) / 255, u8[None] / 255.0)]
    assert all(v.ok for v in verdicts)
    assert len({v.displacement for v in verdicts}) == 1
    with pytest.raises(ValueError, match=r"\(F, H, W, 3\)"):
        judge_clip(np.zeros((16, 64, 64)), prompt)


def test_classify_shape_on_plain_masks() -> None:
    yy, xx = np.mgrid[:40, :40]
    assert classify_shape(np.ones((12, 12), bool))[0] == "square"
    assert classify_shape((xx - 20) ** 2 + (yy - 20) ** 2 <= 15**2)[0] == "circle"
    assert classify_shape((yy >= 5) & (yy <= 35) & (np.abs(xx - 20) <= (yy - 5) * 0.58))[0] == "triangle"
    assert classify_shape(np.zeros((8, 8), bool)) == (None, 0.0)


# --- the shipped model ---------------------------------------------------------------------


def _need_model() -> None:
    if not MODEL_DIR.exists():
        pytest.skip("model not trained yet: run scripts/train_shapes_video_model.py")


def test_model_folder_is_small_and_safetensors_only() -> None:
    _need_model()
    files = [f for f in MODEL_DIR.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 20 * 1024 * 1024
    assert {f.suffix for f in files} <= {".safetensors", ".json", ".txt"}
    for sub in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (MODEL_DIR / sub).is_dir()
    index = json.loads((MODEL_DIR / "model_index.json").read_text())
    assert index["_class_name"] == "AnimateDiffPipeline"
    assert index["unet"] == ["diffusers", "UNetMotionModel"]
    video = json.loads((MODEL_DIR / "video.json").read_text())
    assert set(video) == {"num_frames", "fps", "steps", "guidance_scale", "width", "height"}
    assert video["num_frames"] >= 16 and (video["width"], video["height"]) == (64, 64)
    # Same VAE as the image model, so its latent-to-RGB preview map is the image model's.
    assert (MODEL_DIR / "latent_rgb.json").read_text() == (MODELS / "shapes" / "latent_rgb.json").read_text()
    # No path of the machine that trained it (diffusers records where a part was loaded from).
    for config in MODEL_DIR.rglob("*.json"):
        assert "_name_or_path" not in json.loads(config.read_text()), config


def test_tokenizer_extends_the_image_vocabulary() -> None:
    _need_model()
    transformers = pytest.importorskip("transformers")
    image = transformers.AutoTokenizer.from_pretrained(MODELS / "shapes" / "tokenizer").get_vocab()
    video = transformers.AutoTokenizer.from_pretrained(MODEL_DIR / "tokenizer").get_vocab()
    assert all(video[w] == i for w, i in image.items())
    assert set(all_video_words()) <= set(video)


@pytest.fixture(scope="module")
def pipe():
    _need_model()
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    diffusers.utils.logging.set_verbosity_error()
    p = diffusers.DiffusionPipeline.from_pretrained(MODEL_DIR)
    p.set_progress_bar_config(disable=True)
    assert type(p).__name__ == "AnimateDiffPipeline" and p.unet.dtype == torch.float32
    return p


@functools.cache
def _shipped_prior():
    """The shipped folder's prior, one for the module as VideoModel keeps one per model (its mean clips cached)."""
    from multistream.video._motion_prior import MotionPrior

    return MotionPrior.from_folder(MODEL_DIR)


# Clips per pipeline call. One call of 8 computes the 8 clips its prompts make one at a time (the
# seeds draw the same noise; the frames agree within 1e-4, checked below: 3e-6 at 20 steps and
# 2.5e-5 at 6 measured here) in far fewer torch ops, which matters here: beside another test
# worker on a 2-core machine, each op's threads wait on the other process, and 4 clips took 79 s
# one at a time against 29 s in one call (6 steps each).
_CLIPS_PER_CALL = 8


def _clips(pipe, prompts: list[str], seeds: list[int], steps: int = 20, prior: bool = True, **kw) -> list[np.ndarray]:
    """The clips the shipped folder makes, with its motion prior as `VideoModel` applies it, one per prompt."""
    import torch

    from multistream.video._layout import VideoLatents

    video = json.loads((MODEL_DIR / "video.json").read_text())
    size = {"num_frames": video["num_frames"], "height": video["height"], "width": video["width"]}
    layout = VideoLatents.of(pipe)
    clips: list[np.ndarray] = []
    for start in range(0, len(prompts), _CLIPS_PER_CALL):
        batch = list(prompts[start:start + _CLIPS_PER_CALL])
        generators = [torch.Generator().manual_seed(s) for s in seeds[start:start + _CLIPS_PER_CALL]]
        call = dict(kw)
        if prior:
            latents = [_shipped_prior().initial_latents(layout, pipe.scheduler, p, generator=g, **size)
                       for p, g in zip(batch, generators)]
            if any(x is not None for x in latents):
                assert all(x is not None for x in latents), "a call's prompts all name a motion, or none does"
                call["latents"] = torch.cat(latents)
        out = pipe(batch, num_inference_steps=steps, guidance_scale=video["guidance_scale"], generator=generators,
                   output_type="np", **size, **call)
        clips.extend(out.frames)
    return clips


def _clip(pipe, prompt: str, seed: int = 0, steps: int = 20, prior: bool = True, **kw) -> np.ndarray:
    """The clip the shipped folder makes for one prompt."""
    return _clips(pipe, [prompt], [seed], steps, prior, **kw)[0]


judged_prompts = judged_video_prompts


def test_judged_prompts_cover_the_vocabulary() -> None:
    parsed = [parse_video_prompt(p) for p in judged_prompts()]
    assert len(set(judged_prompts())) == 24
    assert {p[0] for p in parsed} == set(SHAPES)
    assert {p[1] for p in parsed} == set(COLORS)
    assert {p[3] for p in parsed} == set(MOTIONS)
    assert all(p[1] != p[2] for p in parsed)


@pytest.mark.model
def test_model_is_deterministic_and_tolerates_odd_prompts(pipe) -> None:
    a = _clip(pipe, "a red circle moving up on a blue background", seed=1, steps=2)
    b = _clip(pipe, "a red circle moving up on a blue background", seed=1, steps=2)
    assert a.shape == (16, 64, 64, 3) and np.array_equal(a, b)
    # In one call with another prompt it is the same clip (the tests below run their clips so).
    together = _clips(pipe, ["a green star moving left on a white background",
                             "a red circle moving up on a blue background"], [2, 1], steps=2)
    assert np.abs(together[1] - a).max() < 1e-4 and np.abs(together[0] - a).max() > 0.1
    for prompt in ["", "a fluffy red dragon, flying sideways!", "ünïcödé 🙂"]:
        assert np.isfinite(_clip(pipe, prompt, steps=2)).all()


@pytest.fixture(scope="module")
def verdicts(pipe):
    prompts = judged_prompts()
    return [(p, judge_clip(clip, p)) for p, clip in zip(prompts, _clips(pipe, prompts, list(range(len(prompts)))))]


@pytest.mark.model
def test_model_clips_follow_colour_shape_and_background(verdicts) -> None:
    report = "\n".join(f"{p}: {v}" for p, v in verdicts if not v.ok)
    # Measured on the shipped weights (step 800): colour 23/24, shape 22/24, background 23/24.
    assert sum(bool(v.color_ok) for _, v in verdicts) >= 21, report
    assert sum(bool(v.shape_ok) for _, v in verdicts) >= 20, report
    assert sum(bool(v.background_ok) for _, v in verdicts) >= 21, report


@pytest.mark.model
def test_model_clips_move_as_the_prompt_says(verdicts) -> None:
    report = "\n".join(f"{p}: {v}" for p, v in verdicts if not v.motion_ok)
    assert sum(bool(v.motion_ok) for _, v in verdicts) >= 22, report


@pytest.mark.model
def test_without_the_motion_prior_the_direction_comes_from_the_noise(pipe) -> None:
    # Why the shipped folder has a motion_prior.json (multistream/video/_motion_prior.py): from
    # plain noise, one seed moves the shape the same way whatever direction the prompt names.
    # Measured with seed 3: all four "moving up" without the prior, and with it (as the judged
    # prompts above run) left, right, up and down as asked; those four clips are not made here,
    # the judged prompts' directions (test_model_clips_move_as_the_prompt_says) show the prior.
    from collections import Counter

    from multistream._shapes import MOTIONS

    prompts = [f"a red circle {m} on a blue background" for m in MOTIONS]
    plain = [judge_clip(clip, p) for p, clip in zip(prompts, _clips(pipe, prompts, [3] * 4, prior=False))]
    assert sum(bool(v.motion_ok) for v in plain) <= 2, [v.motion for v in plain]
    assert Counter(v.motion for v in plain).most_common(1)[0][1] >= 3, [v.motion for v in plain]


# --- the mid-run preview, in each preview mode ------------------------------------------------

# What the preview at step 10 of 20 shows of the first 8 judged prompts, measured on the shipped
# weights with the motion prior (`benchmarks/video_preview_judge.py` gives all 24 and prints
# these): (colour, shape, background, direction of motion) right. Colour, shape and background are
# the lower of two CPUs' counts; motion was measured on one (a 2-core AMD EPYC with AVX2).
# Halfway, the model has settled the colours and the motion but often not yet the shape (the full
# VAE's own preview gets 5 shapes of 8); the noisy latent (`"latent"`) shows little of either. The
# bars are each mode's measured counts less one.
MID_RUN_MEASURED = {"tiny": (6, 5, 6, 7), "vae": (6, 5, 7, 8), "x0": (2, 4, 6, 7), "latent": (4, 3, 2, 3)}


@pytest.fixture(scope="module")
def after_step_9(video_model) -> list:
    """A checkpoint after step 9 of 20 of each of the first 8 judged prompts' runs.

    Each preview mode resumes from these instead of denoising the same nine steps again: the steps
    do not depend on the preview mode, and a resumed run gives the same step 10 as a whole one
    (`multistream.diffusion._checkpoint`, tested in tests/video/test_video_checkpoint.py).
    """
    saved = []
    for i, prompt in enumerate(judged_prompts()[:8]):
        got: list = []
        reached = threading.Event()

        def keep(checkpoint, got=got, reached=reached) -> None:
            got.append(checkpoint)
            reached.set()

        stream = video_model.stream(prompt, seed=i, steps=20, preview="none", on_checkpoint=keep, checkpoint_every=9)
        try:
            assert reached.wait(120), "no checkpoint after step 9"
        finally:
            stream.cancel()
            stream.join(30)
        assert got[0].step == 9
        saved.append(got[0])
    return saved


def _preview_at_step_10(model, prompt: str, seed: int, mode: str, checkpoint):
    stream = model.stream(prompt, seed=seed, steps=20, preview=mode, preview_every=9,  # previews at 1, 10, 19
                          resume_from=checkpoint)
    try:
        for ev in stream:
            if not ev.is_final and ev.step == 10:
                return ev
        raise AssertionError(f"no step-10 preview in mode {mode}")
    finally:
        stream.cancel()


@pytest.mark.model
@pytest.mark.parametrize("mode", list(MID_RUN_MEASURED))
def test_the_mid_run_preview_already_shows_the_prompt(video_model, after_step_9, mode: str) -> None:
    prompts = judged_prompts()[:8]
    verdicts = [
        judge_clip(_preview_at_step_10(video_model, p, i, mode, after_step_9[i]).frames, p)
        for i, p in enumerate(prompts)
    ]
    got = tuple(sum(bool(getattr(v, f"{k}_ok")) for v in verdicts) for k in ("color", "shape", "background", "motion"))
    assert all(g >= m - 1 for g, m in zip(got, MID_RUN_MEASURED[mode])), (mode, got)


def test_more_frames_than_the_motion_modules_hold_are_refused_at_call_time(video_model) -> None:
    """33 frames ran into diffusers' positional table (32 rows) in the first step and ended the
    stream with a bare tensor-size error; now the call refuses, naming the limit, and the command
    line and OpenAI's ``seconds`` know it before anything runs."""
    from multistream.errors import InvalidArgumentError
    from multistream.server.http.problems import Problem
    from multistream.server.openai.videos.protocol import VideoFormat, parse_video_create
    from multistream.video import EMBEDDED_VIDEO_MAX_FRAMES

    assert video_model.max_num_frames == EMBEDDED_VIDEO_MAX_FRAMES == 32
    with pytest.raises(InvalidArgumentError, match="num_frames=33 is more than this model takes: .* at most 32"):
        video_model.stream("a red circle moving right on a blue background", num_frames=33)
    final = video_model.generate("a red circle moving right on a blue background", num_frames=32, steps=1)
    assert final.num_frames == 32 and len(final.frames) == 32
    fmt = VideoFormat.of(video_model)
    with pytest.raises(Problem) as caught:  # 8 s at 8 fps: 64 frames
        parse_video_create({"prompt": "p", "seconds": "8"}, fmt)
    assert caught.value.status == 400 and caught.value.param == "seconds"
    assert "64 frames at this model's 8 fps, more than the 32 it makes (4 seconds); ask for seconds <= 4" in caught.value.message
    assert parse_video_create({"prompt": "p", "seconds": "4"}, fmt)[1]["num_frames"] == 32


def test_a_long_prompt_is_one_short_warning_of_ours(video_model, caplog) -> None:
    """As for images: a prompt past the CLIP encoder's 22 tokens is one line of ours, and
    diffusers' notice quoting the cut text is dropped for our own call of the pipeline."""
    import logging

    notices: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notices.append(record)

    # A handler on the logger the notice comes from sees what that logger's filters let through.
    library = [logging.getLogger(type(video_model.pipeline).encode_prompt.__module__),
               logging.getLogger("transformers.tokenization_utils_base")]
    keep = Keep()
    filters_before = [list(logger.filters) for logger in library]
    for logger in library:
        logger.addHandler(keep)
    try:
        with caplog.at_level(logging.WARNING, logger="multistream"):
            final = video_model.generate(" ".join(["red circle blue background"] * 600), steps=2, seed=0,
                                         preview="none")
    finally:
        for logger in library:
            logger.removeHandler(keep)
    assert final.finish_reason == "stop"
    ours = [r.getMessage() for r in caplog.records if r.name == "multistream"]
    assert ours == ["prompt is 2400 tokens; the video model reads the first 22 (the rest is ignored)"]
    assert notices == []
    assert [list(logger.filters) for logger in library] == filters_before  # quieted for the call only


def test_the_final_reports_a_large_seed_exactly(video_model) -> None:
    """``metrics["seed"]`` was a float: a seed above 2**53 (any up to 2**63 is taken) came back as
    another number, so re-running with the reported seed gave another clip."""
    seed = 2**62 + 1
    final = video_model.generate("a red circle", steps=1, seed=seed, preview="none")
    assert final.metrics["seed"] == seed and isinstance(final.metrics["seed"], int)
