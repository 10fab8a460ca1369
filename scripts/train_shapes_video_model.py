"""Train multistream's embedded text-to-video model on procedural moving shapes, on CPU.

The result is a standard diffusers ``AnimateDiffPipeline`` folder (16 frames of 64x64, per-frame
16x16x4 latents) in ``multistream/_models/shapes_video/``, plus ``video.json`` (the defaults a
loader uses) and the image model's ``latent_rgb.json`` (same VAE, so the same preview map).

It builds on the embedded image model (``multistream/_models/shapes``) rather than training from
scratch: its UNet stays frozen and becomes a ``UNetMotionModel`` with a small ``MotionAdapter``
(temporal self-attention after every spatial block, output projections zero-initialised, so
training starts from the image model run frame by frame); its VAE is reused as is.

Stages: render clips (``multistream._shapes.make_clip_dataset``) -> encode every frame once
with the image VAE -> extend the tokenizer and text encoder with the motion words ("moving",
"up", "down"; new embedding rows start from "top"/"bottom") -> train the motion modules (and
the text encoder and the UNet's cross-attention keys/values at a small learning rate) on the
cached latents (v-prediction, min-SNR weighting, 10% empty captions for guidance, EMA) ->
write the folder, with ``motion_prior.json``: the trained model takes the direction of motion from
the starting noise (the schedule's last step leaks the clip), and the prior makes that noise lean
the way the prompt says (8 of 24 directions right without it, 23 with it).

Usage::

    python scripts/train_shapes_video_model.py            # defaults: the shipped weights
    python scripts/train_shapes_video_model.py --quick --out /tmp/shapes_video_quick  # smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
from pathlib import Path

# Shared CPU: let idle OpenMP threads sleep rather than spin (see train_shapes_model.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_shapes_model import (  # noqa: E402
    EMA,
    build_inference_scheduler,
    build_noise_schedule,
    build_tokenizer,
    log,
    to_tensor,
    tokenize,
)

from multistream._shapes import MOTIONS, clip_caption, make_clip_dataset  # noqa: E402

IMAGE_MODEL = ROOT / "multistream" / "_models" / "shapes"
NEW_WORDS = ["moving", "up", "down"]
# A new word's embedding row starts as a copy of a related image word's row.
WORD_INIT = {"up": "top", "down": "bottom", "moving": "in"}
MOTION_PRIOR = {"gain": 4.0, "clips": 32}  # motion_prior.json: see save_pipeline
VIDEO_DEFAULTS = {
    "num_frames": 16,
    "fps": 8,
    "steps": 20,
    "guidance_scale": 7.5,
    "width": 64,
    "height": 64,
}


def extend_text_encoder(tokenizer, old_tokenizer, text_encoder) -> None:
    """Grow the embedding table to the new vocabulary; image words keep their rows."""
    old = text_encoder.get_input_embeddings().weight.detach().clone()
    text_encoder.resize_token_embeddings(len(tokenizer))
    emb = text_encoder.get_input_embeddings().weight
    old_vocab = old_tokenizer.get_vocab()
    with torch.no_grad():
        for word, i in tokenizer.get_vocab().items():
            if word in old_vocab:
                if old_vocab[word] != i:
                    raise RuntimeError(f"token id of {word!r} changed: {old_vocab[word]} -> {i}")
                continue
            emb[i] = old[old_vocab[WORD_INIT[word]]]
    text_encoder.config.vocab_size = len(tokenizer)


def build_motion_unet(unet2d):  # -> UNetMotionModel
    from diffusers import MotionAdapter, UNetMotionModel

    adapter = MotionAdapter(
        block_out_channels=tuple(unet2d.config.block_out_channels),
        motion_layers_per_block=unet2d.config.layers_per_block,
        motion_num_attention_heads=4,
        motion_norm_num_groups=16,
        motion_max_seq_length=32,
        use_motion_mid_block=True,
    )
    unet = UNetMotionModel.from_unet2d(unet2d, adapter)
    # Zero-init every motion module's output so the model starts as the image model.
    for name, mod in unet.named_modules():
        if name.endswith("motion_modules") or ".motion_modules." in name:
            if hasattr(mod, "proj_out"):
                torch.nn.init.zeros_(mod.proj_out.weight)
                torch.nn.init.zeros_(mod.proj_out.bias)
    return unet


def trainable_groups(unet, text_encoder, args) -> list[dict]:
    unet.freeze_unet2d_params()  # everything but the motion modules
    motion = [p for n, p in unet.named_parameters() if "motion_modules" in n]
    for p in motion:
        p.requires_grad_(True)
    # Cross-attention keys/values may adapt to the new words; the rest of the image UNet stays.
    xattn = [
        p
        for n, p in unet.named_parameters()
        if "motion_modules" not in n and (".attn2.to_k." in n or ".attn2.to_v." in n)
    ]
    for p in xattn:
        p.requires_grad_(True)
    te = list(text_encoder.parameters())
    for p in te:
        p.requires_grad_(True)
    return [
        {"params": motion, "lr": args.lr, "base": args.lr},
        {"params": xattn + te, "lr": args.lr * args.text_lr_scale, "base": args.lr * args.text_lr_scale},
    ]


@torch.no_grad()
def encode_clips(vae, clips: np.ndarray, bf16: bool, batch: int = 256) -> torch.Tensor:
    """Scaled posterior means of every frame: ``(n, C, F, h, w)``."""
    n, f = clips.shape[:2]
    flat = clips.reshape(n * f, *clips.shape[2:])
    out = []
    for i in range(0, len(flat), batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out.append(vae.encode(to_tensor(flat[i : i + batch])).latent_dist.mean.float())
    lat = torch.cat(out) * vae.config.scaling_factor
    return lat.reshape(n, f, *lat.shape[1:]).permute(0, 2, 1, 3, 4).contiguous()


def make_pipeline(vae, text_encoder, tokenizer, unet):
    from diffusers import AnimateDiffPipeline

    # The UNetMotionModel already holds the motion modules: no separate adapter is stored.
    return AnimateDiffPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        motion_adapter=None,
        scheduler=build_inference_scheduler(),
    )


def save_pipeline(pipe, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    # fp16 storage for UNet and VAE (diffusers loads them back into fp32 models), as the image
    # model does; the text encoder stays fp32 because transformers would keep fp16.
    unet, vae = pipe.unet, pipe.vae
    pipe.register_modules(unet=copy.deepcopy(unet).half(), vae=copy.deepcopy(vae).half())
    try:
        pipe.save_pretrained(out, safe_serialization=True)
    finally:
        pipe.register_modules(unet=unet, vae=vae)
    (out / "video.json").write_text(json.dumps(VIDEO_DEFAULTS, indent=1) + "\n")
    # The motion prior (multistream/video/_motion_prior.py): trained on this schedule, the model
    # reads the direction from the starting noise; gain 4 was measured best on the judged prompts.
    (out / "motion_prior.json").write_text(json.dumps(MOTION_PRIOR) + "\n")
    shutil.copy(IMAGE_MODEL / "latent_rgb.json", out / "latent_rgb.json")
    # The image model's VAE, so the same recipe, but narrower (32 channels against 64): a clip's preview
    # decodes 16 frames a step, and on 2 AVX2 cores the 64-wide net took 26.5 ms of a ~400 ms step
    # (10.2 ms at 32), which put preview="tiny" at 1.07x the bare pipeline's time against its 1.05x goal.
    from multistream import cli

    cli.main(["fit-preview", "--width", "32", "--out", str(out / "preview_decoder.safetensors")])
    strip_local_paths(out)


def strip_local_paths(out: Path) -> None:
    """diffusers records where each part was loaded from: a path of the machine that trained it."""
    for config in out.glob("*/config.json"):
        entries = json.loads(config.read_text())
        if entries.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")


def train(unet, text_encoder, tokenizer, latents, clips, args, t0, on_checkpoint=None) -> None:
    sched = build_noise_schedule()
    alphas = sched.alphas_cumprod
    snr = alphas / (1 - alphas)
    groups = trainable_groups(unet, text_encoder, args)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=0.01, betas=(0.9, 0.99))
    ema = EMA(_Params(params), args.ema)
    g = torch.Generator().manual_seed(args.seed + 2 + args.start_step)
    rng = np.random.default_rng(args.seed + 3 + args.start_step)
    n = len(latents)
    unet.train()
    text_encoder.train()
    run = 0.0
    for step in range(args.start_step, args.steps):
        for group in opt.param_groups:
            # Warmup, then constant: a checkpoint at step k is then exactly the run with --steps k.
            warm = min(100, args.steps // 10 + 1)
            group["lr"] = group["base"] * min(1.0, (step - args.start_step + 1) / warm)
        idx = torch.randint(0, n, (args.batch,), generator=g)
        x0 = latents[idx]
        prompts = ["" if rng.random() < args.cond_drop else clip_caption(clips[i], rng) for i in idx.tolist()]
        ids = tokenize(tokenizer, prompts)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, sched.config.num_train_timesteps, (len(x0),), generator=g)
        # The direction of motion is laid out at high noise: optionally draw more timesteps there.
        if args.high_noise_frac > 0:
            high = torch.rand(len(x0), generator=g) < args.high_noise_frac
            t = torch.where(high, torch.randint(600, sched.config.num_train_timesteps, (len(x0),), generator=g), t)
        xt = sched.add_noise(x0, noise, t)
        target = sched.get_velocity(x0, noise, t)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            # One prompt per frame, as AnimateDiffPipeline passes them (repeat_interleave).
            emb = text_encoder(ids)[0].repeat_interleave(x0.shape[2], dim=0)
            pred = unet(xt, t, encoder_hidden_states=emb).sample.float()
        # min-SNR weighting, or (--plain-v) the plain v-prediction loss, which does not fade out
        # the high-noise steps where the motion's direction is decided.
        w = torch.ones(len(t)) if args.plain_v else snr[t].clamp(max=args.min_snr) / (snr[t] + 1)
        loss = (w * (pred - target).pow(2).mean(dim=(1, 2, 3, 4))).mean()
        optimizer_step(opt, loss, params, ema)
        run = loss.item() if step == 0 else 0.98 * run + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            log(t0, f"step {step:5d}/{args.steps} loss {run:.4f} lr {opt.param_groups[0]['lr']:.2e}")
        if on_checkpoint and args.checkpoint_every and step and step % args.checkpoint_every == 0:
            on_checkpoint(step, ema, params)
    ema.copy_to(_Params(params))
    unet.eval()
    text_encoder.eval()


def optimizer_step(opt, loss: torch.Tensor, params: list, ema) -> None:
    """One training step on ``loss``: gradients clipped at norm 1, then the optimizer, then the EMA."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    ema.update(_Params(params))


