"""``multistream image "prompt"``: write each denoising preview and the final image to a folder,
or only the final image to a file (``--out final.png``: a path ending in an image suffix is that file).

Progress goes to stderr as the previews arrive: on a terminal a progress bar with the estimated
time left (the events' ``eta_s``), else one line per preview (step i/n, ms per step, eta);
``--json`` also prints each wire event as one line of JSON on stdout (NDJSON; frames are base64
in ``data``). A ``--width``/``--height`` the model cannot make exits with status 2 and the sizes it
can make (for the embedded model, before it loads).

Example:
    $ multistream image "a red circle on a blue background" --out out/ --steps 20 --seed 0
    $ ls out/
    final.png  step_001.jpg  step_002.jpg  ...
    $ multistream image "a red circle on a blue background" --out circle.png    # the final image only
    $ multistream image "a lighthouse" --model ./sd-turbo --preview x0 --json > events.ndjson
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._spec import cli_values
from ..errors import InvalidArgumentError, MultistreamError
from ..image import EMBEDDED_IMAGE_SIZES, ImageOptions, parse_image_options
from ._checks import declare_options, device, finish_checking_sizes, integer
from ._console import model_loading, status_line
from ._files import atomic_write, check_input_folder, check_output_file, check_output_folder, looks_like_a_file
from ._interrupt import CtrlC
from ._step_progress import StepProgress

_EXTENSIONS = {"image/jpeg": "jpg", "image/png": "png", "image/webp": "webp"}
# A --out ending in one of these is the final image's file (its format from the suffix); else a folder.
IMAGE_SUFFIXES = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def out_target(out: str | None, final_format: str | None) -> tuple[str | None, str | None, str]:
    """``(folder, file, final_format)`` for ``--out``: a path with an image suffix is the final
    image's file, anything else a folder for the previews and the final image.

    Example:
        >>> out_target("o.png", None)
        (None, 'o.png', 'png')
        >>> out_target("out", None)
        ('out', None, 'png')
        >>> out_target("o.jpg", None)
        (None, 'o.jpg', 'jpeg')
    """
    suffix = os.path.splitext(out or "")[1].lower()
    if out is None or suffix not in IMAGE_SUFFIXES:
        return out, None, final_format or "png"
    wanted = IMAGE_SUFFIXES[suffix]
    if final_format is not None and final_format.lower().replace("jpg", "jpeg") != wanted:
        raise InvalidArgumentError(f"--out {out} is a {wanted} file but --final-format is {final_format}; "
                         "drop --final-format (the suffix decides) or change the suffix")
    return None, out, wanted


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("image", help="stream denoising previews from a diffusion model", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("prompt", help="what to draw")
    p.add_argument("--out", default=None, help="folder for step_NNN.<ext> previews and final.<ext>, or a file "
                   "ending in .png/.jpg/.jpeg/.webp for the final image only "
                   "(default: ./multistream-image; with --json and no --out, nothing is written)")  # fmt: skip
    p.add_argument("--model", default=None, help="diffusers folder or hub id (default: the embedded shapes model)")
    p.add_argument("--device", type=device, default="auto", help="auto (CUDA with float16 when present), cpu, cuda, cuda:1, ...")
    # Every generation option, generated from ImageOptions (defaults and help are Python's) and
    # checked by it before the model loads; the older short spellings of the preview encoding stay.
    declare_options(
        p, p.add_argument_group("generation options (ImageModel.stream)",
                                "an --out file's suffix (.png, .jpg, .webp) sets the final format"), ImageOptions,
        finish_checking_sizes(parse_image_options, EMBEDDED_IMAGE_SIZES),
        flags={"preview_format": ("--format",), "preview_quality": ("--quality",), "preview_max_side": ("--max-side",)},
        exclude=("priority",))
    p.add_argument("--taesd", default=None, help="folder with TAESD (AutoencoderTiny) weights, for --preview taesd")
    p.add_argument("--json", action="store_true", help="print one wire event per line (NDJSON) on stdout")
    p.add_argument("--strip", default=None, metavar="FILE.png",
                   help="also write one picture: the previews in a row, from noise to the final image")
    p.add_argument("--strip-frames", type=integer(1), default=8, metavar="N",
                   help="previews in the strip, evenly spread over the run (default: 8)")
    p.set_defaults(func=run, check_paths=check_paths)


def default_out(args: argparse.Namespace) -> str | None:
    """Where the previews and the final image go: ``--out``, else ./multistream-image, unless the
    run prints its events (``--json``) or writes only a strip (``--strip``): then nowhere."""
    if args.out is not None:
        return args.out  # type: ignore[no-any-return]
    return None if args.json or args.strip else "multistream-image"


def check_paths(args: argparse.Namespace) -> None:
    """``--out``, ``--strip`` and ``--taesd`` before the model loads: a suffix that is an image
    format multistream does not write (``final.gif``) is refused, not taken for a folder name."""
    out, out_file, _ = out_target(default_out(args), args.final_format)
    suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
    if out_file is not None:
        check_output_file(out_file, "--out", IMAGE_SUFFIXES, "an image file")
    elif out is not None:
        if looks_like_a_file(out):
            raise InvalidArgumentError(
                f"--out {out}: {os.path.splitext(out)[1]} is not a format this command writes; give a file ending "
                f"in {suffixes} for the final image only, or a folder name (no suffix) for the previews and the "
                "final image")
        check_output_folder(out, "--out", f"(or a file ending in {suffixes} for the final image only)")
    if args.strip is not None:
        check_output_file(args.strip, "--strip", IMAGE_SUFFIXES, "an image file")
    check_input_folder(args.taesd, "--taesd")


def write_strip(frames: list[Any], final: Any, path: str, count: int, tile: int = 96) -> None:
    """A row of ``count`` evenly spread preview frames, then the final image, as one PNG."""
    from PIL import Image

    if count < 1:
        raise ValueError("--strip-frames must be >= 1")
    if len(frames) > count:  # evenly spread, first and last preview included
        spacing = (len(frames) - 1) / max(count - 1, 1)
        frames = [frames[round(i * spacing)] for i in range(count)]
    tiles = [ev.image.convert("RGB").resize((tile, tile), Image.Resampling.NEAREST) for ev in [*frames, final]]
    gap = 4
    strip = Image.new("RGB", (len(tiles) * (tile + gap) - gap, tile), (255, 255, 255))
    for i, img in enumerate(tiles):
        strip.paste(img, (i * (tile + gap), 0))
    import io

    data = io.BytesIO()
    strip.save(data, format=IMAGE_SUFFIXES.get(os.path.splitext(path)[1].lower(), "png"))
    atomic_write(path, data.getvalue())


def run(args: argparse.Namespace) -> int:
    out, out_file, final_format = out_target(default_out(args), args.final_format)  # checked (check_paths)
    try:
        with model_loading(repr(args.model) if args.model else "the embedded image model", args.own_process):
            from ..image import load_image_model  # torch's and diffusers' imports too: inside the line and the pause

            model = load_image_model(args.model, device=args.device, taesd=args.taesd)
        stream = model.stream(args.prompt, **{**cli_values(args, args.option_names), "final_format": final_format})
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    if out is not None:
        os.makedirs(out, exist_ok=True)
    previews: list[Any] = []
    ctrl_c = CtrlC(lambda line: status_line(line, final=True))
    with stream, StepProgress() as progress:
        for ev in ctrl_c.events(stream):
            if args.json:
                print(ev.to_json(), flush=True)
            if ev.type != "image":
                continue
            ext = _EXTENSIONS.get(ev.mime, "bin")
            if out is not None:
                name = "final" if ev.is_final else f"step_{ev.step:03d}"
                if ev.index:
                    name += f"_{ev.index}"
                atomic_write(os.path.join(out, f"{name}.{ext}"), ev.data)
            elif out_file is not None and ev.is_final and not ev.index:
                atomic_write(out_file, ev.data)
            if not ev.is_final and ev.index == 0:
                if args.strip:
                    previews.append(ev)
                progress.preview(ev)
    final = stream.final
    if final is None or final.type == "error":
        message = final.error["message"] if final is not None else "stream ended early"  # type: ignore[union-attr]
        status_line(f"multistream: error: {message}", final=True)
        return 1
    if args.strip:
        write_strip(previews, final, args.strip, args.strip_frames)
    metrics = final.metrics or {}  # type: ignore[union-attr]
    written = os.path.join(out, "final." + _EXTENSIONS.get(final.mime, "bin")) if out else out_file  # type: ignore[union-attr]
    where = f" -> {written}" if written else ""
    status_line(
        f"done: {final.width}x{final.height} {final.mime}, {int(metrics.get('steps', 0))} steps, "  # type: ignore[union-attr]
        f"{metrics.get('ms_per_step', 0):.0f} ms/step, {metrics.get('duration_ms', 0) / 1e3:.1f} s, "
        f"seed {int(metrics.get('seed', -1))}, finish: {final.finish_reason}{where}",  # type: ignore[union-attr]
        final=True,
    )
    return ctrl_c.status()
