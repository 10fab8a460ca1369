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

from ._checks import flag_of, integer, leave_out, model_problem


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve streams over HTTP (SSE, WebSocket, OpenAI API, web client)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port (default 8000)")
    _add_model_flags(p)
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
    scale.add_argument("--text-replicas", type=integer(0), default=1, metavar="N",
                       help="--ray: text model replicas (0: no text model; default 1)")
    scale.add_argument("--image-replicas", type=integer(0), default=1, metavar="M",
                       help="--ray: image model replicas (0: no image model; default 1)")
    scale.add_argument("--ingress-replicas", type=integer(1), default=1, metavar="K",
                       help="--ray: HTTP ingress replicas (default 1)")
    scale.add_argument("--autoscale", action="store_true",
                       help="--ray: autoscale model replicas between 1 and the --*-replicas counts")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_setting_flags(p)
    p.set_defaults(func=run)


# Every ServerSettings field is a flag of its own name (``--client-concurrency``), generated from
# its declaration (help: its description); these older, shorter names stay as aliases.
ALIASES = {
    "grace_period_s": ("--grace-period",), "shutdown_deadline_s": ("--shutdown-deadline",), "heartbeat_s": ("--heartbeat",),
    "keys_file": ("--keys",), "blocklist_file": ("--blocklist",),
}


# What each family's --<family>-model flag names besides 'default', 'auto' and 'none' (one flag per
# entry of the server's family table, `multistream.server.families.FAMILIES`).
_MODEL_HELP = {
    "text": "a hub id or path of a causal LM, or 'module:factory'",
    "image": "a diffusers pipeline id or path, or 'module:factory'",
    "speech": "a Piper .onnx voice, a transformers VitsModel id or path, or 'module:factory'; 'default' is the "
              "embedded Piper voice (the `speech` extra). Serves /v1/audio/speech and /v1/speech",
    "video": "a diffusers video pipeline id or path (Wan, CogVideoX, LTX-Video, AnimateDiff), or 'module:factory'; "
             "'default' is the embedded text-to-video model. Serves /v1/video and OpenAI's /v1/videos",
}


# The names of `server.families.FAMILIES` (tests/cli/test_startup.py keeps them equal): spelled here so that
# building the parser, which every command does, does not import the server (pydantic, starlette).
FAMILY_NAMES = ("text", "image", "speech", "video")


def _add_model_flags(parser: Any) -> None:
    for name in FAMILY_NAMES:
        parser.add_argument(f"--{name}-model", default="auto", metavar="MODEL",
                            help=f"the {name} model: 'default' (the embedded one), "
                            f"{_MODEL_HELP.get(name, 'a name or path, or module:factory')}, or 'none' (not served). "
                            "Default 'auto': the embedded one when what it needs is installed, else none")


def model_spec(name: str, value: str) -> str | None:
    """What ``--<name>-model VALUE`` serves: None for 'none' (or 'auto' when the family's embedded
    model needs a package that is not installed), 'default' for 'auto' otherwise, else the value.

    Example:
        >>> model_spec("text", "none"), model_spec("text", "auto"), model_spec("image", "my/pipeline")
        (None, 'default', 'my/pipeline')
    """
    from ..server.families import family, installed

    low = value.strip().lower()
    if low in ("none", "off", ""):
        return None
    if low == "auto":
        if installed(family(name)):
            return "default"
        import logging

        logging.getLogger("multistream.server").warning(
            "not serving a %s model: its embedded model needs %s, not all installed (pip install "
            "'multistream[%s]', or ./scripts/setup.sh); --%s-model none silences this", name,
            ", ".join(family(name).requires), name, name)
        return None
    return value


def _add_setting_flags(parser: Any) -> None:
    from .._spec import add_cli_options
    from ..server import ServerSettings

    group = parser.add_argument_group(
        "server settings", "one flag per ServerSettings field, from its declaration; each also reads "
        "MULTISTREAM_<FIELD> from the environment (e.g. MULTISTREAM_API_KEY, MULTISTREAM_EVENT_LOG)")
    names = add_cli_options(group, ServerSettings, flags=ALIASES)
    parser.set_defaults(setting_names=names)


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
    name = model_spec("text", value)
    if name is None or ":" in name or (quantize == "auto" and not compile):
        return name
    import functools

    from ..text import load_text_model

    return functools.partial(load_text_model, None if name == "default" else name, quantize=quantize,
                             compile=compile)


