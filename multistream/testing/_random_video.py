"""Random-weight diffusers video pipelines built offline, for tests and benchmarks (no download).

Tiny configs after diffusers' own ``get_dummy_components`` (``tests/pipelines/{wan,cogvideo,ltx,
animatediff}``), with the offline tokenizers of `multistream.testing._random_pipelines`, one per
latent layout: Wan 2.1 (channels before frames), CogVideoX (frames before channels), LTX-Video
(packed tokens) and AnimateDiff (a 2D VAE per frame; on SDXL too, whose pooled prompt joins the time
embedding). The weights are random, so the clips are
noise; the point is the shapes and the code paths. `shapes_animatediff_pipeline` wraps the
embedded image model's UNet with a fresh `MotionAdapter`: the stand-in for the embedded video model.

Example:
    >>> pipe = tiny_wan_pipeline()                                          # doctest: +SKIP
    >>> pipe("a cat", num_frames=9, height=16, width=16, num_inference_steps=2)   # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._random_pipelines import offline_clip_tokenizer, offline_t5_tokenizer

__all__ = [
    "RANDOM_VIDEO_FAMILIES",
    "shapes_animatediff_pipeline",
    "standin_video_model",
    "tiny_animatediff_pipeline",
    "tiny_animatediff_sdxl_pipeline",
    "tiny_cogvideox_pipeline",
    "tiny_ltx_pipeline",
    "tiny_video_pipeline",
    "tiny_wan_pipeline",
]


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def _in_eval_mode(build: Callable[[int], Any]) -> Callable[[int], Any]:
    """``build``'s pipeline with every module in eval mode, as ``from_pretrained`` leaves them:
    modules built from a config start in training mode, whose dropout makes two runs with one seed differ."""

    @functools.wraps(build)
    def built(seed: int = 0) -> Any:
        pipe = build(seed)
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()
        return pipe

    return built


def _tiny_clip() -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=1, vocab_size=1000, hidden_act="gelu",
        projection_dim=32,
    ))  # fmt: skip


def _tiny_t5(d_model: int = 32) -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=80, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0))


@_in_eval_mode
def tiny_wan_pipeline(seed: int = 0) -> Any:
    """Wan 2.1 text-to-video: latents ``(B, 16, F', H/8, W/8)``, ``F' = (F - 1) / 4 + 1``."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    _seeded(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )  # fmt: skip
    return WanPipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                       text_encoder=_tiny_t5(), tokenizer=offline_t5_tokenizer(64))


@_in_eval_mode
def tiny_cogvideox_pipeline(seed: int = 0) -> Any:
    """CogVideoX: latents ``(B, F', 4, H/8, W/8)`` (frames before channels)."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    _seeded(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2, text_embed_dim=32,
        num_layers=1, sample_width=2, sample_height=2, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=16,
    )  # fmt: skip
    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
    )  # fmt: skip
    return CogVideoXPipeline(tokenizer=offline_t5_tokenizer(16), text_encoder=_tiny_t5(), vae=vae,
                             transformer=transformer, scheduler=CogVideoXDDIMScheduler())


@_in_eval_mode
def tiny_ltx_pipeline(seed: int = 0) -> Any:
    """LTX-Video: packed latents ``(B, F' * H' * W', 8)`` tokens, 8x in time, 32x in space."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    _seeded(seed)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=1, caption_channels=32,
    )  # fmt: skip
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )  # fmt: skip
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=_tiny_t5(),
                       tokenizer=offline_t5_tokenizer(16), transformer=transformer)


@_in_eval_mode
def tiny_animatediff_pipeline(seed: int = 0) -> Any:
    """AnimateDiff: a Stable Diffusion UNet with a motion adapter; latents ``(B, 4, F, H/2, W/2)``."""
    from diffusers import AnimateDiffPipeline, AutoencoderKL, DDIMScheduler, MotionAdapter, UNet2DConditionModel

    _seeded(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, norm_num_groups=2,
    )  # fmt: skip
    vae = AutoencoderKL(block_out_channels=[8, 16], in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
    adapter = MotionAdapter(block_out_channels=(8, 16), motion_layers_per_block=1, motion_norm_num_groups=2,
                            motion_num_attention_heads=2, use_motion_mid_block=False)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="linear", clip_sample=False)
    return AnimateDiffPipeline(unet=unet, vae=vae, scheduler=scheduler, motion_adapter=adapter,
                               text_encoder=_tiny_clip(), tokenizer=offline_clip_tokenizer(),
                               feature_extractor=None, image_encoder=None)


