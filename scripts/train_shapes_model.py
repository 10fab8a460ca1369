"""Train multistream's embedded text-to-image model on procedural shapes, from scratch, on CPU.

The result is a standard diffusers ``StableDiffusionPipeline`` folder (64x64 images, 16x16x4
latents) plus ``latent_rgb.json``, the linear latent-to-RGB map used for cheap live previews.

Stages: render the dataset (``multistream._shapes``) -> train a small ``AutoencoderKL`` ->
encode every image once to latents -> train the ``UNet2DConditionModel`` and a small
``CLIPTextModel`` together on the cached latents (v-prediction, min-SNR weighting, 10% empty
captions for classifier-free guidance, EMA) -> fit the preview matrix -> write the folder.

Usage::

    python scripts/train_shapes_model.py                  # defaults: the shipped weights
                                                          # (~48 min on 2 shared CPU cores)
    python scripts/train_shapes_model.py --quick --out /tmp/shapes_quick   # 1-2 min smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# The CPU is shared with other jobs: OpenMP threads that spin while waiting for a descheduled
# sibling waste most of their time there (measured 3-4x slower), so make them sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from multistream._shapes import all_words, caption, make_dataset

MAX_LENGTH = 24
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]


def build_tokenizer(
    max_length: int = MAX_LENGTH, extra_words: list[str] | None = None
):  # -> PreTrainedTokenizerFast
    """Word-level tokenizer over the caption vocabulary; unknown words map to ``<unk>``.

    ``extra_words`` are appended after the image vocabulary, so every image word keeps its id
    (the video model extends the image model's text encoder this way).
    """
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + all_words()
    words += [w for w in extra_words or [] if w not in words]
    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    # Punctuation is dropped rather than mapped to <unk>: "a red circle, on blue" should read
    # exactly like the captions the model was trained on.
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[^\w\s]"), " "),
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>",
        pair="<bos> $A <eos> $B <eos>",
        special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=max_length,
        padding_side="right",
    )


def build_text_encoder(tokenizer):  # -> CLIPTextModel
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModel(cfg)


def build_vae():  # -> AutoencoderKL
    from diffusers import AutoencoderKL

    # Three blocks = two downsamples: 64x64x3 -> 16x16x4. No mid-block attention: flat-color
    # scenes need none and it would dominate the cost at 16x16.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
        mid_block_add_attention=False,
    )


def build_unet():  # -> UNet2DConditionModel
    from diffusers import UNet2DConditionModel

    # Sized so that 20 CFG steps (batch 2) take ~0.5 s on 2 CPU cores; cross-attention at 8x8
    # and 4x4 only, where it is cheap and where shape identity is decided.
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64, 128),
        down_block_types=(
            "DownBlock2D",
            "CrossAttnDownBlock2D",
            "CrossAttnDownBlock2D",
        ),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=128,
        attention_head_dim=4,  # diffusers' legacy name: this is the number of heads
        norm_num_groups=16,
    )


def build_noise_schedule():  # -> DDPMScheduler used in training
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        clip_sample=False,
    )


def build_inference_scheduler():
    from diffusers import DPMSolverMultistepScheduler

    # DPM-Solver++(2M): a second-order multistep solver, accurate at 20 steps, and it runs the
    # standard callback_on_step_end flow. Its config must match the training noise schedule.
    return DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        algorithm_type="dpmsolver++",
        solver_order=2,
        steps_offset=1,  # what StableDiffusionPipeline expects; linspace spacing ignores it
    )


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


class EMA:
    """Exponential moving average of a module's parameters, with the usual 1-(1+n)/(10+n) warmup."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.n = 0
        self.shadow = [p.detach().clone() for p in module.parameters()]

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        torch._foreach_lerp_(
            self.shadow, [p.detach() for p in module.parameters()], 1 - d
        )

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        for s, p in zip(self.shadow, module.parameters(), strict=True):
            p.copy_(s)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def log(t0: float, msg: str) -> None:
    print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)


def train_vae(vae, images: np.ndarray, args, t0: float) -> None:
    g = torch.Generator().manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    vae.train()
    n = len(images)
    run = 0.0
    for step in range(args.vae_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.vae_steps, args.vae_lr, warmup=50)
        idx = torch.randint(0, n, (args.vae_batch,), generator=g).numpy()
        x = to_tensor(images[idx])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            post = vae.encode(x).latent_dist
            z = post.mean + post.std * torch.randn(post.mean.shape, generator=g)
            rec = vae.decode(z).sample.float()
        kl = post.kl().mean()
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + args.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        run = loss.item() if step == 0 else 0.98 * run + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.vae_steps - 1:
            log(
                t0,
                f"vae step {step:5d}/{args.vae_steps} loss {run:.4f} kl {kl.item():.1f}",
            )
    vae.eval()


