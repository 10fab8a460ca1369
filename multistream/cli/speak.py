"""``multistream speak "text" --out a.wav``: speak text with the embedded voice (or another model).

Prints one line per chunk as it is made (its text, its time), then a summary on stderr. ``--out``
writes the whole utterance: ``.wav`` as is, ``.mp3`` / ``.flac`` / ``.opus`` / ``.pcm`` encoded.

Example:
    $ multistream speak "Hello there. How are you?" --out hello.wav
    $ multistream speak "Faster, please." --speed 1.5 --out fast.mp3
    $ multistream speak "Hi." --json          # one wire event per line (NDJSON)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import MultistreamError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("speak", help="speak text (streamed sentence by sentence) into a WAV or MP3 file",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", help="the text to speak (at most 4,096 characters)")
    p.add_argument("--out", default=None, help="write the audio here (.wav, .mp3, .flac, .opus, .pcm)")
    p.add_argument("--model", default=None,
                   help="a Piper .onnx voice, or a transformers VitsModel id or folder (default: the embedded voice)")
    p.add_argument("--voice", default=None, help="a voice of the model (default: its default voice)")
    p.add_argument("--speed", type=float, default=1.0, help="0.25 to 4 (default 1)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one wire event per line (NDJSON)")
    p.set_defaults(func=run)


def write_audio(path: str, final: Any) -> None:
    """Write a final audio event's utterance to ``path``, encoded after its extension."""
    ext = os.path.splitext(path)[1].lower().lstrip(".") or "wav"
    if ext == "wav":
        data = final.audio
    else:
        from ..speech import AUDIO_FORMATS, AudioEncoder

        if ext not in AUDIO_FORMATS:
            raise MultistreamError(f"cannot write {path!r}: use a .wav, .mp3, .flac, .opus, .aac or .pcm file name")
        import io
        import wave

        with wave.open(io.BytesIO(final.audio)) as w:
            pcm = w.readframes(w.getnframes())
        enc = AudioEncoder(ext, final.sample_rate, final.sample_rate if ext == "pcm" else None)
        data = enc.feed(pcm) + enc.flush()
    with open(path, "wb") as f:
        f.write(data)


def run(args: argparse.Namespace) -> int:
    from ..speech import load_speech_model, parse_speech_options

    try:
        parse_speech_options(args.text, voice=args.voice, speed=args.speed)  # before the model loads
        tts = load_speech_model(args.model, device=args.device)
        stream = tts.stream(args.text, voice=args.voice, speed=args.speed)
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    final = None
    with stream:
        for ev in stream:
            if args.json:
                print(ev.to_json(), flush=True)
            elif ev.type == "audio" and not ev.is_final:
                a, b = ev.text_span
                print(f"{ev.t:7.3f}s  {ev.num_samples / ev.sample_rate:5.2f}s of audio  {args.text[a:b].strip()}",
                      flush=True)
            if ev.is_final:
                final = ev
    if final is None or final.type == "error":
        message = final.error["message"] if final is not None else "no final event"
        print(f"multistream: {message}", file=sys.stderr)
        return 1
    if args.out:
        try:
            write_audio(args.out, final)
        except (OSError, MultistreamError) as exc:
            print(f"multistream: {exc}", file=sys.stderr)
            return 1
    m = final.metrics or {}
    print(f"[{final.duration_s:.2f} s of audio, first audio {m.get('ttfa_ms')} ms, real-time factor {m.get('rtf')}"
          f"{', wrote ' + args.out if args.out else ''}]", file=sys.stderr)
    return 0
