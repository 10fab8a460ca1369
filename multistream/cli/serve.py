"""``multistream serve``: the HTTP server (SSE, WebSocket, OpenAI-compatible routes, web client).

Example:
    $ multistream serve --host 127.0.0.1 --port 8000
    $ multistream serve --text-model HuggingFaceTB/SmolLM2-360M-Instruct --image-model none --api-key s3cret
    $ multistream serve --text-model multistream.testing:ScriptedTextModel   # a factory, for tests
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve streams over HTTP (SSE, WebSocket, OpenAI API, web client)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--text-model", default="default",
                   help="'default' (embedded), a hub id or path, 'module:factory', or 'none' (default: default)")
    p.add_argument("--image-model", default="default", help="like --text-model, for the image model")
    p.add_argument("--speech-model", default="none",
                   help="'default' (the embedded Piper voice; the `speech` extra), a Piper .onnx voice, a transformers "
                   "VitsModel id or path, or 'none' (default: none). Serves /v1/audio/speech and /v1/speech")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="quantization of a --text-model by name (load_text_model(quantize=); "
                   "default auto: int4 for the embedded model on a CPU)")
    p.add_argument("--compile", action="store_true",
                   help="compile the text model's decode step on ATen's quantized kernels (load_text_model(compile=True)): "
                   "about 1.2x their tokens/s for ~50 s more at startup on 2 cores; skipped where the native "
                   "decoder layers run (a CPU with a C compiler)")
    p.add_argument("--no-demo", action="store_true", help="do not serve the Gradio demo page at /demo")
    scale = p.add_argument_group("scale-out (pip install 'multistream[scale]'; see docs/scaling.md)")
    scale.add_argument("--ray", action="store_true",
                       help="serve as a Ray Serve application: an ingress and one deployment per model kind")
    scale.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="an existing Ray cluster (default: start a local one)")
    scale.add_argument("--text-replicas", type=int, default=1, metavar="N",
                       help="--ray: text model replicas (0: no text model; default 1)")
    scale.add_argument("--image-replicas", type=int, default=1, metavar="M",
                       help="--ray: image model replicas (0: no image model; default 1)")
    scale.add_argument("--ingress-replicas", type=int, default=1, metavar="K",
                       help="--ray: HTTP ingress replicas (default 1)")
    scale.add_argument("--autoscale", action="store_true",
                       help="--ray: autoscale model replicas between 1 and the --*-replicas counts")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_setting_flags(p)
    p.set_defaults(func=run)


# Every ServerSettings field is a flag of its own name (``--client-concurrency``), generated from
# the settings with their help from its docstring; these older, shorter names stay as aliases.
ALIASES = {
    "grace_period_s": ["--grace-period"], "shutdown_deadline_s": ["--shutdown-deadline"], "heartbeat_s": ["--heartbeat"],
    "keys_file": ["--keys"], "blocklist_file": ["--blocklist"],
}


def _setting_help(name: str) -> str:
    """The sentence of `ServerSettings`' docstring that describes ``name`` (written once, there)."""
    from ..server import ServerSettings

    doc = " ".join((ServerSettings.__doc__ or "").split())
    at = doc.find(name)
    if at < 0:
        return f"ServerSettings.{name}"
    end = min((i for i in (doc.find(";", at), doc.find(". ", at)) if i > 0), default=len(doc))
    return doc[at:end].strip(" .;") + f" (ServerSettings.{name})"


def _add_setting_flags(parser: Any) -> None:
    import dataclasses

    from ..server import ServerSettings

    group = parser.add_argument_group(
        "server settings", "one flag per ServerSettings field; each also reads MULTISTREAM_<FIELD> from the environment "
        "(e.g. MULTISTREAM_API_KEY, MULTISTREAM_EVENT_LOG)")
    for field in dataclasses.fields(ServerSettings):
        flags = ["--" + field.name.replace("_", "-"), *ALIASES.get(field.name, [])]
        kind = str(field.type)
        help_text = f"{_setting_help(field.name)}; default {field.default!r}"
        if "bool" in kind:
            group.add_argument(*flags, dest=field.name, action="store_true", default=None, help=help_text)
        elif "tuple" in kind:
            group.add_argument(*flags, dest=field.name, default=None, metavar="LIST", help=help_text + " (comma-separated)")
        else:
            number = float if ("float" in kind or field.name.endswith("_s")) else int if "int" in kind else str
            group.add_argument(*flags, dest=field.name, type=number, default=None, help=help_text)


