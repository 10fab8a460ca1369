"""EXPERIMENT, not the shipped weights: a Wan-style text-to-video model on procedural moving shapes.

Status (2026-12-03, measured): the shipped embedded model is still the AnimateDiff motion adapter
of ``scripts/train_shapes_video_model.py``. This script was tried because that model does not
follow the direction of motion (8/24); on 2 CPU cores it did not get far enough in one session:

- the VAE (phases below, about 40 min) reconstructs held-out clips at a mean absolute error of
  7.9 (0-255) per frame, colour 23/24, shape 18/24 (small stars come back as circles), background
  24/24 and motion 24/24 by the clip judge: its shape detail is this model's ceiling;
- the transformer (3.9M parameters, 0.8-1.5 s a step at batch 16), judged on the 24 prompts at
  20 steps: step 1000 colour 7, shape 4, background 20, motion 3; step 2000 colour 13, shape 3,
  background 24, motion 0 (mostly still or empty clips; loss 0.28 and falling slowly). A clip
  takes 1.4-1.6 s, well inside the 20 s goal. It needs many more steps (or a warm start) than one
  session gave it;
- a causal VAE trained on 9-frame windows only drifts past them (per-frame error 8 on frames
  1-8, 56 on frame 16): its last phases see whole clips.

If it is taken up again: the embedded model's folder layout and tests would change (17 frames;
``WanPipeline``), and ``VideoModel`` already loads a 3D VAE's shipped ``latent_rgb.json`` and
``preview_decoder.safetensors``, which this script writes.

The result is a standard diffusers ``WanPipeline`` folder:
17 frames of 64x64, a tiny Wan 2.x-style VAE (2x2 patchified input, 4x spatial and 2x temporal
compression, causal in time: ``(B, 8, 9, 16, 16)`` latents), a tiny T5 text encoder over the
caption vocabulary, and a small ``WanTransformer3DModel`` whose every block cross-attends to the
prompt (4x4-latent tokens, 16x16 pixels each, as in Wan 2.1). Plus ``video.json`` (the defaults a loader uses), ``latent_rgb.json`` (the latent-to-RGB
preview map) and ``preview_decoder.safetensors`` (the ``"tiny"`` preview decoder, fitted to the VAE).

Why a transformer and not a motion adapter on the image model (what the shipped script trains):
AnimateDiff's temporal layers never see the prompt (diffusers calls them without
``encoder_hidden_states``), so the direction of motion had to pass through per-frame spatial
cross-attention; trained three ways it never did (8/24 directions right, chance 6/24, and the
same displacement for all four motion words at one seed). Here every token of every latent frame
attends to the text, with 3D rotary positions, as in Wan.

Stages: render clips (``multistream._shapes.make_clip_dataset``) -> train the VAE (9-frame
windows, then whole clips: `VAE_PHASES`) -> encode every clip once, set ``latents_mean``/``latents_std`` -> train the text encoder
and transformer together with the flow-matching loss WanPipeline samples with (velocity
``noise - x0`` at ``sigma``, sigmas drawn with the scheduler's shift, 10% empty captions for
guidance, EMA) -> fit the preview decoders -> write the folder.

Usage::

    python scripts/experiments/train_shapes_wan_model.py            # the run measured above (--steps 2000)
    python scripts/experiments/train_shapes_wan_model.py --quick --out /tmp/shapes_wan_quick  # smoke run
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_shapes_model import EMA, build_tokenizer, log  # noqa: E402

from multistream._shapes import all_video_words, clip_caption, make_clip_dataset  # noqa: E402

NEW_WORDS = ["moving", "up", "down"]  # after the image vocabulary, as before: image words keep their ids
NUM_FRAMES = 17  # WanPipeline wants (num_frames - 1) divisible by the VAE's temporal factor
Z_DIM = 8
SHIFT = 2.0  # the flow-matching schedule's shift, in training and in the shipped scheduler
MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default: prompts are zero-padded to it, so training pads the same way
VIDEO_DEFAULTS = {
    "num_frames": NUM_FRAMES,
    "fps": 8,
    "steps": 20,
    "guidance_scale": 5.0,
    "width": 64,
    "height": 64,
}


def build_vae(args):  # -> AutoencoderKLWan
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=args.vae_width, z_dim=Z_DIM, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
        patch_size=2, in_channels=12, out_channels=12, scale_factor_temporal=2, scale_factor_spatial=4,
        latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM,
    )


def build_text_encoder(tokenizer, args):  # -> T5EncoderModel
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=args.text_width, d_kv=16, d_ff=2 * args.text_width, num_layers=2,
        num_heads=args.text_width // 16, relative_attention_num_buckets=8, dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    ))  # fmt: skip


def build_transformer(args):  # -> WanTransformer3DModel
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, args.patch, args.patch), num_attention_heads=args.heads, attention_head_dim=32, in_channels=Z_DIM,
        out_channels=Z_DIM, text_dim=args.text_width, freq_dim=64, ffn_dim=4 * 32 * args.heads,
        num_layers=args.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    )  # fmt: skip


def to_video(clips: np.ndarray) -> torch.Tensor:
    """uint8 ``(B, F, H, W, 3)`` -> ``(B, 3, F, H, W)`` in [-1, 1]."""
    return torch.from_numpy(clips).float().div(127.5).sub(1.0).permute(0, 4, 1, 2, 3).contiguous()


#: The VAE's training phases, ``(steps, frames per clip, batch, learning rate)``: short windows
#: first (cheap), then whole clips. A causal VAE trained only on 9-frame windows drifts past them
#: (mean absolute error 8 on frames 1-8, 56 on frame 16: its receptive field never held more than
#: 9 real frames), so the last phase sees the clip's full length.
#: The last phase trains the decoder alone (the latents, hence the denoiser's data, stay as they
#: are), weighting the shape's pixels 5x: before it, small stars came back as circles.
VAE_PHASES = ((600, 9, 8, 1e-3, "all"), (400, NUM_FRAMES, 4, 5e-4, "all"), (400, NUM_FRAMES, 4, 3e-4, "decoder"))


def train_vae(vae, clips: np.ndarray, phase: tuple[int, int, int, float, str], args, t0: float) -> None:
    steps, window, batch, base_lr, part = phase
    g = torch.Generator().manual_seed(args.seed + 1)
    trained = [*vae.post_quant_conv.parameters(), *vae.decoder.parameters()] if part == "decoder" else list(vae.parameters())
    opt = torch.optim.AdamW(trained, lr=base_lr, weight_decay=0.0)
    vae.train()
    run = 0.0
    for step in range(steps):
        lr = base_lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(clips), (batch,), generator=g).numpy()
        start = int(torch.randint(0, NUM_FRAMES - window + 1, (1,), generator=g))
        x = to_video(clips[idx, start : start + window])
        if part == "decoder":
            with torch.no_grad():
                z = vae.encode(x).latent_dist.mean  # what the denoiser learns to make
            rec = vae.decode(z).sample
            background = x[:, :, :1, :1, :1]  # flat backgrounds: the corner's colour
            weight = 1.0 + 4.0 * ((x - background).abs().sum(1, keepdim=True) > 0.1).float()
            loss = (weight * ((rec - x).abs() + (rec - x).pow(2))).mean()
            kl = torch.zeros(())
        else:
            post = vae.encode(x).latent_dist
            rec = vae.decode(post.sample(generator=g)).sample
            kl = post.kl().mean()
            loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + args.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        run = loss.item() if step == 0 else 0.95 * run + 0.05 * loss.item()
        if step % args.log_every == 0 or step == steps - 1:
            log(t0, f"vae ({window} frames) step {step:5d}/{steps} loss {run:.4f} kl {kl.item():.1f}")
    vae.eval()


@torch.no_grad()
def encode_clips(vae, clips: np.ndarray, batch: int = 32) -> torch.Tensor:
    """Posterior means of every clip, raw (before the latents_mean/std normalisation)."""
    out = [vae.encode(to_video(clips[i : i + batch])).latent_dist.mean for i in range(0, len(clips), batch)]
    return torch.cat(out)


def prompt_embeds(text_encoder, tokenizer, prompts: list[str]) -> torch.Tensor:
    """What ``WanPipeline._get_t5_prompt_embeds`` gives: the encoder's states for the real tokens,
    zero-padded to ``MAX_SEQUENCE_LENGTH``. (Encoded at the tokenizer's own length: with the mask
    the real tokens' states do not depend on how much padding follows.)"""
    t = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                  add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    states = text_encoder(t.input_ids, t.attention_mask).last_hidden_state
    states = states * t.attention_mask[..., None].to(states.dtype)
    return F.pad(states, (0, 0, 0, MAX_SEQUENCE_LENGTH - states.shape[1]))


def sample_sigmas(n: int, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=g).clamp(1e-3, 1 - 1e-3)
    return SHIFT * u / (1 + (SHIFT - 1) * u)


class _Both(torch.nn.Module):
    def __init__(self, transformer, text_encoder) -> None:
        super().__init__()
        self.transformer = transformer
        self.text_encoder = text_encoder


def train_denoiser(transformer, text_encoder, tokenizer, latents, clips, args, t0, on_checkpoint=None) -> _Both:
    both = _Both(transformer, text_encoder)
    opt = torch.optim.AdamW(both.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    ema = EMA(both, args.ema)
    g = torch.Generator().manual_seed(args.seed + 2)
    rng = np.random.default_rng(args.seed + 3)
    both.train()
    run = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 100)
        idx = torch.randint(0, len(latents), (args.batch,), generator=g)
        x0 = latents[idx]
        prompts = ["" if rng.random() < args.cond_drop else clip_caption(clips[i], rng) for i in idx.tolist()]
        noise = torch.randn(x0.shape, generator=g)
        sigma = sample_sigmas(len(x0), g)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        emb = prompt_embeds(text_encoder, tokenizer, prompts)
        pred = transformer(xt, timestep=sigma * 1000, encoder_hidden_states=emb, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(both.parameters(), 1.0)
        opt.step()
        ema.update(both)
        run = loss.item() if step == 0 else 0.98 * run + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            log(t0, f"step {step:5d}/{args.steps} loss {run:.4f}")
        if on_checkpoint and args.checkpoint_every and step and step % args.checkpoint_every == 0:
            on_checkpoint(step, ema, both)
    ema.copy_to(both)
    both.eval()
    return both


def make_pipeline(vae, text_encoder, tokenizer, transformer):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_pipeline(pipe, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    # diffusers records where a part came from; the folder must not name this machine's paths.
    for config in out.rglob("*.json"):
        data = json.loads(config.read_text())
        if isinstance(data, dict) and "_name_or_path" in data:
            del data["_name_or_path"]
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "video.json").write_text(json.dumps(VIDEO_DEFAULTS, indent=1) + "\n")


def write_preview_decoders(pipe, out: Path) -> None:
    """``latent_rgb.json`` and ``preview_decoder.safetensors``: the two preview maps, fitted once here
    so a first stream does not fit them."""
    from multistream.video._layout import VideoLatents
    from multistream.video._previews import fit_video_latent_rgb
    from multistream.video._tiny import fit_video_preview_decoder, save_video_preview_decoder

    layout = VideoLatents.of(pipe)
    rgb = fit_video_latent_rgb(layout)
    rgb.save(out / "latent_rgb.json")
    save_video_preview_decoder(fit_video_preview_decoder(pipe.vae, cache=False), out / "preview_decoder.safetensors")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/shapes_wan_video"))
    p.add_argument("--clips", type=int, default=4000)
    p.add_argument("--vae-kl", type=float, default=1e-6)
    p.add_argument("--vae-width", type=int, default=32)
    p.add_argument("--vae-from", type=Path, default=None, help="start from this VAE folder")
    p.add_argument("--skip-vae-training", action="store_true", help="use --vae-from's VAE as it is")
    p.add_argument("--vae-phase-from", type=int, default=0, help="resume --vae-from at this VAE_PHASES index")
    p.add_argument("--stop-after-vae", action="store_true")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--cond-drop", type=float, default=0.1)
    p.add_argument("--heads", type=int, default=6, help="attention heads of 32 channels")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--patch", type=int, default=4,
                   help="latent pixels per token side: 4 latent = 16 image pixels, Wan 2.1's token size")
    p.add_argument("--text-width", type=int, default=64)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.clips, args.steps, args.log_every = 64, 3, 1
    t0 = time.time()
    torch.manual_seed(args.seed)
    clips, meta = make_clip_dataset(args.clips, seed=args.seed, num_frames=NUM_FRAMES)
    log(t0, f"rendered {len(clips)} clips {clips.shape}")
    if args.vae_from is not None:
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan.from_pretrained(args.vae_from)
    else:
        vae = build_vae(args)
    if not args.skip_vae_training:
        phases = VAE_PHASES[args.vae_phase_from:]
        if args.quick:
            phases = tuple((1, window, 1, lr, part) for _, window, _, lr, part in phases)
        for phase in phases:
            train_vae(vae, clips, phase, args, t0)
        vae.save_pretrained(args.out.parent / (args.out.name + "_vae"))
    if args.stop_after_vae:
        return
    vae.eval().requires_grad_(False)
    raw = encode_clips(vae, clips)
    mean = raw.mean(dim=(0, 2, 3, 4))
    std = raw.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean], latents_std=[round(float(v), 5) for v in std])
    latents = (raw - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    log(t0, f"encoded: latents {tuple(latents.shape)}, mean {mean.tolist()}, std {std.tolist()}")
    tokenizer = build_tokenizer(extra_words=NEW_WORDS)
    unknown = [w for w in all_video_words() if w not in tokenizer.get_vocab()]
    if unknown:
        raise SystemExit(f"tokenizer lacks {unknown}")
    text_encoder = build_text_encoder(tokenizer, args)
    transformer = build_transformer(args)
    log(t0, f"transformer {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M params, "
            f"text encoder {sum(p.numel() for p in text_encoder.parameters()) / 1e6:.2f}M")

    def on_checkpoint(step: int, ema: EMA, both: _Both) -> None:
        snapshot = copy.deepcopy(both)
        ema.copy_to(snapshot)
        snapshot.eval()
        pipe = make_pipeline(vae, snapshot.text_encoder, tokenizer, snapshot.transformer)
        save_pipeline(pipe, args.out.parent / f"{args.out.name}_step{step}")
        log(t0, f"checkpoint at step {step}")

    both = train_denoiser(transformer, text_encoder, tokenizer, latents, meta, args, t0, on_checkpoint)
    pipe = make_pipeline(vae, both.text_encoder, tokenizer, both.transformer)
    save_pipeline(pipe, args.out)
    write_preview_decoders(pipe, args.out)
    log(t0, f"wrote {args.out}")


if __name__ == "__main__":
    main()
