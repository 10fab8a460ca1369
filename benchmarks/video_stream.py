"""What streaming every frame's preview costs a text-to-video model, and what the previews show.

In one plain process, the runs of each mode are interleaved (the order rotates every round, so
drift in the machine's speed hits all modes alike) and the median of ``--reps`` rounds is kept,
after one warm-up round. Both wall time and the process's CPU time (all threads) are reported: on a
machine shared with other work a run's wall time is mostly waiting for a core, its CPU time is not. All runs use the same prompt, seed, frame count and step count.

* ``bare``: the pipeline called on the main thread (``output_type="pt"``) and its frames encoded
  to the same WebM a stream's final event carries: the baseline;
* ``none``, ``latent``, ``x0``, ``tiny``, ``vae``: ``VideoModel.stream(preview=...)`` every step
  (goal: ``latent`` <= 1.02x the bare time, ``tiny`` <= 1.05x).

Also reported: the time to the first preview and the bytes of a preview (animated WebP, and the
JPEG contact sheet), per mode; the mid-run preview's error against the final clip (step
``steps // 2``, every frame scaled to the clip's size, mean absolute difference on 0-255); and the
tiny video decoder's fit time for the random-weight Wan 2.1, CogVideoX and LTX-Video VAEs.

The model: ``--model`` (a diffusers folder), else the embedded video model if it is installed,
else its stand-in (the embedded image model's UNet with a fresh motion adapter, AnimateDiff).

    python benchmarks/video_stream.py
    python benchmarks/video_stream.py --reps 5 --steps 20 --frames 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODES = ("bare", "none", "latent", "x0", "tiny", "vae")
PROMPT = "a red circle moving right on a blue background"


def load(model: str | None) -> Any:
    import multistream as ms
    from multistream.video import EMBEDDED_VIDEO_DIR

    if model:
        return ms.load_video_model(model, device="cpu")
    if (EMBEDDED_VIDEO_DIR / "model_index.json").is_file():
        return ms.load_video_model()
    from multistream.testing._random_video import standin_video_model

    return standin_video_model()


def bare(vm: Any, steps: int, frames: int, seed: int) -> None:
    import torch

    from multistream.video import encode_clip
    from multistream.video._previews import to_uint8

    h, w = vm.default_size
    out = vm.pipeline(PROMPT, num_inference_steps=steps, num_frames=frames, height=h, width=w, output_type="pt",
                      guidance_scale=vm.default_guidance_scale, generator=torch.Generator("cpu").manual_seed(seed))
    encode_clip(to_uint8(out.frames[0].float(), None), "webm", fps=vm.default_fps)


def streamed(vm: Any, mode: str, steps: int, frames: int, seed: int, fmt: str = "webp") -> tuple[Any, list[Any]]:
    events = list(vm.stream(PROMPT, steps=steps, num_frames=frames, seed=seed, preview=mode, preview_format=fmt))
    final = events[-1]
    if final.finish_reason != "stop":
        raise RuntimeError(f"the {mode} run failed: {final}")
    return final, events[:-1]


def mid_error(final: Any, previews: list[Any], step: int) -> float | None:
    import numpy as np

    chosen = [p for p in previews if p.step == step]
    if not chosen:
        return None
    size = final.frames[0].size
    clip = np.stack([np.asarray(f, dtype=np.float64) for f in final.frames])
    shown = np.stack([np.asarray(f.resize(size), dtype=np.float64) for f in chosen[0].frames])
    return float(np.abs(shown - clip).mean())


def fit_times() -> dict[str, float]:
    from multistream.testing._random_video import tiny_video_pipeline
    from multistream.video import fit_video_preview_decoder

    out = {}
    for family in ("wan", "cogvideox", "ltx"):
        vae = tiny_video_pipeline(family).vae
        started = time.perf_counter()
        fit_video_preview_decoder(vae, cache=False)
        out[family] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fit", action="store_true", help="skip the decoder fit timings")
    args = parser.parse_args()

    vm = load(args.model)
    frames = args.frames or vm.default_num_frames
    h, w = vm.default_size
    print(f"model {vm.name} ({vm.layout.family}), {frames} frames {w}x{h}, {args.steps} steps, {args.reps} rounds")
    for mode in ("latent", "tiny"):  # decoders made (or fitted) before any timing
        vm.stream(PROMPT, steps=1, num_frames=frames, preview=mode).wait()

    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    ttfp: dict[str, list[float]] = {m: [] for m in MODES}
    nbytes: dict[str, list[float]] = {m: [] for m in MODES}
    errors: dict[str, float | None] = {}
    for rnd in range(args.reps + 1):
        order = MODES[rnd % len(MODES):] + MODES[: rnd % len(MODES)]
        for mode in order:
            started, cpu_started = time.perf_counter(), time.process_time()
            if mode == "bare":
                bare(vm, args.steps, frames, args.seed)
            else:
                final, previews = streamed(vm, mode, args.steps, frames, args.seed)
            elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
            if mode != "bare":
                if rnd == 0 and mode != "none":
                    errors[mode] = mid_error(final, previews, args.steps // 2)
                if rnd > 0 and "ttfp_ms" in final.metrics:
                    ttfp[mode].append(final.metrics["ttfp_ms"])
                    nbytes[mode].append(final.metrics["preview_bytes_mean"])
            if rnd > 0:  # round 0 warms up
                times[mode].append(elapsed)
                cpu[mode].append(cpu_s)
    base, cpu_base = statistics.median(times["bare"]), statistics.median(cpu["bare"])
    print(f"\n{'mode':8} {'clip s':>8} {'x bare':>7} {'cpu s':>7} {'x bare':>7} {'1st preview ms':>15} {'bytes/preview':>14} "
          f"{'err@' + str(args.steps // 2):>8}")
    for mode in MODES:
        t, c = statistics.median(times[mode]), statistics.median(cpu[mode])
        first = f"{statistics.median(ttfp[mode]):.0f}" if ttfp[mode] else "-"
        size = f"{statistics.median(nbytes[mode]):.0f}" if nbytes[mode] else "-"
        err = errors.get(mode)
        print(f"{mode:8} {t:8.2f} {t / base:7.3f} {c:7.2f} {c / cpu_base:7.3f} {first:>15} {size:>14} "
              f"{'-' if err is None else f'{err:.1f}':>8}")
    final, previews = streamed(vm, "tiny", args.steps, frames, args.seed, fmt="sheet")
    print(f"\ncontact sheet (tiny): {statistics.median([len(p.data) for p in previews]):.0f} bytes a preview; "
          f"final clip {final.mime} {len(final.data)} bytes")
    if not args.no_fit:
        print("\ntiny video decoder fit (default options, random-weight VAEs):")
        for family, seconds in fit_times().items():
            print(f"  {family:10} {seconds:6.1f} s")
    vm.close()


if __name__ == "__main__":
    main()