def text_model_spec(value: str, quantize: str = "auto", compile: bool = False) -> Any:
    """What ``--text-model VALUE [--quantize Q] [--compile]`` serves: None for 'none', the value
    itself for a 'module:factory' or when both flags are the library's defaults, else a picklable
    factory (Ray replicas load it in their own processes) calling ``load_text_model`` with them.

    Example:
        >>> text_model_spec("default")
        'default'
        >>> text_model_spec("default", "none").keywords
        {'quantize': 'none', 'compile': False}
    """
    name = None if value.lower() in ("none", "off", "") else value
    if name is None or ":" in name or (quantize == "auto" and not compile):
        return name
    import functools

    from ..text import load_text_model

    return functools.partial(load_text_model, None if name == "default" else name, quantize=quantize,
                             compile=compile)


def model_path_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a ``--<family>-model`` that names a folder or hub id (a folder that does not
    exist, a name that is no hub id, a hub id neither reachable nor cached), or None; found in a
    fraction of a second instead of after the server has started loading."""
    from .._hub import locate
    from ..errors import ModelLoadError

    for family in ("text", "image", "speech"):
        value = getattr(args, f"{family}_model", None)
        if not isinstance(value, str) or value.strip().lower() in ("none", "off", "", "default", "auto"):
            continue
        head = value.split(":")[0]
        if ":" in value and not value.startswith(("/", ".", "~")) and "/" not in head:
            continue  # module:factory
        try:
            locate(value, family=family)
        except ModelLoadError as exc:
            return f"--{family}-model {value}: {exc}"
    return None


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from ..server import ServerSettings, create_app, serve

    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerSettings)}
    given["api_key"] = given["api_key"] or None  # an empty --api-key "" means open, as unset does
    given["event_log"] = given["event_log"] or None
    from ..errors import InvalidArgumentError

    try:
        settings = ServerSettings.from_env(**given)
    except InvalidArgumentError as exc:  # a bad flag or MULTISTREAM_* value: its message, no traceback
        print(f"multistream serve: {exc}", file=sys.stderr)
        return 2

    def spec(value: str) -> str | None:
        return None if value.lower() in ("none", "off", "") else value

    problem = model_path_problem(args)
    if problem is not None:  # a missing folder or an unreachable hub id: one message, before the server starts
        print(f"multistream serve: {problem}", file=sys.stderr)
        return 2

    if args.ray:
        from ..server.ray import serve_ray

        return serve_ray(settings, text_model=text_model_spec(args.text_model, args.quantize, args.compile), image_model=spec(args.image_model),
                         text_replicas=args.text_replicas, image_replicas=args.image_replicas,
                         ingress_replicas=args.ingress_replicas, autoscale=args.autoscale, host=args.host,
                         port=args.port, address=args.ray_address,
                         image_checkpoint_every=settings.image_checkpoint_every)

    # With keys, the demo page asks for a login (an API key as the password) and runs through the
    # same gates as the API.
    demo_path = None if args.no_demo else "/demo"
    app = create_app(text_model=text_model_spec(args.text_model, args.quantize, args.compile), image_model=spec(args.image_model), settings=settings,
                     demo_path=demo_path, speech_model=spec(args.speech_model))
    code = serve(app, host=args.host, port=args.port, log_level=args.log_level) or 0
    if code != 0:
        # A model failed to load: exit now. Another model may still be loading in its thread, and
        # torch's threads torn down under it at interpreter exit abort the process (status -6).
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
