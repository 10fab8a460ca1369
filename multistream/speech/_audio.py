"""Audio helpers without a model: WAV bytes, resampling and encoding (PyAV, i.e. FFmpeg's codecs).

Example:
    >>> import numpy as np
    >>> wav = wav_bytes(np.zeros(10, dtype="<i2").tobytes(), 22050)
    >>> wav[:4], len(wav)
    (b'RIFF', 64)
"""

from __future__ import annotations

import io
import wave
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["AUDIO_FORMATS", "AudioEncoder", "pcm_mime", "resample_pcm", "wav_bytes"]

#: ``response_format`` values of OpenAI's ``/v1/audio/speech`` and their content types.
AUDIO_FORMATS: dict[str, str] = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
    "aac": "audio/aac",
}

# PyAV container and codec, and the sample rate each codec is given.
_CODECS: dict[str, tuple[str, str, int | None]] = {
    "mp3": ("mp3", "libmp3lame", None),
    "opus": ("ogg", "libopus", 48000),
    "flac": ("flac", "flac", None),
    "aac": ("adts", "aac", None),
}


def pcm_mime(sample_rate: int) -> str:
    return f"audio/pcm;rate={sample_rate};bits=16;channels=1"


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    """16-bit mono little-endian PCM as a WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buf.getvalue()


def wav_header(sample_rate: int) -> bytes:
    """A WAV header for a stream of unknown length (sizes set to the maximum, as streaming
    servers do; players read to the end)."""
    import struct

    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF))


class _Resampler:
    """Incremental 16-bit mono resampling with FFmpeg's swresample (through PyAV)."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        import av

        self.rate_in = rate_in
        self._av = av
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=rate_out)
        self._pts = 0

    def feed(self, pcm: bytes) -> list[Any]:
        import numpy as np

        if not pcm:
            return []
        samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
        frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self.rate_in
        frame.pts = self._pts
        self._pts += samples.shape[1]
        return list(self._resampler.resample(frame))

    def flush(self) -> list[Any]:
        return list(self._resampler.resample(None))


def _frames_bytes(frames: list[Any]) -> bytes:
    return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)


def resample_pcm(pcm: bytes, rate_in: int, rate_out: int) -> bytes:
    """All of ``pcm`` at ``rate_out`` (e.g. OpenAI's 24 kHz ``pcm`` from a 22.05 kHz voice)."""
    if rate_in == rate_out:
        return pcm
    r = _Resampler(rate_in, rate_out)
    return _frames_bytes(r.feed(pcm) + r.flush())


class AudioEncoder:
    """Encode a stream of PCM chunks into ``fmt`` bytes as they come: ``feed(pcm) -> bytes`` (what
    is ready so far), ``flush() -> bytes`` (the rest). ``pcm`` is raw 16-bit at ``rate_out``
    (resampled when the model's rate differs); ``wav`` is a streaming WAV (header first).

    Example:
        >>> enc = AudioEncoder("pcm", 24000, 24000)
        >>> enc.feed(b"\\x01\\x00") + enc.flush()
        b'\\x01\\x00'
    """

    def __init__(self, fmt: str, sample_rate: int, rate_out: int | None = None) -> None:
        if fmt not in AUDIO_FORMATS:
            raise InvalidArgumentError(f"response_format must be one of {sorted(AUDIO_FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.mime = AUDIO_FORMATS[fmt]
        codec = _CODECS.get(fmt)
        rate = rate_out or (codec[2] if codec and codec[2] else sample_rate)
        self.rate = rate
        self._resampler = _Resampler(sample_rate, rate) if rate != sample_rate else None
        self._header = wav_header(rate) if fmt == "wav" else b""
        self._container: Any = None
        if codec is not None:
            import av

            self._out = io.BytesIO()
            self._container = av.open(self._out, mode="w", format=codec[0])
            self._stream = self._container.add_stream(codec[1], rate=rate, layout="mono")
            self._pts = 0
            self._taken = 0

    def _pcm_frames(self, pcm: bytes, final: bool) -> list[Any]:
        import av
        import numpy as np

        if self._resampler is not None:
            frames = self._resampler.feed(pcm) + (self._resampler.flush() if final else [])
            return frames
        if not pcm:
            return []
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm, dtype="<i2").reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        return [frame]

    def _take(self) -> bytes:
        data = self._out.getvalue()
        new, self._taken = data[self._taken:], len(data)
        return new

    def _encode(self, frames: list[Any], final: bool) -> bytes:
        for frame in frames:
            frame.pts = self._pts
            self._pts += frame.samples
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        if final:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        return self._take()

    def feed(self, pcm: bytes) -> bytes:
        frames = self._pcm_frames(pcm, final=False)
        if self._container is None:
            out, self._header = self._header + _frames_bytes(frames) if self._resampler else self._header + pcm, b""
            return out
        return self._encode(frames, final=False)

    def flush(self) -> bytes:
        frames = self._pcm_frames(b"", final=True)
        if self._container is None:
            out, self._header = self._header + _frames_bytes(frames), b""
            return out
        return self._encode(frames, final=True)
