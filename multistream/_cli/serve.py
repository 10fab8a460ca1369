"""``multistream serve``: the HTTP server (SSE, WebSocket, OpenAI-compatible routes, web client).

Example:
    $ multistream serve --host 127.0.0.1 --port 8000
    $ multistream serve --text-model HuggingFaceTB/SmolLM2-360M-Instruct --image-model none --api-key s3cret
    $ multistream serve --text-model multistream.testing:ScriptedTextModel   # a factory, for tests
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--api-key", default=os.environ.get("MULTISTREAM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $MULTISTREAM_API_KEY; unset = open)")
    p.add_argument("--grace-period", type=float, default=None, metavar="S",
                   help="seconds a disconnected stream keeps running for a resume (default 30)")
    p.add_argument("--shutdown-deadline", type=float, default=None, metavar="S",
                   help="seconds running streams get to finish on SIGTERM (default 20)")
    p.add_argument("--text-concurrency", type=int, default=None, help="text generations at once (default: the engine's max_batch)")
    p.add_argument("--image-concurrency", type=int, default=None, help="image generations at once (default: the engine's capacity, 4)")
    p.add_argument("--queue-size", type=int, default=None, help="queued requests per model before 429 (default 64)")
    p.add_argument("--heartbeat", type=float, default=None, metavar="S", help="SSE heartbeat interval (default 15)")
    p.add_argument("--keys", default=None, metavar="FILE",
                   help="API keys, one a line: KEY [name=N] [max_priority=P] [concurrency=C] (see multistream.server.security)")
    p.add_argument("--blocklist", default=None, metavar="FILE",
                   help="words or phrases (one a line, case-insensitive) redacted from prompts and outputs")
    p.add_argument("--allowed-origins", default=None, metavar="LIST",
                   help="comma-separated extra browser origins allowed on the WebSocket")
    p.add_argument("--allowed-hosts", default=None, metavar="LIST",
                   help="comma-separated Host names to answer (default: any), against DNS rebinding")
    p.add_argument("--max-connections", type=int, default=None, help="open requests and sockets at once (default 512)")
    p.add_argument("--no-demo", action="store_true", help="do not serve the Gradio demo page at /demo")
    scale = p.add_argument_group("scale-out (pip install 'multistream[scale]'; see docs/scaling.md)")
    scale.add_argument("--event-log", default=os.environ.get("MULTISTREAM_EVENT_LOG"), metavar="URL",
                       help="redis://HOST:PORT/DB: log every event to Redis, so a resume works from any process "
                       "and across restarts (default: 'memory', this process only)")
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
    scale.add_argument("--image-checkpoint-every", type=int, default=1, metavar="K",
                       help="--ray with --event-log: image replicas checkpoint a stream every K denoising steps, "
                       "so a replica taking over continues from there (default 1)")
    scale.add_argument("--autoscale", action="store_true",
                       help="--ray: autoscale model replicas between 1 and the --*-replicas counts")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_setting_flags(p)
    p.set_defaults(func=run)


# The flags above that name a ServerSettings field in their own words; every other field gets a
# flag of its own name (`_add_setting_flags`), so every setting is reachable from the command line.
NAMED_FLAGS = {
    "api_key": "api_key", "grace_period_s": "grace_period", "shutdown_deadline_s": "shutdown_deadline",
    "text_concurrency": "text_concurrency", "image_concurrency": "image_concurrency", "queue_size": "queue_size",
    "heartbeat_s": "heartbeat", "keys_file": "keys", "blocklist_file": "blocklist",
    "allowed_origins": "allowed_origins", "allowed_hosts": "allowed_hosts", "max_connections": "max_connections",
    "event_log": "event_log",
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
        "server settings", "every other ServerSettings field; each also reads MULTISTREAM_<FIELD> from the environment")
    for field in dataclasses.fields(ServerSettings):
        if field.name in NAMED_FLAGS:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = str(field.type)
        default = field.default
        help_text = f"{_setting_help(field.name)}; default {default!r}"
        if "bool" in kind:
            group.add_argument(flag, dest=field.name, action="store_true", default=None, help=help_text)
        elif "tuple" in kind:
            group.add_argument(flag, dest=field.name, default=None, metavar="LIST", help=help_text + " (comma-separated)")
        else:
            number = float if ("float" in kind or field.name.endswith("_s")) else int if "int" in kind else str
            group.add_argument(flag, dest=field.name, type=number, default=None, help=help_text)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from ..server import ServerSettings, create_app, serve

    given = {name: getattr(args, flag, None) for name, flag in NAMED_FLAGS.items()}
    given.update({f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerSettings)
                  if f.name not in NAMED_FLAGS})
    given["api_key"] = given["api_key"] or None
    given["event_log"] = given["event_log"] or None
    settings = ServerSettings.from_env(**given)

    def spec(value: str) -> str | None:
        return None if value.lower() in ("none", "off", "") else value

    if args.ray:
        from ..server.ray import serve_ray

        if args.image_checkpoint_every < 1:
            print(f"multistream serve: --image-checkpoint-every must be >= 1, got {args.image_checkpoint_every}",
                  file=sys.stderr)
            return 2

        return serve_ray(settings, text_model=spec(args.text_model), image_model=spec(args.image_model),
                         text_replicas=args.text_replicas, image_replicas=args.image_replicas,
                         ingress_replicas=args.ingress_replicas, autoscale=args.autoscale, host=args.host,
                         port=args.port, address=args.ray_address,
                         image_checkpoint_every=args.image_checkpoint_every)

    # With keys, the demo page asks for a login (an API key as the password) and runs through the
    # same gates as the API.
    demo_path = None if args.no_demo else "/demo"
    app = create_app(text_model=spec(args.text_model), image_model=spec(args.image_model), settings=settings,
                     demo_path=demo_path)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
