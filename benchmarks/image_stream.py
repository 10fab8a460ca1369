"""What live previews cost: ``.stream()`` with previews every step vs the plain pipeline call.

In one process, the runs of each mode are interleaved (the order rotates every round, so drift in
the machine's speed hits all modes alike) and the median of ``--reps`` rounds is kept, after one
warm-up round. All runs use the same prompt, seed and step count. Modes:

* ``plain``: ``pipe(prompt, ...)`` with no step callback, called on the main thread as a user
  would (the baseline);
* ``latent``: ``.stream(preview="latent")`` every step (linear latent->RGB map; target <= 1.03x);
* ``x0``: ``.stream(preview="x0")`` every step (the model's clean-image estimate, same map);
* ``vae``: ``.stream(preview="vae")`` every step (a full VAE decode per step: what a naive
  ``callback_on_step_end`` that decodes the latents does).

The model: ``--model`` (a diffusers folder), else the embedded shapes model if it is installed,
else Stable Diffusion 1.x's architecture with random weights, narrowed so one run takes about a
second on a small CPU (``multistream.testing._random_pipelines.sd15_pipeline("bench")``, 128x128).

    python benchmarks/image_stream.py
    python benchmarks/image_stream.py --random --threads 1
    python benchmarks/image_stream.py --model ./sd-turbo --device cuda --steps 4 --height 512 --width 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODES = ("plain", "latent", "x0", "vae")


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize()


def run_once(model: Any, mode: str, prompt: str, steps: int, seed: int, height: int | None, width: int | None,
             preview_max_side: int = 256) -> tuple[float, dict[str, float]]:  # fmt: skip
    """One timed run: seconds, and the final event's metrics (empty for the plain call)."""
    import torch

    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
    _sync(model.device)
    started = time.perf_counter()
    if mode == "plain":
        # On the calling thread, as a user calls a pipeline: the baseline a stream must match.
        model.pipeline(prompt, num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed), **size)
        metrics: dict[str, float] = {}
    else:
        final = model.stream(prompt, steps=steps, seed=seed, preview=mode, preview_every=1,
                             preview_max_side=preview_max_side, **size).wait()  # fmt: skip
        if final.type != "image" or final.finish_reason != "stop":
            raise RuntimeError(f"the {mode} run failed: {final}")
        metrics = dict(final.metrics or {})
    _sync(model.device)
    return time.perf_counter() - started, metrics


def compare(model: Any, *, prompt: str, steps: int, seed: int, reps: int, height: int | None = None,
            width: int | None = None, modes: tuple[str, ...] = MODES, log: Any = None) -> dict[str, dict[str, float]]:  # fmt: skip
    """Interleaved runs of each mode (one warm-up round, then ``reps`` timed ones); per mode the
    median seconds, the ratio to ``plain`` and the mean preview stats from the stream's metrics."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    stats: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for round_ in range(reps + 1):
        order = modes[round_ % len(modes) :] + modes[: round_ % len(modes)]
        for mode in order:
            seconds, metrics = run_once(model, mode, prompt, steps, seed, height, width)
            if round_ == 0:
                continue  # warm-up: allocator, kernels, caches, the latent->RGB map
            times[mode].append(seconds)
            stats[mode].append(metrics)
        if log is not None and round_:
            log(f"  round {round_}/{reps}: " + "  ".join(f"{m} {times[m][-1]:.3f}s" for m in modes))
    base = statistics.median(times["plain"]) if "plain" in times else None
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        med = statistics.median(times[mode])
        row = {"median_s": med, "min_s": min(times[mode])}
        if base:
            row["ratio"] = med / base
            row["overhead_ms_per_step"] = (med - base) * 1e3 / steps
        for key in ("preview_bytes", "encode_ms", "preview_ms", "previews", "previews_dropped"):
            values = [m[key] for m in stats[mode] if key in m]
            if values:
                row[key] = statistics.fmean(values)
        out[mode] = row
    return out


def print_table(results: dict[str, dict[str, float]], steps: int) -> None:
    print(f"{'mode':<8}{'median s':>10}{'ratio':>8}{'+ms/step':>10}{'previews':>10}{'dropped':>9}"
          f"{'bytes/frame':>13}{'encode ms':>11}{'decode ms':>11}")  # fmt: skip
    for mode, row in results.items():
        def f(key: str, fmt: str) -> str:
            return format(row[key], fmt) if key in row else "-"

        print(f"{mode:<8}{f('median_s', '.3f'):>10}{f('ratio', '.3f'):>8}{f('overhead_ms_per_step', '.2f'):>10}"
              f"{f('previews', '.0f'):>10}{f('previews_dropped', '.1f'):>9}{f('preview_bytes', '.0f'):>13}"
              f"{f('encode_ms', '.2f'):>11}{f('preview_ms', '.2f'):>11}")  # fmt: skip
    print(f"(decode ms: time on the denoising thread per preview; encode ms: on the encoder thread; {steps} steps)")


def load_model(args: argparse.Namespace) -> Any:
    import multistream as ms
    from multistream.image import EMBEDDED_MODEL_DIR

    if args.model:
        return ms.load_image_model(args.model, device=args.device), args.model
    if (EMBEDDED_MODEL_DIR / "model_index.json").is_file() and not args.random:
        return ms.load_image_model(device=args.device), "embedded shapes model"
    import torch

    from multistream.testing._random_pipelines import sd15_pipeline

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))  # fmt: skip
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    pipe = sd15_pipeline("bench", device=device, dtype=dtype)
    if args.height is None:
        args.height = args.width = 128
    return ms.load_image_model(pipe), "SD 1.x architecture, random weights (bench size)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="diffusers folder (default: embedded, else random SD 1.x)")
    ap.add_argument("--random", action="store_true", help="the random-weight SD 1.x pipeline even if the embedded model is there")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (median kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--prompt", default="a red circle on a blue background")
    args = ap.parse_args(argv)

    import diffusers
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model, label = load_model(args)
    print(f"model: {label} ({type(model.pipeline).__name__}, {model.device}, {model.dtype})")
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, threads {torch.get_num_threads()}, "
          f"{args.steps} steps, {args.height or model.default_size[0]}x{args.width or model.default_size[1]}, "
          f"median of {args.reps} interleaved rounds")  # fmt: skip
    results = compare(model, prompt=args.prompt, steps=args.steps, seed=args.seed, reps=args.reps,
                      height=args.height, width=args.width, log=print)  # fmt: skip
    print_table(results, args.steps)
    ratio = results["latent"]["ratio"]
    print(f"latent previews every step: {ratio:.3f}x the plain call (target <= 1.03): {'OK' if ratio <= 1.03 else 'OVER'}")


if __name__ == "__main__":
    main()
