"""``multistream speak "text" --out a.wav``: speak text with the embedded voice (or another model).

Prints one line per chunk as it is made (its text, its time), then a summary on stderr. ``--out``
writes the whole utterance: ``.wav`` as is, ``.mp3`` / ``.flac`` / ``.opus`` (``.ogg``) / ``.aac`` /
``.pcm`` encoded; checked before the voice loads, written atomically. Ctrl-C writes the audio made
so far and says so.

Example:
    $ multistream speak "Hello there. How are you?" --out hello.wav
    $ multistream speak "Faster, please." --speed 1.5 --out fast.mp3
    $ multistream speak "Hi." --json          # one wire event per line (NDJSON)
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import wave
from typing import Any

from ..errors import InvalidArgumentError, MultistreamError
from ..speech import SpeechOptions, parse_speech_options
from ._checks import declare_options, device, flag_problem, refuse
from ._files import atomic_write, check_output_file


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("speak", help="speak text (streamed sentence by sentence) into a WAV or MP3 file",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", help="the text to speak (at most 4,096 characters)")
    p.add_argument("--out", default=None, help="write the audio here (.wav, .mp3, .flac, .opus, .ogg, .aac, .pcm)")
    p.add_argument("--model", default=None,
                   help="a Piper .onnx voice, or a transformers VitsModel id or folder (default: the embedded voice)")
    # Every speech option (--voice, --speed, --priority), generated from SpeechOptions.
    declare_options(p, p.add_argument_group("speech options (SpeechModel.stream)"), SpeechOptions, check_speech)
    p.add_argument("--device", type=device, default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one wire event per line (NDJSON)")
    p.set_defaults(func=run, check_paths=lambda args: check_audio_path(args.out, "--out"))


def check_speech(args: argparse.Namespace, given: dict[str, Any]) -> SpeechOptions:
    """The speech options together, then ``--voice`` against the model's voices where they are
    known before it loads (the embedded voice, a Piper file): an unknown voice was refused only
    after the voice had loaded."""
    options = parse_speech_options(args.text, **given)
    if options.voice is not None:
        from ..speech._loading import voices_before_loading
        from ..speech._synth import check_voice

        voices = voices_before_loading(args.model)
        if voices is not None:
            try:
                check_voice(voices, options.voice)
            except InvalidArgumentError as exc:
                raise flag_problem("voice", exc) from None
    return options


def audio_suffixes() -> dict[str, str]:
    """``{".mp3": "mp3", ...}``: the file suffixes the command line writes audio in, from the
    server's formats (`multistream.speech.AUDIO_FORMATS`); ``.ogg`` is an Ogg Opus file."""
    from ..speech import AUDIO_FORMATS

    return {"." + fmt: fmt for fmt in AUDIO_FORMATS} | {".ogg": "opus"}


def check_audio_path(path: str | None, flag: str) -> str | None:
    """The format ``path`` will be written in (a path without a suffix is a WAV), or
    `InvalidArgumentError` before anything is made."""
    if path is None:
        return None
    return check_output_file(path, flag, audio_suffixes(), "an audio file", default="wav")


def write_wav_as(path: str, wav: bytes, sample_rate: int) -> None:
    """Write a WAV's audio to ``path`` (atomically), encoded after its suffix."""
    suffix = os.path.splitext(path)[1].lower()
    fmt = audio_suffixes().get(suffix, None if suffix else "wav")
    if fmt is None:
        raise MultistreamError(f"cannot write {path!r}: use a file name ending in {', '.join(audio_suffixes())}")
    if fmt == "wav":
        atomic_write(path, wav)
        return
    from ..speech import AudioEncoder

    with wave.open(io.BytesIO(wav)) as w:
        pcm = w.readframes(w.getnframes())
    enc = AudioEncoder(fmt, sample_rate, sample_rate if fmt == "pcm" else None)
    atomic_write(path, enc.feed(pcm) + enc.flush())


def write_audio(path: str, final: Any) -> None:
    """Write a final audio event's utterance to ``path``, encoded after its extension."""
    write_wav_as(path, final.audio, final.sample_rate)


class AudioSoFar:
    """The audio chunks of a stream as they arrive, so that a stopped run (Ctrl-C) can still write
    what was made: laid at their sample offsets, as the final event's WAV would have them.

    Example:
        >>> from multistream.events import AudioEvent
        >>> kept = AudioSoFar()
        >>> kept.add(AudioEvent(stream_id="s", seq=0, t=0, data=b"\\x01\\x00" * 4, sample_rate=8000,
        ...                     sample_offset=0, num_samples=4, text_span=(0, 3)))
        >>> kept.seconds, kept.wav()[:4]
        (0.0005, b'RIFF')
    """

    def __init__(self) -> None:
        self.chunks: dict[int, bytes] = {}
        self.sample_rate = 0

    def add(self, ev: Any) -> None:
        if ev.type == "audio" and not ev.is_final and ev.num_samples:
            self.chunks[ev.sample_offset] = ev.data
            self.sample_rate = ev.sample_rate

    @property
    def seconds(self) -> float:
        return sum(len(d) // 2 for d in self.chunks.values()) / self.sample_rate if self.sample_rate else 0.0

    def wav(self) -> bytes:
        from ..speech import wav_bytes

        pcm = bytearray()
        for offset in sorted(self.chunks):
            pcm.extend(b"\x00\x00" * max(0, offset - len(pcm) // 2))  # a gap (never expected) stays silent
            pcm.extend(self.chunks[offset])
        return wav_bytes(bytes(pcm), self.sample_rate or 22050)

    def write_interrupted(self, path: str | None, prefix: str = "") -> None:
        """After Ctrl-C: write the audio so far to ``path`` (if any was made) and say so on stderr."""
        if path is None:
            print(f"{prefix}[interrupted]", file=sys.stderr)
        elif not self.chunks:
            print(f"{prefix}[interrupted before any audio was made; {path} not written]", file=sys.stderr)
        else:
            write_wav_as(path, self.wav(), self.sample_rate)
            print(f"{prefix}[interrupted: wrote the {self.seconds:.2f} s of audio made so far into {path}]",
                  file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from .._spec import cli_values
    from ..speech import load_speech_model

    options = cli_values(args, args.option_names)  # checked before this ran (cli._checks)
    try:
        tts = load_speech_model(args.model, device=args.device)
        stream = tts.stream(args.text, **options)
    except InvalidArgumentError as exc:
        # An option only the loaded model can check (the voice of a transformers model): named by
        # its flag, as the checks before loading name it.
        return refuse("speak", flag_problem(exc.param, exc) if exc.param else exc)
    except MultistreamError as exc:
        print(f"multistream: {exc}", file=sys.stderr)
        return 2
    final = None
    kept = AudioSoFar()
    try:
        with stream:
            for ev in stream:
                kept.add(ev)
                if args.json:
                    print(ev.to_json(), flush=True)
                elif ev.type == "audio" and not ev.is_final:
                    a, b = ev.text_span
                    print(f"{ev.t:7.3f}s  {ev.num_samples / ev.sample_rate:5.2f}s of audio  {args.text[a:b].strip()}",
                          flush=True)
                if ev.is_final:
                    final = ev
    except KeyboardInterrupt:
        kept.write_interrupted(args.out)
        return 130
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
