"""GPU check of the video family: the embedded model on CUDA, and previews on a Wan 2.1 1.3B-sized model.

Two parts, in one plain process:

1. **The embedded video model** loaded with ``ms.load_video_model()`` (``device="auto"``: CUDA,
   bfloat16), its clip time, and the colour-mask judge (`multistream._shapes._judge.judge_clip`) on
   the 24 judged prompts: shape, colour, background and direction of motion, as on the CPU.
2. **A Wan 2.1 T2V-1.3B-sized pipeline with random weights** (the transformer's exact configuration:
   30 layers, 12 heads of 128, FFN 8960; Wan 2.1's VAE; a small T5 with Wan's 4096-wide output stands
   in for UMT5-XXL, which runs once per prompt), bfloat16, 480x832, 33 frames, 8 steps: the whole clip's time
   with each preview mode against the bare pipeline, interleaved, median of ``--reps`` rounds after a
   short warm-up (benchmarks/video_stream.py's table), the time to the first preview, bytes per
   preview, and the tiny decoder's fit time on this VAE.

Where PyAV is missing (the GPU machine's image has none), the clip is encoded with OpenCV's MPEG-4
in both the bare and the streamed runs, and the output says so.

    python benchmarks/gpu_check.py --video          # on a CUDA machine (about 3 minutes on an H200)
    python benchmarks/gpu_check.py --video --tiny   # anywhere: tiny models on the CPU, to check the script
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
import traceback
from typing import Any

import torch

PROMPT = "a red circle moving right on a blue background"
MODES = ("bare", "none", "latent", "x0", "tiny", "vae")


def wan_1_3b_pipeline(tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    """Wan 2.1 T2V-1.3B's transformer and VAE configurations with random weights (``tiny``: the test config)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from multistream.testing._random_pipelines import offline_t5_tokenizer
    from multistream.testing._random_video import _tiny_t5, tiny_wan_pipeline

    if tiny:  # the same dtypes as the full check: transformer and text encoder in dtype, the VAE in float32
        return in_wans_dtypes(tiny_wan_pipeline().to(device=device), dtype)
    torch.manual_seed(0)
    with torch.device(device):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        )  # fmt: skip
        vae = AutoencoderKLWan(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                               temperal_downsample=[False, True, True])
        text_encoder = _tiny_t5(d_model=4096)
    pipe = WanPipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       text_encoder=text_encoder, tokenizer=offline_t5_tokenizer(64))
    for module in (transformer, vae, text_encoder):
        module.eval()
    return in_wans_dtypes(pipe, dtype)


def in_wans_dtypes(pipe: Any, dtype: torch.dtype) -> Any:
    """The transformer and text encoder in ``dtype`` but for the modules diffusers keeps in float32
    (as ``from_pretrained(torch_dtype=...)`` leaves them), and the VAE in float32 (Wan's model card)."""
    pipe.text_encoder.to(dtype)
    transformer = pipe.transformer.to(dtype)
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, module in transformer.named_modules():
        if keep & set(name.split(".")):
            module.to(torch.float32)
    return pipe


def encode_without_pyav() -> str | None:
    """Where PyAV is missing, make ``encode_clip`` (the streamed runs' and the bare baseline's) write
    OpenCV's MPEG-4 instead; returns what the output should say, or None when PyAV is there."""
    if importlib.util.find_spec("av") is not None:
        return None
    import tempfile

    import cv2

    import multistream.events as events
    import multistream.video as video
    import multistream.video._run as run

    def encode_clip(frames: Any, fmt: str, *, fps: float) -> tuple[bytes, str]:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "clip.mp4")
            height, width = frames.shape[1:3]
            writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (width, height))
            for frame in frames:
                writer.write(frame[:, :, ::-1].copy())
            writer.release()
            with open(path, "rb") as f:
                return f.read(), "video/mp4"

    original_decode = events._decode_frames

    def decode_frames(ev: Any) -> list[Any]:  # VideoEvent.frames of a clip
        if not ev.mime.startswith("video/"):
            return original_decode(ev)
        from PIL import Image

        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "clip.mp4")
            with open(path, "wb") as f:
                f.write(ev.data)
            capture, frames = cv2.VideoCapture(path), []
            ok, frame = capture.read()
            while ok:
                frames.append(Image.fromarray(frame[:, :, ::-1].copy()))
                ok, frame = capture.read()
            capture.release()
            return frames

    run.encode_clip = encode_clip
    video.encode_clip = encode_clip  # what benchmarks/video_stream.py's bare run calls
    events._decode_frames = decode_frames
    return "PyAV is not installed here: clips encoded and read with OpenCV's MPEG-4 (mp4v), bare and streamed alike"


