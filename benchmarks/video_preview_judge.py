"""Does the mid-run preview already show what the prompt asks? The embedded video model's preview
at step 10 of 20, in each preview mode, judged like its final clips (colour, shape, background and
direction of motion by the frames' colour masks, `multistream._shapes._judge.judge_clip`) on the
24 prompts its test judges.

Each run goes through the public API (``VideoModel.stream(prompt, seed=i, steps=20,
preview=mode, preview_every=9)``: steps 1, 10, 19) and is cancelled once its step-10 preview has arrived, so a mode
costs half a clip per prompt. ``--final`` also judges the finished clips (the default preview).
The preview is judged at the size it travels at (``"latent"`` and ``"x0"`` map the 8x8 latent
frames: the judge reads them as they are).

    python benchmarks/video_preview_judge.py
    python benchmarks/video_preview_judge.py --modes tiny x0 --final
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODES = ("latent", "x0", "tiny", "vae")
STEPS, MID = 20, 10
TEST_PROMPTS = 8  # tests/video/test_shapes_video_model.py judges the mid-run preview of the first 8


def preview_at(vm: Any, prompt: str, seed: int, mode: str, step: int = MID) -> Any:
    """The ``step``-th preview of a ``STEPS``-step run (then the run is cancelled)."""
    # Previews come at steps 1, 1 + every, 1 + 2 * every, ...
    stream = vm.stream(prompt, seed=seed, steps=STEPS, preview=mode, preview_every=step - 1)
    try:
        for ev in stream:
            if ev.type == "video" and not ev.is_final and ev.step == step:
                return ev
        raise RuntimeError(f"no step-{step} preview for {prompt!r} in mode {mode}")
    finally:
        stream.cancel()


def tally(verdicts: list[Any]) -> dict[str, int]:
    return {k: sum(bool(getattr(v, f"{k}_ok")) for v in verdicts) for k in ("color", "shape", "background", "motion")}


def main() -> None:
    import multistream as ms
    from multistream._shapes import judged_video_prompts
    from multistream._shapes._judge import judge_clip

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--final", action="store_true", help="also judge the finished clips")
    ap.add_argument("--prompts", type=int, default=24, help="judge the first N of the 24 prompts")
    args = ap.parse_args()

    vm = ms.load_video_model()
    prompts = judged_video_prompts()[: args.prompts]
    rows, first = [], {}
    for mode in args.modes:
        started = time.perf_counter()
        verdicts, sizes = [], set()
        for i, prompt in enumerate(prompts):
            ev = preview_at(vm, prompt, i, mode)
            sizes.add(f"{ev.width}x{ev.height}")
            verdicts.append(judge_clip(ev.frames, prompt))
        rows.append((f"{mode} @ step {MID}", "/".join(sorted(sizes)), tally(verdicts), time.perf_counter() - started))
        first[mode] = tally(verdicts[:TEST_PROMPTS])
    if args.final:
        started = time.perf_counter()
        verdicts = [judge_clip(vm.generate(p, seed=i, steps=STEPS).frames, p) for i, p in enumerate(prompts)]
        rows.append(("final", "64x64", tally(verdicts), time.perf_counter() - started))
    print(f"embedded video model, {len(prompts)} prompts, {STEPS} steps; right out of {len(prompts)}:\n")
    print("| what is judged | frames | colour | shape | background | direction of motion | time |")
    print("|---|---|---|---|---|---|---|")
    for name, size, t, secs in rows:
        print(f"| {name} | {size} | {t['color']} | {t['shape']} | {t['background']} | {t['motion']} | {secs:.0f} s |")
    if first and len(prompts) >= TEST_PROMPTS:
        print(f"\nthe first {TEST_PROMPTS} prompts (the test's MID_RUN_MEASURED: colour, shape, background, motion):")
        for mode, t in first.items():
            print(f"    {mode!r}: ({t['color']}, {t['shape']}, {t['background']}, {t['motion']}),")


if __name__ == "__main__":
    main()