@torch.no_grad()
def encode_all(vae, images: np.ndarray, bf16: bool, batch: int = 256) -> torch.Tensor:
    """Posterior means of every image, unscaled."""
    out = []
    for i in range(0, len(images), batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out.append(
                vae.encode(to_tensor(images[i : i + batch])).latent_dist.mean.float()
            )
    return torch.cat(out)


@torch.no_grad()
def fit_latent_rgb(vae, latents_scaled: torch.Tensor, sf: float) -> dict:
    """Least squares ``rgb ≈ latent @ M + b`` on scaled latents, RGB in [-1, 1]."""
    rgb = []
    for i in range(0, len(latents_scaled), 256):
        dec = vae.decode(latents_scaled[i : i + 256] / sf).sample.clamp(-1, 1)
        rgb.append(F.avg_pool2d(dec, 4))
    rgb_t = torch.cat(rgb)
    c = latents_scaled.shape[1]
    z = latents_scaled.permute(0, 2, 3, 1).reshape(-1, c).double()
    y = rgb_t.permute(0, 2, 3, 1).reshape(-1, 3).double()
    a = torch.cat([z, torch.ones(len(z), 1, dtype=z.dtype)], dim=1)
    sol = torch.linalg.lstsq(a, y).solution
    err = (a @ sol - y).pow(2).mean().sqrt().item()
    return {
        "space": "scaled_latents_to_rgb_minus1_1",
        "note": "rgb[-1,1] = latents @ matrix + bias, on the latents the UNet sees (before "
        "dividing by vae.config.scaling_factor), per latent pixel",
        "matrix": [[round(v, 6) for v in row] for row in sol[:c].tolist()],
        "bias": [round(v, 6) for v in sol[c].tolist()],
        "rmse": round(err, 5),
    }


def tokenize(tokenizer, prompts: list[str]) -> torch.Tensor:
    # Exactly what StableDiffusionPipeline.encode_prompt does, so training matches inference.
    return tokenizer(
        prompts,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def make_pipeline(vae, text_encoder, tokenizer, unet):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=build_inference_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def save_pipeline(pipe, out: Path, latent_rgb: dict) -> None:
    import copy
    import shutil

    if out.exists():
        shutil.rmtree(out)
    # fp16 storage halves the folder; diffusers upcasts UNet/VAE weights to the model's fp32 on
    # load. The text encoder stays fp32 because transformers would keep fp16 ("auto" dtype).
    unet16 = copy.deepcopy(pipe.unet).half()
    vae16 = copy.deepcopy(pipe.vae).half()
    pipe.register_modules(unet=unet16, vae=vae16)
    try:
        pipe.save_pretrained(out, safe_serialization=True)
    finally:
        pipe.register_modules(unet=unet16.float(), vae=vae16.float())
    (out / "latent_rgb.json").write_text(json.dumps(latent_rgb, indent=1) + "\n")


@torch.no_grad()
def sample_grid(
    pipe, prompts: list[str], path: Path, guidance: float, steps: int = 20
) -> None:
    from PIL import Image

    imgs = []
    for i, p in enumerate(prompts):
        g = torch.Generator().manual_seed(i)
        imgs.append(
            pipe(
                p,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=g,
                height=64,
                width=64,
            ).images[0]
        )
    cols = 8
    rows = math.ceil(len(imgs) / cols)
    grid = Image.new("RGB", (64 * cols, 64 * rows))
    for i, im in enumerate(imgs):
        grid.paste(im, ((i % cols) * 64, (i // cols) * 64))
    grid.save(path)


def train_unet(
    unet, text_encoder, tokenizer, latents, scenes, args, t0, on_checkpoint=None
):
    sched = build_noise_schedule()
    alphas = sched.alphas_cumprod
    snr = alphas / (1 - alphas)
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(
        params, lr=args.unet_lr, weight_decay=0.01, betas=(0.9, 0.99)
    )
    ema_u = EMA(unet, args.ema)
    ema_t = EMA(text_encoder, args.ema)
    g = torch.Generator().manual_seed(args.seed + 2)
    rng = np.random.default_rng(args.seed + 3)
    n = len(latents)
    unet.train()
    text_encoder.train()
    run = 0.0
    for step in range(args.unet_steps):
        lr = lr_at(
            step,
            args.unet_steps,
            args.unet_lr,
            warmup=min(300, args.unet_steps // 10 + 1),
        )
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, n, (args.unet_batch,), generator=g)
        x0 = latents[idx]
        prompts = [
            "" if rng.random() < args.cond_drop else caption(scenes[i], rng)
            for i in idx.tolist()
        ]
        # A few captions get an out-of-vocabulary word, so <unk> is learned to mean "nothing".
        for j, p in enumerate(prompts):
            if p and rng.random() < args.unk_rate:
                words = p.split()
                words.insert(int(rng.integers(len(words) + 1)), "<unk>")
                prompts[j] = " ".join(words)
        ids = tokenize(tokenizer, prompts)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, sched.config.num_train_timesteps, (len(x0),), generator=g)
        xt = sched.add_noise(x0, noise, t)
        target = sched.get_velocity(x0, noise, t)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            emb = text_encoder(ids)[0]
            pred = unet(xt, t, encoder_hidden_states=emb).sample.float()
        # min-SNR-gamma weighting for v-prediction (Hang et al. 2023): keeps the many easy
        # low-noise steps from crowding out the high-noise ones that decide shape and color.
        w = snr[t].clamp(max=args.min_snr) / (snr[t] + 1)
        loss = (w * (pred - target).pow(2).mean(dim=(1, 2, 3))).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_u.update(unet)
        ema_t.update(text_encoder)
        run = loss.item() if step == 0 else 0.98 * run + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.unet_steps - 1:
            log(t0, f"unet step {step:5d}/{args.unet_steps} loss {run:.4f} lr {lr:.2e}")
        if (
            on_checkpoint
            and args.checkpoint_every
            and step
            and step % args.checkpoint_every == 0
        ):
            on_checkpoint(step, ema_u, ema_t)
    ema_u.copy_to(unet)
    ema_t.copy_to(text_encoder)
    unet.eval()
    text_encoder.eval()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", type=Path, default=ROOT / "multistream" / "_models" / "shapes"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-images", type=int, default=20000)
    ap.add_argument("--vae-steps", type=int, default=600)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--vae-kl", type=float, default=1e-6)
    ap.add_argument("--unet-steps", type=int, default=2500)
    ap.add_argument("--unet-batch", type=int, default=64)
    ap.add_argument("--unet-lr", type=float, default=1e-3)
    ap.add_argument("--ema", type=float, default=0.998)
    ap.add_argument("--min-snr", type=float, default=5.0)
    ap.add_argument("--cond-drop", type=float, default=0.1)
    ap.add_argument("--unk-rate", type=float, default=0.05)
    ap.add_argument(
        "--guidance", type=float, default=7.5, help="for the preview grids only"
    )
    ap.add_argument(
        "--no-bf16", dest="bf16", action="store_false", help="train in fp32"
    )
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=1000,
        help="also write the EMA pipeline to --checkpoint-dir every N UNet steps",
    )
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/shapes_ckpt"))
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (1-2 minutes)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_images, args.vae_steps, args.unet_steps, args.log_every = 512, 30, 30, 10

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(
        True
    )  # denormals in tiny late-training updates are slow on CPU
    torch.manual_seed(args.seed)
    log(t0, f"args: {vars(args)}")

    images, scenes = make_dataset(args.n_images, seed=args.seed)
    log(t0, f"dataset: {images.shape} uint8")

    vae = build_vae()
    log(t0, f"vae: {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M params")
    train_vae(vae, images, args, t0)
    with torch.no_grad():
        held, _ = make_dataset(256, seed=args.seed + 10_000)
        x = to_tensor(held)
        rec = vae.decode(vae.encode(x).latent_dist.mean).sample.clamp(-1, 1)
        mse = F.mse_loss(rec, x).item()
    log(
        t0, f"vae held-out recon MSE {mse:.5f} (PSNR {10 * math.log10(4 / mse):.1f} dB)"
    )

    latents = encode_all(vae, images, args.bf16)
    sf = 1.0 / latents.std().item()
    vae.register_to_config(scaling_factor=sf)
    latents = latents * sf
    log(
        t0,
        f"latents {tuple(latents.shape)}, scaling_factor {sf:.4f}, "
        f"channel means {[round(v, 3) for v in latents.mean(dim=(0, 2, 3)).tolist()]}",
    )
    latent_rgb = fit_latent_rgb(vae, latents[:2000], sf)
    log(t0, f"latent_rgb fit rmse {latent_rgb['rmse']}")

    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer)
    unet = build_unet()
    log(
        t0,
        f"unet: {sum(p.numel() for p in unet.parameters()) / 1e6:.2f}M params, text encoder: "
        f"{sum(p.numel() for p in text_encoder.parameters()) / 1e6:.2f}M params",
    )
    probe = [caption(s, detail=0) for s in scenes[-16:]]

    def on_checkpoint(step: int, ema_u: EMA, ema_t: EMA) -> None:
        import copy

        u, te = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
        ema_u.copy_to(u)
        ema_t.copy_to(te)
        pipe = make_pipeline(vae, te, tokenizer, u)
        pipe.set_progress_bar_config(disable=True)
        save_pipeline(pipe, args.checkpoint_dir, latent_rgb)
        sample_grid(
            pipe, probe, args.checkpoint_dir / f"grid_{step}.png", args.guidance
        )
        (args.checkpoint_dir / "prompts.txt").write_text("\n".join(probe) + "\n")
        log(t0, f"checkpoint at step {step} -> {args.checkpoint_dir}")

    train_unet(unet, text_encoder, tokenizer, latents, scenes, args, t0, on_checkpoint)

    pipe = make_pipeline(vae, text_encoder, tokenizer, unet)
    pipe.set_progress_bar_config(disable=True)
    save_pipeline(pipe, args.out, latent_rgb)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    log(t0, f"wrote {args.out} ({size / 1e6:.2f} MB)")
    grid = Path(os.environ.get("TMPDIR", "/tmp")) / "shapes_final_grid.png"
    sample_grid(pipe, probe, grid, args.guidance)
    log(t0, f"done; sample grid for {probe[:2]}... at {grid}")


if __name__ == "__main__":
    main()
