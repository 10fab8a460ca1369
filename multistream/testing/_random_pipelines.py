"""Random-weight diffusers pipelines built offline, for tests and benchmarks (no download).

Each builder makes the components from configs written here, as diffusers' own tests do, with
tokenizers built from a vocabulary made on the spot (a byte-level CLIP BPE with no merges, a
T5-style unigram model), so nothing is fetched from the hub:

* `tiny_sd_pipeline`, `tiny_sdxl_pipeline`, `tiny_sd3_pipeline`, `tiny_flux_pipeline`: tiny
  models of each family (milliseconds per step on a CPU);
* `sd15_pipeline`: the real Stable Diffusion 1.5 architecture and sizes (UNet, VAE, CLIP ViT-L
  text encoder), or a scaled-down variant of it (``scale="bench"``) for CPU benchmarks.

The weights are random, so the images are noise; the point is the shapes, the code paths and
the timings. Private: not part of the public API.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

__all__ = [
    "offline_clip_tokenizer",
    "offline_t5_tokenizer",
    "sd15_pipeline",
    "tiny_flux_pipeline",
    "tiny_sd3_pipeline",
    "tiny_sd_pipeline",
    "tiny_sdxl_pipeline",
]


def offline_clip_tokenizer(max_length: int = 77) -> Any:
    """A working `CLIPTokenizer` (514 tokens: every byte, alone and word-final, and the two
    specials) made without a download. It splits words into characters; for random-weight text
    encoders that is as good as the real vocabulary."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())  # the 256 printable stand-ins for bytes (CLIP's, GPT-2's)
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as fh:
            json.dump(vocab, fh)
        with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as fh:
            fh.write("#version: 0.2\n")
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
            json.dump({"model_max_length": max_length, "tokenizer_class": "CLIPTokenizer"}, fh)
        return CLIPTokenizer.from_pretrained(folder)


def offline_t5_tokenizer(max_length: int = 512) -> Any:
    """A T5-style tokenizer (unigram over letters, ``<pad>``=0, ``</s>``=1, ``<unk>``=2) built with
    the ``tokenizers`` library, wrapped as transformers' ``T5TokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + c, -1.0) for c in letters] + [(c, -2.0) for c in letters]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=max_length,
    )


def _clip_config(**overrides: Any) -> Any:
    from transformers import CLIPTextConfig

    cfg: dict[str, Any] = dict(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=1, vocab_size=1000, hidden_act="gelu",
        projection_dim=32,
    )  # fmt: skip
    cfg.update(overrides)
    return CLIPTextConfig(**cfg)


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def _scheduler(name: str, **overrides: Any) -> Any:
    import diffusers

    sd_betas = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
    if name == "ddim":
        return diffusers.DDIMScheduler(**sd_betas, clip_sample=False, set_alpha_to_one=False, steps_offset=1, **overrides)
    if name == "pndm":
        return diffusers.PNDMScheduler(**sd_betas, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1, **overrides)
    if name == "euler":
        return diffusers.EulerDiscreteScheduler(**sd_betas, steps_offset=1, **overrides)
    if name == "dpm":
        return diffusers.DPMSolverMultistepScheduler(**sd_betas, steps_offset=1, **overrides)
    if name == "flow":
        return diffusers.FlowMatchEulerDiscreteScheduler(**overrides)
    raise ValueError(f"unknown scheduler {name!r}; use ddim, pndm, euler, dpm or flow")


def _two_block_unet(**overrides: Any) -> Any:
    from diffusers import UNet2DConditionModel

    config: dict[str, Any] = dict(
        layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    return UNet2DConditionModel(**{**config, **overrides})


def _two_block_vae(**overrides: Any) -> Any:
    from diffusers import AutoencoderKL

    config: dict[str, Any] = dict(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
    )  # fmt: skip
    return AutoencoderKL(**{**config, **overrides})


def tiny_sd_pipeline(seed: int = 0, scheduler: str = "ddim", sample_size: int = 32) -> Any:
    """A tiny Stable Diffusion 1.x-style pipeline (4-channel latents, VAE factor 2, 64x64 default)."""
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTextModel

    _seeded(seed)
    unet = _two_block_unet(block_out_channels=(4, 8), sample_size=sample_size, cross_attention_dim=32, norm_num_groups=2)
    vae = _two_block_vae(block_out_channels=[4, 8], norm_num_groups=2)
    text_encoder = CLIPTextModel(_clip_config(num_attention_heads=8, intermediate_size=64, num_hidden_layers=2))
    return StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=offline_clip_tokenizer(),
        scheduler=_scheduler(scheduler), safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def tiny_sdxl_pipeline(seed: int = 0, scheduler: str = "euler") -> Any:
    """A tiny SDXL-style pipeline (two text encoders, micro-conditioning, 64x64 default)."""
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    _seeded(seed)
    unet = _two_block_unet(
        block_out_channels=(32, 64), attention_head_dim=(2, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=80, cross_attention_dim=64, norm_num_groups=1,
    )  # fmt: skip
    vae = _two_block_vae(block_out_channels=[32, 64], sample_size=128)
    cfg = _clip_config()
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(cfg), text_encoder_2=CLIPTextModelWithProjection(cfg),
        tokenizer=offline_clip_tokenizer(), tokenizer_2=offline_clip_tokenizer(), unet=unet,
        scheduler=_scheduler(scheduler), force_zeros_for_empty_prompt=True, add_watermarker=False,
    )  # fmt: skip


def tiny_sd3_pipeline(seed: int = 0) -> Any:
    """A tiny Stable Diffusion 3-style pipeline (MMDiT, flow matching, shift_factor; no T5)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    _seeded(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
    )  # fmt: skip
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )  # fmt: skip
    cfg = _clip_config()
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=_scheduler("flow"), vae=vae,
        text_encoder=CLIPTextModelWithProjection(cfg), tokenizer=offline_clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(cfg), tokenizer_2=offline_clip_tokenizer(),
        text_encoder_3=None, tokenizer_3=None,
    )  # fmt: skip