def tiny_animatediff_sdxl_pipeline(seed: int = 0) -> Any:
    """AnimateDiff on SDXL: two CLIP encoders, and the pooled prompt joins the time embedding
    (``add_text_embeds``, which a steer must replace as well); latents ``(B, 4, F, H/2, W/2)``."""
    from diffusers import AnimateDiffSDXLPipeline, AutoencoderKL, DDIMScheduler, MotionAdapter, UNet2DConditionModel
    from transformers import CLIPTextModelWithProjection

    _seeded(seed)
    text_encoder = _tiny_clip()
    text_encoder_2 = CLIPTextModelWithProjection(text_encoder.config)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64, norm_num_groups=2, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + text_encoder_2.config.projection_dim,
    )  # fmt: skip  (cross-attention: the two encoders' states side by side; the six numbers: SDXL's sizes)
    vae = AutoencoderKL(block_out_channels=[8, 16], in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
    adapter = MotionAdapter(block_out_channels=(8, 16), motion_layers_per_block=1, motion_norm_num_groups=2,
                            motion_num_attention_heads=2, use_motion_mid_block=False)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="linear", clip_sample=False)
    return AnimateDiffSDXLPipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                   tokenizer=offline_clip_tokenizer(), tokenizer_2=offline_clip_tokenizer(), unet=unet,
                                   motion_adapter=adapter, scheduler=scheduler)


@_in_eval_mode
def shapes_animatediff_pipeline(seed: int = 0) -> Any:
    """The embedded image model's UNet, VAE and text encoder in an `AnimateDiffPipeline` with a fresh
    `MotionAdapter` (its output layers start at zero, so each frame is the image model's picture):
    the stand-in for the embedded video model while it is not installed."""
    from diffusers import AnimateDiffPipeline, DiffusionPipeline, MotionAdapter

    from ..image import EMBEDDED_MODEL_DIR

    image = DiffusionPipeline.from_pretrained(str(EMBEDDED_MODEL_DIR), local_files_only=True)
    _seeded(seed)
    channels = tuple(image.unet.config.block_out_channels)
    groups = int(image.unet.config.norm_num_groups)
    adapter = MotionAdapter(block_out_channels=channels, motion_layers_per_block=int(image.unet.config.layers_per_block),
                            motion_norm_num_groups=groups, motion_num_attention_heads=2, use_motion_mid_block=False,
                            motion_max_seq_length=32)
    return AnimateDiffPipeline(unet=image.unet, vae=image.vae, scheduler=image.scheduler, motion_adapter=adapter,
                               text_encoder=image.text_encoder, tokenizer=image.tokenizer,
                               feature_extractor=None, image_encoder=None)


#: What the stand-in makes when nothing else is asked: the embedded image model's size, 16 frames.
STANDIN_DEFAULTS = {"num_frames": 16, "fps": 8, "steps": 20, "guidance_scale": 7.5, "width": 64, "height": 64}


def standin_video_model(seed: int = 0, **kw: Any) -> Any:
    """`shapes_animatediff_pipeline` as a `multistream.video.VideoModel` that previews with the embedded
    image model's shipped decoder and latent map (per frame): the embedded video model's stand-in
    for tests and benchmarks until ``multistream/_models/shapes_video`` is installed."""
    from ..image import EMBEDDED_IMAGE_SIZES, EMBEDDED_MODEL_DIR
    from ..video import VideoModel

    kw.setdefault("defaults", STANDIN_DEFAULTS)
    kw.setdefault("sizes", EMBEDDED_IMAGE_SIZES)
    return VideoModel(shapes_animatediff_pipeline(seed), model_dir=EMBEDDED_MODEL_DIR, name="standin:shapes-animatediff", **kw)


#: Builder and the arguments of a small call of each random family: ``{name: (builder, kwargs)}``.
RANDOM_VIDEO_FAMILIES: dict[str, tuple[Any, dict[str, int]]] = {
    "wan": (tiny_wan_pipeline, {"num_frames": 9, "height": 16, "width": 16}),
    "cogvideox": (tiny_cogvideox_pipeline, {"num_frames": 9, "height": 16, "width": 16, "max_sequence_length": 16}),
    "ltx": (tiny_ltx_pipeline, {"num_frames": 9, "height": 32, "width": 32}),
    "animatediff": (tiny_animatediff_pipeline, {"num_frames": 4, "height": 16, "width": 16}),
    "animatediff_sdxl": (tiny_animatediff_sdxl_pipeline, {"num_frames": 4, "height": 16, "width": 16}),
}


def tiny_video_pipeline(family: str, seed: int = 0) -> Any:
    """The random pipeline of ``family`` (a key of `RANDOM_VIDEO_FAMILIES`)."""
    try:
        builder = RANDOM_VIDEO_FAMILIES[family][0]
    except KeyError:
        raise ValueError(f"unknown video family {family!r}; use one of {', '.join(RANDOM_VIDEO_FAMILIES)}") from None
    with torch.random.fork_rng():
        return builder(seed)
