"""How close is each preview to the final image, how early, and at what cost? (issue 10)

On the embedded shapes model, ``--prompts`` prompts x ``--seeds`` seeds at ``--steps`` steps
(the model's own scheduler and guidance). Every step of every run is previewed five ways, each
decoder built from the model through the decoder table (`multistream.diffusion._previews.DECODERS`,
the plan settled as a stream settles it):

* ``latent``: the noisy latent through the linear latent->RGB map;
* ``x0``:     the model's x0 estimate through the best cheap decoder the model has (on the
              embedded model: the shipped fitted decoder, so the same pictures as ``tiny``);
* ``x0 map``: x0 through the linear map (what ``preview="x0"`` was before it preferred a fitted
              decoder, and still is on a model without one);
* ``tiny``:   x0 through the fitted preview decoder shipped with the model (the default);
* ``vae``:    x0 through the full VAE (``preview="x0+vae"``: the best a preview can look).

The previews are compared with the final image (pixels as the stream sends them, before JPEG;
latent-sized ones are upscaled bilinearly): mean absolute error on the 0-255 scale and PSNR at
25 %, 50 %, 75 % and the last step, the error curve over all steps, and the shapes judge's
accuracy (shape colour, background colour, shape) on the 50 % previews. Then the cost: the
real ``.stream()`` with a preview every step against the bare pipeline call, interleaved runs in
this process, medians (`benchmarks/image_stream.py`'s method). Then the same fit on random-weight
VAEs of the SD 1.x, SDXL, SD3 and Flux layouts (narrowed), against the linear map.

Plain process: no thread-count or OpenMP environment variables are set.

    python benchmarks/preview_fidelity.py
    python benchmarks/preview_fidelity.py --prompts 8 --seeds 1 --reps 3 --skip-layouts   # quicker

Targets: tiny at 50 % within 1.5x of vae's error; tiny at the last step <= 8/255; its error
falls from step to step on average; tiny's cost <= 1.05x the bare pipeline; x0 at the last step
<= 12/255, its error falling on average.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np
import torch
import torch.nn.functional as F

# Row name -> preview= mode ("x0 map" is no mode of its own: x0 through the linear map).
MODES = {"latent": "latent", "x0": "x0", "x0 map": "x0", "tiny": "tiny", "vae": "x0+vae"}
COST_MODES = {"latent": "latent", "x0": "x0", "tiny": "tiny", "vae": "x0+vae"}


def log(msg: str, t0: float = time.time()) -> None:
    print(f"[{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def collect(model: Any, prompts: list[str], seeds: list[int], steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """Per run: the noisy latents and x0 of every step ``(N, steps, C, h, w)``, and the final
    images ``(N, 3, H, W)`` as uint8 (what the stream's final PNG holds)."""
    from multistream.diffusion._previews import X0Tracker

    pipe = model.pipeline
    runs = [(p, s) for s in seeds for p in prompts]
    lat_all, x0_all, finals = [], [], []
    for start in range(0, len(runs), batch):
        chunk = runs[start : start + batch]
        lats: list[torch.Tensor] = []
        x0s: list[torch.Tensor] = []

        def callback(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            lats.append(kw["latents"].float().clone())
            x0 = tracker.x0()
            x0s.append((x0 if x0 is not None else kw["latents"]).float().clone())
            return kw

        gens = [torch.Generator("cpu").manual_seed(s) for _, s in chunk]
        with torch.inference_mode(), X0Tracker(pipe.scheduler) as tracker:
            out = pipe([p for p, _ in chunk], num_inference_steps=steps, generator=gens, output_type="np",
                       callback_on_step_end=callback)  # fmt: skip
        lat_all.append(torch.stack(lats, 1))
        x0_all.append(torch.stack(x0s, 1))
        finals.append(torch.from_numpy((np.clip(out.images, 0, 1) * 255 + 0.5).astype(np.uint8)).permute(0, 3, 1, 2))
        log(f"  generated {min(start + batch, len(runs))}/{len(runs)}")
    return torch.cat(lat_all), torch.cat(x0_all), torch.cat(finals), [p for p, _ in runs]


def plan_for(model: Any, row: str) -> Any:
    """The settled `PreviewPlan` of a row: what a stream of that mode on this model decodes with."""
    import dataclasses

    from multistream.diffusion._previews import parse_preview, settle_plan

    plan = parse_preview(MODES[row])
    if row == "x0 map":
        return dataclasses.replace(plan, decoder="linear", prefer=())
    return settle_plan(plan, model._decoder_parts(None))


def previews(model: Any, row: str, lat: torch.Tensor, x0: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 previews ``(N, steps, 3, size, size)`` of one row, as the stream makes them."""
    from multistream.diffusion._previews import build_decoder, to_uint8_frames

    plan = plan_for(model, row)
    decoder = build_decoder(plan, model._decoder_parts(None))
    n, steps = lat.shape[:2]
    src = (lat if plan.source == "latent" else x0).reshape(n * steps, *lat.shape[2:])
    out = []
    with torch.inference_mode():
        for chunk in src.split(64):
            rgb = decoder.decode(chunk)
            frames = to_uint8_frames(rgb, None).permute(0, 3, 1, 2)
            if frames.shape[-1] != size:  # latent-sized: shown scaled up
                frames = F.interpolate(frames.float(), size=(size, size), mode="bilinear", align_corners=False)
                frames = frames.round().clamp(0, 255).to(torch.uint8)
            out.append(frames)
    return torch.cat(out).reshape(n, steps, 3, size, size)


def mae_psnr(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = a.float() - b.float()
    mae = float(diff.abs().mean())
    mse = diff.pow(2).mean(dim=(-3, -2, -1))  # per image, then the mean PSNR
    psnr = float((10 * torch.log10(255.0**2 / mse.clamp_min(1e-10))).mean())
    return mae, psnr


def judge_scores(judge: Any, images: torch.Tensor, prompts: list[str]) -> tuple[float, float, float]:
    from shapes_quality import COLOR_NAMES, predict

    from multistream._shapes import SHAPES, parse_prompt

    x = images.float().div(127.5).sub(1.0)
    pred = predict(judge.eval(), x)
    truth = []
    for p in prompts:
        shape, color, background = parse_prompt(p)
        truth.append([SHAPES.index(shape), COLOR_NAMES.index(color), COLOR_NAMES.index(background)])
    t = torch.tensor(truth)
    color = float((pred[:, 1] == t[:, 1]).float().mean())
    background = float((pred[:, 2] == t[:, 2]).float().mean())
    shape = float((pred[:, 0] == t[:, 0]).float().mean())
    return color, background, shape


def layouts_section(fit_steps: int) -> None:
    """The fit on random-weight VAEs of each family's layout (narrowed widths, real latent
    channels, scale factors and latent scaling), against the linear map, on held-out latents."""
    from diffusers import AutoencoderKL

    import multistream as ms
    from multistream.diffusion._latent_rgb import synthetic_images, fit_latent_rgb, latents_from_vae_space, latents_to_rgb, latents_to_vae_space

    layouts = {
        "sd15": dict(latent_channels=4, scaling_factor=0.18215, shift_factor=None),
        "sdxl": dict(latent_channels=4, scaling_factor=0.13025, shift_factor=None),
        "sd3": dict(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609),
        "flux": dict(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159),
    }
    print(f"\n## random-weight layouts (VAE factor 8, {fit_steps} fit steps, error vs the VAE on held-out latents, 0-255)")
    print(f"{'layout':<7}{'ch':>4}{'params':>9}{'fit s':>8}{'tiny MAE':>10}{'linear MAE':>12}  beats linear")
    for name, cfg in layouts.items():
        torch.manual_seed(0)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, **cfg,
        ).eval()  # fmt: skip
        started = time.perf_counter()
        net = ms.fit_preview_decoder(vae, num_images=64, latent_size=8, steps=fit_steps, cache=False)
        fit_s = time.perf_counter() - started
        gen = torch.Generator().manual_seed(123)
        with torch.inference_mode():
            images = synthetic_images(8, 64, gen)
            scaled = latents_from_vae_space(vae.encode(images).latent_dist.mode(), vae.config)
            target = vae.decode(latents_to_vae_space(scaled, vae.config)).sample.clamp(-1, 1)
            tiny = net(scaled).clamp(-1, 1)
            linear = latents_to_rgb(scaled, fit_latent_rgb(vae, cache=False)) * 2 - 1
            linear = F.interpolate(linear, size=target.shape[-2:], mode="bilinear", align_corners=False)
        t_err = float((tiny - target).abs().mean()) * 127.5
        l_err = float((linear - target).abs().mean()) * 127.5
        print(f"{name:<7}{cfg['latent_channels']:>4}{net.num_parameters():>9}{fit_s:>8.1f}{t_err:>10.2f}{l_err:>12.2f}  {'yes' if t_err < l_err else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="images per pipeline call while collecting")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds of the cost comparison (median kept)")
    ap.add_argument("--judge-images", type=int, default=3000)
    ap.add_argument("--skip-layouts", action="store_true")
    ap.add_argument("--layout-steps", type=int, default=600)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import multistream as ms
    from multistream.image import EMBEDDED_MODEL_DIR
    from multistream.diffusion._preview_decoder import PREVIEW_DECODER_FILE, load_preview_decoder
    from shapes_quality import draw_prompts, train_judge

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    dlogging.disable_progress_bar()
    model = ms.load_image_model()
    shipped = EMBEDDED_MODEL_DIR / PREVIEW_DECODER_FILE
    net = load_preview_decoder(shipped)
    print(f"# preview fidelity: embedded shapes model, {args.prompts} prompts x {args.seeds} seeds, {args.steps} steps, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"shipped decoder: {net.num_parameters()} parameters, {shipped.stat().st_size / 1024:.0f} KiB, "
          f"fit in {net.fit_info.get('fit_seconds', '?')} s (recorded when it was made), config {net.config()}")  # fmt: skip

    prompts = draw_prompts(args.prompts, seed=2024)
    seeds = list(range(args.seeds))
    log("collecting latents and x0 of every step")
    lat, x0, finals, run_prompts = collect(model, prompts, seeds, args.steps, args.batch)
    size = finals.shape[-1]
    steps = args.steps
    marks = {"25%": max(1, round(steps * 0.25)), "50%": max(1, round(steps * 0.5)), "75%": max(1, round(steps * 0.75)), "last": steps}

    log("training the shapes judge")
    judge, judge_acc = train_judge(0, args.judge_images, 3, lambda m: None)
    fc, fb, fs = judge_scores(judge, finals, run_prompts)

    rows: dict[str, dict[str, Any]] = {}
    print("decoders: " + ", ".join(f"{row} -> {plan_for(model, row).decoder}" for row in MODES))
    for mode in MODES:
        log(f"previews: {mode}")
        frames = previews(model, mode, lat, x0, size)
        row: dict[str, Any] = {}
        for label, step in marks.items():
            row[label] = mae_psnr(frames[:, step - 1], finals)
        curve = [mae_psnr(frames[:, k], finals)[0] for k in range(steps)]
        row["curve"] = curve
        row["falls"] = sum(b < a for a, b in zip(curve, curve[1:]))
        row["judge"] = judge_scores(judge, frames[:, marks["50%"] - 1], run_prompts)
        rows[mode] = row

    print(f"\n## error of the preview against the final image (MAE 0-255 / PSNR dB), {len(run_prompts)} images")
    print(f"{'mode':<8}" + "".join(f"{k + ' step ' + str(v):>22}" for k, v in marks.items()))
    for mode, row in rows.items():
        print(f"{mode:<8}" + "".join(f"{row[k][0]:>12.1f} /{row[k][1]:>6.1f} dB" for k in marks))
    print("\n## mean error per step (MAE 0-255), steps 1..N")
    for mode, row in rows.items():
        curve = row["curve"]
        print(f"{mode:<8}" + " ".join(f"{v:5.1f}" for v in curve) + f"   falls at {row['falls']}/{steps - 1} steps, "
              f"mean change {statistics.fmean(b - a for a, b in zip(curve, curve[1:])):+.2f}/step")  # fmt: skip
    print(f"\n## shapes judge on the {marks['50%']}-step (50 %) previews (judge on real images: {judge_acc})")
    print(f"{'mode':<8}{'colour':>8}{'backgr.':>9}{'shape':>7}")
    for mode, row in rows.items():
        c, b, s = row["judge"]
        print(f"{mode:<8}{c:>8.0%}{b:>9.0%}{s:>7.0%}")
    print(f"{'final':<8}{fc:>8.0%}{fb:>9.0%}{fs:>7.0%}")

    log("cost: interleaved .stream() runs against the bare pipeline")
    from image_stream import compare

    cost_modes = ("plain", *COST_MODES.values())
    results = compare(model, prompt="a red circle on a blue background", steps=steps, seed=0, reps=args.reps,
                      modes=cost_modes, log=lambda m: log(m))  # fmt: skip
    print(f"\n## cost per step, preview every step ({args.reps} interleaved rounds, medians, vs the bare pipeline)")
    print(f"{'mode':<8}{'median s':>10}{'ratio':>8}{'+ms/step':>10}{'decode ms':>11}")
    for name, mode in [("plain", "plain"), *COST_MODES.items()]:
        r = results[mode]
        print(f"{name:<8}{r['median_s']:>10.3f}{r.get('ratio', 1.0):>8.3f}{r.get('overhead_ms_per_step', 0.0):>10.2f}"
              f"{r.get('preview_ms', float('nan')):>11.2f}")  # fmt: skip

    tiny, vae, x0row = rows["tiny"], rows["vae"], rows["x0"]
    checks = [
        ("tiny at 50 % within 1.5x of vae", tiny["50%"][0] <= 1.5 * vae["50%"][0], f"{tiny['50%'][0]:.1f} vs {vae['50%'][0]:.1f}"),
        ("tiny at the last step <= 8/255", tiny["last"][0] <= 8.0, f"{tiny['last'][0]:.1f}"),
        ("tiny's error falls step to step on average", statistics.fmean(b - a for a, b in zip(tiny["curve"], tiny["curve"][1:])) < 0,
         f"falls at {tiny['falls']}/{steps - 1} steps"),
        ("tiny costs <= 1.05x the bare pipeline", results["tiny"]["ratio"] <= 1.05, f"{results['tiny']['ratio']:.3f}x"),
        ("x0 at the last step <= 12/255", x0row["last"][0] <= 12.0, f"{x0row['last'][0]:.1f} (x0 map: {rows['x0 map']['last'][0]:.1f})"),
        ("x0's error falls step to step on average", statistics.fmean(b - a for a, b in zip(x0row["curve"], x0row["curve"][1:])) < 0,
         f"falls at {x0row['falls']}/{steps - 1} steps"),
    ]  # fmt: skip
    print("\n## targets")
    for text, ok, detail in checks:
        print(f"{'OK  ' if ok else 'MISS'} {text}: {detail}")

    if not args.skip_layouts:
        layouts_section(args.layout_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