def tiny_flux_pipeline(seed: int = 0) -> Any:
    """A tiny Flux-style pipeline (packed 2x2 latents, CLIP + T5 text encoders, flow matching)."""
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    _seeded(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )  # fmt: skip
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )  # fmt: skip
    t5 = T5EncoderModel(
        T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
                 decoder_start_token_id=0, relative_attention_num_buckets=8)
    )  # fmt: skip
    return FluxPipeline(
        scheduler=_scheduler("flow"), vae=vae, text_encoder=CLIPTextModel(_clip_config()),
        tokenizer=offline_clip_tokenizer(), text_encoder_2=t5, tokenizer_2=offline_t5_tokenizer(),
        transformer=transformer,
    )  # fmt: skip


# Stable Diffusion 1.5's component configs (runwayml/stable-diffusion-v1-5), and a scaled-down
# variant of the same architecture for CPU benchmarks.
_SD15 = {
    "unet": dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
    ),
    "vae": dict(
        sample_size=512, in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    ),
    "text": dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=2,
        pad_token_id=1,
    ),
}  # fmt: skip
_SD15_BENCH = {
    "unet": dict(_SD15["unet"], block_out_channels=(32, 64, 128, 128), attention_head_dim=4, cross_attention_dim=128, sample_size=32),
    "vae": dict(_SD15["vae"], block_out_channels=(16, 32, 64, 64), layers_per_block=1, norm_num_groups=16, sample_size=256),
    "text": dict(_SD15["text"], hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, projection_dim=128, vocab_size=1000),
}  # fmt: skip
_SD15_TINY = {
    "unet": dict(_SD15["unet"], block_out_channels=(8, 16, 32, 32), attention_head_dim=2, cross_attention_dim=32, norm_num_groups=8, sample_size=16),
    "vae": dict(_SD15["vae"], block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=128),
    "text": dict(_SD15["text"], hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32, vocab_size=1000),
}  # fmt: skip


def sd15_pipeline(
    scale: str = "full",
    scheduler: str = "pndm",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Any:
    """Stable Diffusion 1.5's architecture with random weights, built directly on ``device``.

    ``scale``: ``"full"`` (SD 1.5's real sizes: ~860M-parameter UNet, 512x512 default),
    ``"bench"`` (same architecture, narrower: 256x256 default, about a second a run on a small
    CPU) or ``"tiny"`` (for smoke tests). ``scheduler``: pndm (SD 1.5's), ddim, euler, dpm.
    """
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    configs = {"full": _SD15, "bench": _SD15_BENCH, "tiny": _SD15_TINY}.get(scale)
    if configs is None:
        raise ValueError(f"unknown scale {scale!r}; use full, bench or tiny")
    _seeded(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**configs["unet"])
        vae = AutoencoderKL(**configs["vae"])
        text_encoder = CLIPTextModel(CLIPTextConfig(**configs["text"]))
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=offline_clip_tokenizer(),
        scheduler=_scheduler(scheduler), safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    return pipe if dtype == torch.float32 else pipe.to(device=device, dtype=dtype)
