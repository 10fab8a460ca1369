"""``multistream text "prompt"``: print tokens as they arrive, then a summary line on stderr.

Example:
    $ multistream text "Write a haiku about rivers" --max-new-tokens 48
    $ multistream text "hi" --json          # one wire event per line (NDJSON)
    $ multistream text "Tell me a joke" --speak joke.wav   # the answer also spoken (while written)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._spec import cli_values
from ..errors import ModelLoadError, MultistreamError
from ..text import TextOptions, parse_text_options
from ._checks import declare_options, device
from ._console import model_loading
from ._interrupt import TEXT_NOTICE, CtrlC
from .speak import AudioSoFar, check_audio_path, write_audio


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("text", help="stream text from a language model", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt (sent as one user message when the model has a chat template)")
    p.add_argument("--model", default=None, help="model id or local folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", type=device, default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="quantization of the linear layers (default auto: int4 for the embedded model on a CPU, on "
                   "multistream's native block kernels where a C compiler builds them)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step on ATen's quantized kernels first (~50 s on 2 cores; then about 1.2x "
                   "their tokens/s); skipped where the native decoder layers run")
    # Every generation option, generated from TextOptions (defaults and help are Python's), checked
    # by TextOptions before the model loads.
    declare_options(p, p.add_argument_group("generation options (TextModel.stream)"), TextOptions,
                    lambda args, given: parse_text_options(**given), exclude=("chat", "parallel_tool_calls", "cache_salt"))
    p.add_argument("--raw", action="store_true", help="raw completion: no chat template")
    p.add_argument("--json", action="store_true", help="print one wire event per line (NDJSON)")
    p.add_argument("--speak", default=None, metavar="FILE",
                   help="also speak the answer with the embedded voice, sentence by sentence while it is written, "
                   "into FILE (.wav, .mp3, ...; needs the `speech` extra); Ctrl-C writes what was spoken so far")
    p.set_defaults(func=run, check_paths=lambda args: check_audio_path(args.speak, "--speak"))


def run(args: argparse.Namespace) -> int:
    voice = None
    try:
        what = repr(args.model) if args.model else "the embedded text model (SmolLM2-135M-Instruct)"
        # transformers' bars only (the embedded model's first conversion, weight loading): no diffusers import.
        # None for the embedded model once converted: its load imports no transformers (0.6 s), nor does this.
        libraries = () if args.model is None and _embedded_model_converted() else ("transformers",)
        with model_loading(what + (" and the voice" if args.speak else ""), args.own_process, libraries):
            from ..text import load_text_model  # torch's import too: inside the line and the pause

            if args.speak:
                from ..speech import load_speech_model

                # The voice first: it loads in a moment, and a missing `speech` extra shows before the text model.
                voice = load_speech_model()
            llm = load_text_model(args.model, device=args.device, quantize=args.quantize, compile=args.compile)
        stream = llm.stream(args.prompt, chat=False if args.raw else None, **cli_values(args, args.option_names))
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    spoken = None
    if voice is not None:
        from ..speech import speak

        try:
            spoken = speak(stream, voice)
        except MultistreamError as exc:
            stream.cancel()
            print(f"multistream: {exc}", file=sys.stderr)
            return 2
    text_final = None
    kept = AudioSoFar()
    # Without --speak, Ctrl-C ends the answer where it is (cli._interrupt); with it, the except
    # below keeps the audio spoken so far.
    ctrl_c = CtrlC(lambda line: print(f"\n{line}", file=sys.stderr, flush=True), TEXT_NOTICE) if spoken is None else None
    try:
        with spoken or stream:
            for ev in ctrl_c.events(stream) if ctrl_c is not None else spoken:
                kept.add(ev)
                if args.json:
                    print(ev.to_json(), flush=True)
                elif ev.type == "text":
                    sys.stdout.write(ev.delta)
                    sys.stdout.flush()
                if ev.type == "text" and ev.finish_reason is not None:
                    text_final = ev
    except KeyboardInterrupt:
        if spoken is None:
            raise
        kept.write_interrupted(args.speak, prefix="\n")
        return 130
    final = text_final if spoken is not None and spoken.final is not None and spoken.final.type != "error" \
        else (spoken or stream).final
    if spoken is not None and spoken.final is not None and spoken.final.type == "audio":
        try:
            write_audio(args.speak, spoken.final)
        except (OSError, MultistreamError) as exc:
            print(f"\nmultistream: {exc}", file=sys.stderr)
            return 1
        print(f"\n[spoke {spoken.final.duration_s:.2f} s of audio into {args.speak}]", file=sys.stderr)
    if final is None or final.type == "error":
        message = final.error["message"] if final is not None else "stream ended early"  # type: ignore[union-attr]
        print(f"\nmultistream: error: {message}", file=sys.stderr)
        return 1
    if not args.json:
        sys.stdout.write("\n")
        m, usage = final.metrics or {}, final.usage or {}  # type: ignore[union-attr]
        # Where lookahead drafted, how: a copied answer's tokens/s is read against its steps.
        drafted = int(m.get("drafted_tokens") or 0)
        drafts = (f"{int(m.get('decode_steps') or 0)} decode steps ({int(m.get('accepted_tokens') or 0)} of {drafted} "
                  "drafts kept), ") if drafted else ""
        if m.get("repetition_loops") and final.finish_reason != "repetition":  # type: ignore[union-attr]
            # A small model loops ("a gentle rain, a gentle rain, ..."); say so, and how to end it there.
            print(f"multistream: from token {int(m['repetition_start'])} the answer repeats a "
                  f"{int(m['repetition_period'])}-token unit; --stop-on-repetition ends it there "
                  "(or --repetition-penalty 1.2)", file=sys.stderr)
        print(
            f"[{usage.get('completion_tokens', 0)} tokens, TTFT {m.get('ttft_ms', 0):.0f} ms, "
            f"{m.get('tokens_per_s', 0):.1f} tokens/s, {drafts}finish: {final.finish_reason}]",  # type: ignore[union-attr]
            file=sys.stderr,
        )
    return ctrl_c.status() if ctrl_c is not None else 0


def _embedded_model_converted() -> bool:
    """True when the embedded model's converted folder is there (no conversion, no transformers)."""
    from ..text._embedded_files import converted_folder, embedded_gguf_path

    try:
        return converted_folder(embedded_gguf_path())[1]
    except (ModelLoadError, OSError):  # not installed: load_text_model says so, with the fix
        return False