def model_path_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a ``--<family>-model`` that names a folder or hub id (`model_problem`), or
    None; found in a fraction of a second instead of after the server has started loading."""
    for family in FAMILY_NAMES:
        value = getattr(args, f"{family}_model", None)
        problem = model_problem(value, family, f"--{family}-model")
        if problem is not None:
            return f"--{family}-model {value}: {problem}"
    return None


def _in_the_users_terms(exc: Exception, given: dict[str, Any]) -> str:
    """A setting's complaint named as the user gave it: ``--queue-size`` for a flag,
    ``MULTISTREAM_QUEUE_SIZE`` for the environment, instead of ``ServerSettings.queue_size``."""
    message, param = str(exc), getattr(exc, "param", None)
    prefix = f"ServerSettings.{param} "
    if not param or not message.startswith(prefix):
        return message
    if param not in given:
        return f"MULTISTREAM_{param.upper()} {message[len(prefix):]}"
    flag = flag_of(param)
    return leave_out(f"{flag} {message[len(prefix):]}", flag)


def run(args: argparse.Namespace) -> int:
    from .._spec import cli_values
    from ..server import ServerSettings, create_app, serve
    from ..server.families import FAMILIES

    given = cli_values(args, args.setting_names)
    for name in ("api_key", "event_log"):  # an empty --api-key "" means open, as unset does
        given[name] = given.get(name) or None
    from ..errors import InvalidArgumentError

    try:
        settings = ServerSettings.from_env(**given)
    except InvalidArgumentError as exc:  # a bad flag or MULTISTREAM_* value: its message, no traceback
        print(f"multistream serve: {_in_the_users_terms(exc, given)}", file=sys.stderr)
        return 2

    problem = model_path_problem(args)
    if problem is not None:  # a missing folder or an unreachable hub id: one message, before the server starts
        print(f"multistream serve: {problem}", file=sys.stderr)
        return 2

    models = {f.name: model_spec(f.name, getattr(args, f"{f.name}_model")) for f in FAMILIES}
    models["text"] = text_model_spec(args.text_model, args.quantize, args.compile)
    if args.ray:
        from ..server.ray import serve_ray

        for fam in FAMILIES:
            if not fam.on_ray and models[fam.name] is not None and getattr(args, f"{fam.name}_model") != "auto":
                print(f"multistream serve: --ray does not serve a {fam.name} model yet; --{fam.name}-model is ignored",
                      file=sys.stderr)

        return serve_ray(settings, text_model=models["text"], image_model=models["image"],
                         text_replicas=args.text_replicas, image_replicas=args.image_replicas,
                         ingress_replicas=args.ingress_replicas, autoscale=args.autoscale, host=args.host,
                         port=args.port, address=args.ray_address,
                         image_checkpoint_every=settings.image_checkpoint_every)

    # With keys, the demo page asks for a login (an API key as the password) and runs through the
    # same gates as the API.
    demo_path = None if args.no_demo else "/demo"
    try:  # reads --keys-file and --blocklist-file (models load later, in serve())
        app = create_app(settings=settings, demo_path=demo_path, models=models)
    except InvalidArgumentError as exc:
        print(f"multistream serve: {exc}", file=sys.stderr)
        return 2
    code = serve(app, host=args.host, port=args.port, log_level=args.log_level, say=_say, exit_if_stalled=True) or 0
    if code != 0:
        # A model failed to load, or a second Ctrl-C stopped the server: exit now. A model may still
        # be loading or generating in its thread, and torch's threads torn down under it at
        # interpreter exit abort the process (status -6).
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _say(line: str) -> None:
    """What a Ctrl-C does, told at the terminal (the server's log may be quieter: --log-level)."""
    print(f"multistream serve: {line}", file=sys.stderr, flush=True)