def embedded_part(tiny: bool, log: Any = print) -> None:
    import multistream as ms
    from multistream._shapes._judge import judge_clip
    from multistream._shapes._motion import judged_video_prompts

    started = time.perf_counter()
    vm = ms.load_video_model(device="cpu" if tiny else "auto")
    log(f"embedded video model: loaded in {time.perf_counter() - started:.1f} s on {vm.device}, "
        f"{vm.pipeline.unet.dtype}")  # fmt: skip
    prompts = judged_video_prompts()[: 4 if tiny else None]
    vm.generate(prompts[0], seed=0, steps=2)  # warm-up
    seconds, verdicts = [], []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        final = vm.generate(prompt, seed=i, preview="tiny")
        seconds.append(time.perf_counter() - t0)
        verdicts.append(judge_clip(final.frames, prompt))
    n = len(prompts)

    def count(attr: str) -> int:
        return sum(getattr(v, attr) is not False for v in verdicts)

    log(f"  {n} judged prompts, {final.num_frames} frames {final.width}x{final.height}, default steps: clip "
        f"{statistics.median(seconds):.2f} s median (streamed with tiny previews, encoded)")
    log(f"  judge: shape {count('shape_ok')}/{n}, colour {count('color_ok')}/{n}, background "
        f"{count('background_ok')}/{n}, direction of motion {count('motion_ok')}/{n}")
    vm.close()


def wan_part(tiny: bool, reps: int, steps: int, frames: int, log: Any = print) -> None:
    import video_stream as vs

    import multistream as ms
    from multistream.video import fit_video_preview_decoder

    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.bfloat16
    height, width = (32, 32) if tiny else (480, 832)
    started = time.perf_counter()
    pipe = wan_1_3b_pipeline(tiny, device, dtype)
    params = sum(p.numel() for p in pipe.transformer.parameters()) / 1e9
    log(f"\nWan 2.1 layout, random weights: transformer {params:.2f}B parameters, built in "
        f"{time.perf_counter() - started:.1f} s; {dtype}, {frames} frames {width}x{height}, {steps} steps")
    t0 = time.perf_counter()
    decoder = fit_video_preview_decoder(pipe.vae, cache=False)
    log(f"  tiny video decoder fitted to this VAE in {time.perf_counter() - t0:.1f} s")
    vm = ms.load_video_model(pipe, preview_decoder=decoder,
                             defaults={"num_frames": frames, "height": height, "width": width, "fps": 16})
    for mode in MODES[1:]:  # warm-up: kernels, allocator, the latent map's fit
        vs.streamed(vm, mode, 2, frames, 0)
    vs.bare(vm, 2, frames, 0)

    times: dict[str, list[float]] = {m: [] for m in MODES}
    ttfp: dict[str, list[float]] = {m: [] for m in MODES}
    nbytes: dict[str, list[float]] = {m: [] for m in MODES}
    errors: dict[str, float | None] = {}
    for rnd in range(reps):
        order = MODES[rnd % len(MODES):] + MODES[: rnd % len(MODES)]
        for mode in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            if mode == "bare":
                vs.bare(vm, steps, frames, 0)
            else:
                final, previews = vs.streamed(vm, mode, steps, frames, 0)
                if rnd == 0 and mode != "none":
                    errors[mode] = vs.mid_error(final, previews, steps // 2)
                if "ttfp_ms" in final.metrics:
                    ttfp[mode].append(final.metrics["ttfp_ms"])
                    nbytes[mode].append(final.metrics["preview_bytes_mean"])
            times[mode].append(time.perf_counter() - t)
            log(f"  round {rnd + 1} {mode}: {times[mode][-1]:.2f} s")  # kept in the log should the run be cut short
    base = statistics.median(times["bare"])
    log(f"\n  {'mode':8} {'clip s':>8} {'x bare':>7} {'1st preview ms':>15} {'bytes/preview':>14} {'err@' + str(steps // 2):>8}")
    for mode in MODES:
        t = statistics.median(times[mode])
        first = f"{statistics.median(ttfp[mode]):.0f}" if ttfp[mode] else "-"
        size = f"{statistics.median(nbytes[mode]):.0f}" if nbytes[mode] else "-"
        err = errors.get(mode)
        log(f"  {mode:8} {t:8.2f} {t / base:7.3f} {first:>15} {size:>14} {'-' if err is None else f'{err:.1f}':>8}")
    if device.type == "cuda":
        log(f"  peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    vm.close()


def run(tiny: bool, reps: int = 2, steps: int | None = None, frames: int | None = None, log: Any = print) -> None:
    note = encode_without_pyav()
    if note:
        log(note)
    try:
        embedded_part(tiny, log)
    except Exception:  # the Wan part still runs; the traceback says what failed
        traceback.print_exc()
    wan_part(tiny, reps, steps or (4 if tiny else 8), frames or (9 if tiny else 33), log)
