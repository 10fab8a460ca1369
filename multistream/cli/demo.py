"""``multistream demo``: the Gradio page: chat, image previews, prompt-to-picture, speech and video.

Example:
    $ multistream demo                      # http://127.0.0.1:7860 with the embedded models
    $ multistream demo --port 8000 --host 0.0.0.0 --text-model HuggingFaceTB/SmolLM2-360M-Instruct
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import MultistreamError
from ._checks import device, integer, number


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="start the Gradio demo page", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=integer(0, 65535), default=7860, help="port to listen on (default 7860)")
    p.add_argument("--text-model", default=None, help="text model id or folder (default: the embedded one)")
    p.add_argument("--image-model", default=None, help="image model id or folder (default: the embedded one)")
    p.add_argument("--device", type=device, default="auto", help="auto (CUDA when present), cpu, cuda, ...")
    p.add_argument("--max-fps", type=number(0, above=True), default=15.0, help="page updates per second per stream (default 15)")
    p.add_argument("--concurrency", type=integer(1), default=4, help="generations running at once (default 4)")
    p.set_defaults(func=run)


def _load(kind: str, name: str | None, device: str) -> Any:
    """Load a named model (a failure is an error); None lets the demo load the default itself."""
    if name is None and device == "auto":
        return None
    if kind == "text":
        from ..text import load_text_model

        return load_text_model(name, device=device)
    from ..image import load_image_model  # type: ignore[import-not-found]

    return load_image_model(name, device=device)


def run(args: argparse.Namespace) -> int:
    try:
        text_model = _load("text", args.text_model, args.device)
        image_model = _load("image", args.image_model, args.device)
        from ..ui.demo import launch

        print(f"multistream demo on http://{args.host}:{args.port}", file=sys.stderr)
        launch(text_model, image_model, host=args.host, port=args.port, max_fps=args.max_fps,
               concurrency_limit=args.concurrency, block=True)
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    return 0
