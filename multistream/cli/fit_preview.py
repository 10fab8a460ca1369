"""``multistream fit-preview [MODEL]``: distil a tiny preview decoder from a model's VAE.

The decoder is cached by a hash of the VAE's weights (in ``$MULTISTREAM_CACHE``, else
``~/.cache/multistream``), where ``preview="tiny"`` finds it; ``--out`` also writes it to a file
(put it in a model folder as ``preview_decoder.safetensors`` to ship it with the model). A model
that ships one (the embedded model does) is not fitted again: the command says so and ``--out``
copies the shipped file; ``--force`` (or ``--steps``, ``--width``) fits anew. On a terminal, progress bars
(the x0 runs step by step, the training data, the fit) go to stderr; elsewhere a line per stage.

Example:
    $ multistream fit-preview                        # the embedded shapes model
    $ multistream fit-preview ./sd-turbo --device cuda
    $ multistream fit-preview --out multistream/_models/shapes/preview_decoder.safetensors --force
    $ multistream fit-preview --width 32 --out multistream/_models/shapes_video/preview_decoder.safetensors
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

from ..errors import MultistreamError
from ._checks import device, integer
from ._console import set_library_progress, show_progress
from ._files import check_output_file


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("fit-preview", help="fit a tiny preview decoder to a model's VAE (cached per VAE)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("model", nargs="?", default=None, help="diffusers folder or hub id (default: the embedded shapes model)")
    p.add_argument("--device", type=device, default="auto", help="auto (CUDA when present), cpu, cuda, ... (default: auto)")
    p.add_argument("--out", default=None, metavar="FILE.safetensors", help="also write the decoder to this file")
    p.add_argument("--force", action="store_true",
                   help="fit again even if the model folder ships a decoder or the cache has a fit for this VAE")
    p.add_argument("--steps", type=integer(1), default=None, help="training steps (default: the library's)")
    p.add_argument("--width", type=integer(4), default=None,
                   help="channels of the decoder's convolutions (default: the library's, 64); narrower decodes "
                        "faster (32: about a third of the time), a little less sharp")
    p.add_argument("--x0-prompts", type=integer(0), default=32, metavar="N",
                   help="also train on the model's x0 estimates at every step of N runs (the inputs previews really "
                        "get; shapes captions for the embedded model, generic prompts otherwise); 0: VAE only (default: 32)")
    p.add_argument("--x0-steps", type=integer(1), default=20, help="steps of those runs (default: 20)")
    # --out before the VAE loads (save_preview_decoder writes it atomically).
    p.set_defaults(func=run, check_paths=lambda args: args.out is None or check_output_file(
        args.out, "--out", {".safetensors": "safetensors"}, "a decoder file"))


def _shipped(args: argparse.Namespace) -> str | None:
    """The ``preview_decoder.safetensors`` the model's folder ships (the embedded model's, for no
    model), found without loading the model; None for a hub id or a folder without one."""
    from ..diffusion._preview_decoder import PREVIEW_DECODER_FILE
    from ..image import EMBEDDED_MODEL_DIR

    folder = EMBEDDED_MODEL_DIR if args.model is None else os.path.expanduser(args.model)
    path = os.path.join(folder, PREVIEW_DECODER_FILE)
    return path if os.path.isfile(path) else None


def run(args: argparse.Namespace) -> int:
    from ..diffusion._preview_decoder import (
        GENERIC_PROMPTS,
        FitProgress,
        collect_x0_latents,
        fit_preview_decoder,
        load_preview_decoder,
        preview_decoder_cache_path,
        save_preview_decoder,
        vae_fingerprint,
    )
    from ..image import load_image_model

    # Bars (the libraries' loading, this command's runs and fit) on a terminal only.
    tty = show_progress()
    shipped = _shipped(args)
    if shipped is not None and not args.force and args.steps is None and args.width is None:
        # Nothing to fit: the model comes with its decoder (preview="tiny" and "x0" use it).
        print(f"this model ships its preview decoder: {shipped}; preview='tiny' uses it, so nothing is fitted "
              "(--force fits one anew)", file=sys.stderr)
        if args.out:
            shutil.copyfile(shipped, args.out)
            print(f"written to {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)", file=sys.stderr)
        return 0
    set_library_progress(tty)
    try:
        model = load_image_model(args.model, device=args.device)
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    vae = getattr(model.pipeline, "vae", None)
    if vae is None:
        print(f"multistream: {type(model.pipeline).__name__} has no VAE to fit a preview decoder to", file=sys.stderr)
        return 2
    fingerprint = vae_fingerprint(vae)
    options: dict[str, Any] = {key: value for key, value in (("steps", args.steps), ("width", args.width))
                               if value is not None}
    # The cache holds the fit with the default recipe; other step counts or widths only go to --out.
    cache_path = preview_decoder_cache_path(fingerprint) if not options else None
    if cache_path is not None and cache_path.is_file() and not args.force:
        net = load_preview_decoder(cache_path)
        print(f"already fitted for this VAE ({fingerprint[:12]}): {cache_path} (--force fits again)", file=sys.stderr)
        if args.out:
            save_preview_decoder(net, args.out, **net.fit_info)  # type: ignore[attr-defined]
            print(f"written to {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)", file=sys.stderr)
        return 0
    from tqdm.auto import tqdm

    started = time.perf_counter()
    extra = None
    if args.x0_prompts > 0:
        embedded = args.model is None
        prompts = None if embedded else [GENERIC_PROMPTS[i % len(GENERIC_PROMPTS)] for i in range(args.x0_prompts)]
        if not tty:
            print(f"collecting the model's x0 estimates: {args.x0_prompts} runs of {args.x0_steps} steps ...",
                  file=sys.stderr, flush=True)
        with tqdm(total=args.x0_prompts * args.x0_steps, desc="x0 runs", unit="step", file=sys.stderr,
                  disable=not tty) as runs:
            extra = collect_x0_latents(model.pipeline, prompts, count=args.x0_prompts, steps=args.x0_steps,
                                       progress=lambda done, total: runs.update(done - runs.n),
                                       progress_steps=True)  # fmt: skip
    bars: dict[str, Any] = {}

    def progress(p: FitProgress) -> None:
        if p.stage == "done":
            for bar in bars.values():
                bar.close()
            return
        if p.stage not in bars:
            if not tty:
                what = "encoding and decoding the training images with the VAE" if p.stage == "data" else "fitting"
                print(f"{what} ...", file=sys.stderr, flush=True)
            if "data" in bars:
                bars["data"].close()
            desc, unit = ("training data", "latent") if p.stage == "data" else ("fitting", "step")
            bars[p.stage] = tqdm(total=p.total, desc=desc, unit=unit, file=sys.stderr, disable=not tty)
        bar = bars[p.stage]
        if p.stage == "fit":
            bar.set_postfix(loss=f"{p.loss:.4f}", refresh=False)
        bar.update(p.step - bar.n)

    try:
        net = fit_preview_decoder(vae, progress=progress, cache=False, extra_latents=extra, **options)
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    meta = {
        "vae_hash": fingerprint,
        "fit_seconds": f"{seconds:.1f}",
        "model": os.fspath(args.model or "embedded:shapes"),
        "x0_runs": f"{args.x0_prompts}x{args.x0_steps}",
        "command": "multistream fit-preview" + (f" {args.model}" if args.model else "")
        + (f" --steps {args.steps}" if args.steps else "") + (f" --width {args.width}" if args.width else "")
        + f" --x0-prompts {args.x0_prompts} --x0-steps {args.x0_steps}",
    }
    net.vae_hash = fingerprint  # type: ignore[assignment]
    where = []
    if cache_path is not None:
        save_preview_decoder(net, cache_path, **meta)
        where.append(str(cache_path))
    if args.out:
        save_preview_decoder(net, args.out, **meta)
        where.append(f"{args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)")
    print(f"done in {seconds:.1f} s: {net.num_parameters()} parameters, config {net.config()}; written to "
          + ", ".join(where or ["nowhere (pass --out)"]), file=sys.stderr)  # fmt: skip
    return 0