class _Params(torch.nn.Module):
    """A parameter list seen as a module, so the image script's EMA tracks only what trains."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self._list = params

    def parameters(self, recurse: bool = True):  # type: ignore[override]
        return iter(self._list)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "multistream" / "_models" / "shapes_video")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-clips", type=int, default=2000)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3, help="motion modules")
    ap.add_argument(
        "--text-lr-scale", type=float, default=0.1, help="text encoder and cross-attention k/v LR, relative"
    )
    ap.add_argument("--ema", type=float, default=0.99)
    ap.add_argument("--min-snr", type=float, default=5.0)
    ap.add_argument("--plain-v", action="store_true", help="unweighted v-prediction loss")
    ap.add_argument("--high-noise-frac", type=float, default=0.0, help="share of timesteps drawn in [600, 1000)")
    ap.add_argument("--cond-drop", type=float, default=0.1)
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--checkpoint-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "shapes_video_ckpt")
    ap.add_argument("--resume", type=Path, default=None, help="continue from a checkpoint folder")
    ap.add_argument("--start-step", type=int, default=0, help="with --resume: the checkpoint's step")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (about a minute)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_clips, args.steps, args.log_every, args.checkpoint_every = 16, 4, 1, 2

    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextModel

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    log(t0, f"args: {vars(args)}")

    frames, clips = make_clip_dataset(args.n_clips, seed=args.seed, num_frames=args.frames)
    log(t0, f"clips: {frames.shape} uint8; motions {sorted({c.motion for c in clips})}")

    vae = AutoencoderKL.from_pretrained(IMAGE_MODEL / "vae").eval()
    latents = encode_clips(vae, frames, args.bf16)
    del frames
    log(t0, f"latents {tuple(latents.shape)}, std {latents.std().item():.3f}")

    old_tok = AutoTokenizer.from_pretrained(IMAGE_MODEL / "tokenizer")
    tokenizer = build_tokenizer(old_tok.model_max_length, extra_words=NEW_WORDS)
    if args.resume:
        # Continue from a checkpoint folder (its EMA weights; optimizer moments start afresh).
        from diffusers import UNetMotionModel

        text_encoder = CLIPTextModel.from_pretrained(args.resume / "text_encoder")
        unet = UNetMotionModel.from_pretrained(args.resume / "unet").float()
    else:
        text_encoder = CLIPTextModel.from_pretrained(IMAGE_MODEL / "text_encoder")
        extend_text_encoder(tokenizer, old_tok, text_encoder)
        unet = build_motion_unet(UNet2DConditionModel.from_pretrained(IMAGE_MODEL / "unet"))
    n_motion = sum(p.numel() for n, p in unet.named_parameters() if "motion_modules" in n)
    log(t0, f"unet {sum(p.numel() for p in unet.parameters()) / 1e6:.2f}M params, motion modules {n_motion / 1e6:.2f}M")

    def on_checkpoint(step: int, ema: EMA, params: list) -> None:
        saved = [p.detach().clone() for p in params]
        ema.copy_to(_Params(params))
        try:
            pipe = make_pipeline(vae, text_encoder, tokenizer, unet)
            save_pipeline(pipe, args.checkpoint_dir / f"step_{step}")
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
        log(t0, f"checkpoint at step {step} -> {args.checkpoint_dir / f'step_{step}'}")

    train(unet, text_encoder, tokenizer, latents, clips, args, t0, on_checkpoint)

    pipe = make_pipeline(vae, text_encoder, tokenizer, unet)
    save_pipeline(pipe, args.out)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    log(t0, f"wrote {args.out} ({size / 1e6:.2f} MB); motions {list(MOTIONS)}")


if __name__ == "__main__":
    main()
