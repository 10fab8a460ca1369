"""``multistream video "prompt" --out clip.webm``: make a short clip, watching every frame denoise.

The final clip goes to ``--out`` (``.webm``: VP9, the default; ``.mp4``: H.264); ``--sheet`` also
writes the clip's frames as one contact sheet (``.jpg``, ``.png`` or ``.webp``: the frames left to
right, top to bottom), and ``--previews FOLDER`` every step's preview (``step_NNN.webp``, an animated
picture of all frames, or ``.jpg`` sheets with ``--preview-format sheet``). Paths are checked before
the model loads and written atomically. Progress goes to stderr as the previews arrive: on a
terminal a bar with the estimated time left (the events' ``eta_s``), else one line per preview
(step i/n, ms per step, eta). ``--json`` prints each wire event as one line of JSON on stdout.

Example:
    $ multistream video "a red circle moving right on a blue background" --out clip.webm --sheet sheet.jpg
    step 1/20  412 ms/step  9184 bytes  eta 7.9 s
    ...
    done: 16 frames 64x64 at 8 fps, video/webm, 20 steps, 8.6 s, finish: stop -> clip.webm
    $ multistream video "a green star moving up" --out clip.mp4 --steps 10 --seed 3
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._spec import cli_values
from ..errors import InvalidArgumentError, MultistreamError
from ._checks import declare_options, device, finish_checking_sizes, flag_problem
from ._console import model_loading, status_line
from ._files import atomic_write, check_output_file, check_output_folder
from ._interrupt import CtrlC
from ._step_progress import StepProgress

__all__ = ["CLIP_SUFFIXES", "SHEET_SUFFIXES", "add_parser", "run"]

#: ``--out`` suffixes and the clip format each one asks the model for.
CLIP_SUFFIXES = {".webm": "webm", ".mp4": "mp4"}
#: ``--sheet`` suffixes and the Pillow format each one is written in.
SHEET_SUFFIXES = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP"}
_PREVIEW_EXTENSIONS = {"image/webp": "webp", "image/jpeg": "jpg", "image/png": "png"}
DEFAULT_OUT = "multistream-video.webm"


def add_parser(subparsers: Any) -> None:
    from ..diffusion._sizes import check_max_frames
    from ..video import EMBEDDED_VIDEO_MAX_FRAMES, EMBEDDED_VIDEO_SIZES, VideoOptions, parse_video_options

    check_sizes = finish_checking_sizes(parse_video_options, EMBEDDED_VIDEO_SIZES)

    def finish(args: argparse.Namespace, given: dict[str, Any]) -> Any:
        options = check_sizes(args, given)
        # The embedded model's frame limit is known without loading it (as its sizes are).
        if args.model is None and options.num_frames is not None:
            try:
                check_max_frames(options.num_frames, EMBEDDED_VIDEO_MAX_FRAMES)
            except InvalidArgumentError as exc:
                raise flag_problem("num_frames", exc) from None
        return options

    p = subparsers.add_parser("video", help="make a short clip, streaming every frame's preview per step",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="what to film, e.g. 'a red circle moving right on a blue background'")
    p.add_argument("--out", default=None, metavar="CLIP.webm",
                   help=f"the final clip: .webm (VP9) or .mp4 (H.264) (default: ./{DEFAULT_OUT}; "
                   "with --json and no --out, nothing is written)")
    p.add_argument("--sheet", default=None, metavar="SHEET.jpg",
                   help="also write the final clip's frames as one contact sheet (.jpg, .png or .webp)")
    p.add_argument("--previews", default=None, metavar="FOLDER",
                   help="also write each step's preview of every frame to FOLDER/step_NNN.<webp|jpg>")
    p.add_argument("--model", default=None, help="diffusers video pipeline folder or hub id (default: the embedded model)")
    p.add_argument("--device", type=device, default="auto", help="auto (CUDA with float16 when present), cpu, cuda, cuda:1, ...")
    # Every generation option, generated from VideoOptions (defaults and help are Python's) and
    # checked by it before the model loads; --out's suffix picks the clip format.
    declare_options(p, p.add_argument_group("generation options (VideoModel.stream)",
                                            "--out's suffix (.webm, .mp4) sets the clip format"), VideoOptions,
                    finish, exclude=("priority", "video_format"))
    p.add_argument("--json", action="store_true", help="print one wire event per line (NDJSON) on stdout")
    p.set_defaults(func=run, check_paths=check_paths)


def out_path(args: argparse.Namespace) -> str | None:
    """Where the clip goes: ``--out``, else ./multistream-video.webm, unless the run prints its
    events (``--json``): then nowhere unless asked."""
    if args.out is not None:
        return args.out  # type: ignore[no-any-return]
    return None if args.json else DEFAULT_OUT


def check_paths(args: argparse.Namespace) -> None:
    """``--out``, ``--sheet`` and ``--previews`` before the model loads."""
    out = out_path(args)
    if out is not None:
        check_output_file(out, "--out", CLIP_SUFFIXES, "a video file")
    if args.sheet is not None:
        check_output_file(args.sheet, "--sheet", SHEET_SUFFIXES, "an image file")
    if args.previews is not None:
        check_output_folder(args.previews, "--previews")


def load_model(name: str | None, device: str) -> Any:
    """The video model the command runs (a seam the tests replace with a scripted model)."""
    from ..video import load_video_model

    return load_video_model(name, device=device)


def run(args: argparse.Namespace) -> int:
    out = out_path(args)
    video_format = CLIP_SUFFIXES[os.path.splitext(out)[1].lower()] if out is not None else "webm"  # checked
    try:
        # torch's and diffusers' imports too (in load_model): inside the line and the pause
        with model_loading(repr(args.model) if args.model else "the embedded video model", args.own_process):
            model = load_model(args.model, args.device)
        stream = model.stream(args.prompt, **cli_values(args, args.option_names), video_format=video_format)
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    ctrl_c = CtrlC(lambda line: status_line(line, final=True))
    with stream, StepProgress() as progress:
        for ev in ctrl_c.events(stream):
            if args.json:
                print(ev.to_json(), flush=True)
            if ev.type != "video" or ev.is_final:
                continue
            if args.previews is not None:
                name = f"step_{ev.step:03d}.{_PREVIEW_EXTENSIONS.get(ev.mime, 'bin')}"
                atomic_write(os.path.join(args.previews, name), ev.data)
            progress.preview(ev)
    final = stream.final
    if final is None or final.type == "error":
        message = final.error["message"] if final is not None else "stream ended early"  # type: ignore[union-attr]
        status_line(f"multistream: error: {message}", final=True)
        return 1
    if not final.mime.startswith("video/"):  # type: ignore[union-attr]
        # A cancelled run ends on its newest preview, not a clip: nothing to write as one.
        status_line(f"multistream: {final.finish_reason} at step {final.step}/{final.total_steps}; no clip written",  # type: ignore[union-attr]
              final=True)
        return 1
    if out is not None:
        atomic_write(out, final.data)  # type: ignore[union-attr]
    if args.sheet is not None:
        from ..video import encode_sheet

        atomic_write(args.sheet, encode_sheet(final.frames, SHEET_SUFFIXES[os.path.splitext(args.sheet)[1].lower()]))  # type: ignore[union-attr]
    m = final.metrics or {}  # type: ignore[union-attr]
    written = " -> " + ", ".join(p for p in (out, args.sheet) if p) if out or args.sheet else ""
    status_line(f"done: {final.num_frames} frames {final.width}x{final.height} at {final.fps:g} fps, {final.mime}, "  # type: ignore[union-attr]
          f"{int(m.get('steps', final.step))} steps, {m.get('duration_ms', 0) / 1e3:.1f} s, "  # type: ignore[union-attr]
          f"finish: {final.finish_reason}{written}", final=True)  # type: ignore[union-attr]
    return ctrl_c.status()
