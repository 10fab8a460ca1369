from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

import multistream as ms


def _samples():
    return [
        ms.TextEvent(stream_id="s", seq=0, t=0.001, delta="Hello 世界 🌊", token_ids=[1, 2], index=0),
        ms.TextEvent(
            stream_id="s", seq=1, t=0.25, is_final=True, delta="", token_ids=[], index=2,
            finish_reason="stop", text="Hello 世界 🌊",
            usage={"prompt_tokens": 3, "completion_tokens": 2},
            metrics={"ttft_ms": 1.5, "itl_ms_p50": 2.0, "itl_ms_p95": 3.0, "duration_ms": 5.0, "tokens_per_s": 400.0},
        ),
        ms.ImageEvent(stream_id="i", seq=0, t=0.1, step=1, total_steps=20, width=8, height=8,
                      mime="image/jpeg", data=bytes(range(256))),
        ms.ImageEvent(stream_id="i", seq=1, t=0.2, is_final=True, step=20, total_steps=20, width=64, height=64,
                      mime="image/png", data=b"\x89PNG", finish_reason="stop", metrics={"duration_ms": 200.0}),
        ms.ErrorEvent(stream_id="e", seq=3, t=1.0, error={"type": "ValueError", "message": "boom"}),
    ]


@pytest.mark.parametrize("event", _samples(), ids=lambda e: f"{e.type}-{e.seq}")
def test_round_trip_through_json_is_exact(event):
    wire = json.loads(json.dumps(event.to_dict()))
    back = ms.event_from_dict(wire)
    assert back == event
    assert type(back) is type(event)
    assert ms.event_from_json(event.to_json()) == event


def _reference_json(event) -> str:
    """The wire form as it is defined: the fields in order, None left out, bytes as base64,
    through the compact JSON encoder (what the compiled `_event_wire` codec must equal)."""
    import base64
    import dataclasses

    wire = {"type": event.type}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if value is None:
            continue
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        elif isinstance(value, (list, tuple)):
            value = list(value)
        wire[f.name] = value
    return json.dumps(wire, ensure_ascii=False, separators=(",", ":"))


def _odd_events():
    import enum

    class Level(enum.IntEnum):
        THREE = 3

    return [
        *_samples(),
        # Escapes, a bool where an int goes, an int enum, a tuple, floats JSON spells its own way.
        ms.TextEvent(stream_id='q"\\\n\x01', seq=Level.THREE, t=float("nan"), delta="é\u2028😀", token_ids=(1, 2),
                     index=True, offset=-0.0, is_final=True, finish_reason="stop", text="x",
                     usage={"a": [1.5, float("inf"), -float("inf")]}, metrics={"m": None},
                     logprobs=[{"token": "é", "bytes": [195, 169], "logprob": -0.1}], tool_calls=[]),
        ms.TextEvent(stream_id="s", seq=1, t=1e-7, delta="", committed=0),
        ms.AudioEvent(stream_id="a", seq=0, t=0.5, data=b"\x00\x01" * 5, sample_rate=24000, sample_offset=0,
                      num_samples=5, text_span=[0, 3], mime="audio/pcm"),
        ms.VideoEvent(stream_id="v", seq=0, t=0.5, step=1, total_steps=4, num_frames=8, fps=8, width=16, height=16,
                      mime="image/webp", data=b"RIFF"),
    ]


@pytest.mark.parametrize("event", _odd_events(), ids=lambda e: f"{e.type}-{e.seq}")
def test_the_compiled_wire_form_is_the_reference_byte_for_byte(event):
    assert event.to_json() == _reference_json(event)
    assert json.dumps(event.to_dict(), ensure_ascii=False, separators=(",", ":")) == _reference_json(event)


def test_a_value_json_cannot_hold_fails_as_the_encoder_does():
    event = ms.TextEvent(stream_id="s", seq=0, t=0.0, delta="x", usage={"bad": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        event.to_json()


@pytest.mark.parametrize("event", _samples(), ids=lambda e: f"{e.type}-{e.seq}")
def test_wire_form_validates_against_schema(event):
    jsonschema.validate(event.to_dict(), ms.event_json_schema())


def test_schema_rejects_a_final_text_event_without_finish_reason():
    wire = _samples()[0].to_dict() | {"is_final": True}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wire, ms.event_json_schema())


def test_error_event_is_always_final():
    assert ms.ErrorEvent(stream_id="s", seq=0, t=0.0, error={"type": "X", "message": "m"}).is_final


def test_events_are_frozen():
    ev = _samples()[0]
    with pytest.raises(AttributeError):
        ev.delta = "changed"  # type: ignore[misc]


def test_image_property_decodes_the_frame():
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5, 3), (255, 0, 0)).save(buf, format="PNG")
    ev = ms.ImageEvent(stream_id="i", seq=0, t=0.0, step=1, total_steps=1, width=5, height=3,
                       mime="image/png", data=buf.getvalue())
    assert ev.image.size == (5, 3)
    assert ev.image.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    "wire, problem",
    [
        ([], "JSON object"),
        ({"type": "hologram", "stream_id": "s", "seq": 0, "t": 0}, "unknown event type"),
        ({"type": "text", "stream_id": "s", "seq": 0, "t": 0, "delta": "x", "colour": 1}, "unknown field"),
        ({"type": "text", "stream_id": "s", "seq": -1, "t": 0, "delta": "x"}, "'seq'"),
        ({"type": "text", "stream_id": 5, "seq": 0, "t": 0, "delta": "x"}, "'stream_id'"),
        ({"type": "text", "stream_id": "s", "seq": 0, "t": 0}, "missing field"),
        ({"type": "image", "stream_id": "s", "seq": 0, "t": 0, "step": 1, "total_steps": 1, "width": 1,
          "height": 1, "mime": "image/png", "data": "not base64!"}, "base64"),
    ],
)
def test_bad_wire_events_raise_a_clear_error(wire, problem):
    with pytest.raises(ms.EventFormatError, match=problem):
        ms.event_from_dict(wire)


def test_protocol_imports_without_torch():
    code = "import sys, multistream as ms; ms.event_json_schema(); ms.Stream; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _webp_clip(n: int, side: int = 8) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    frames = [Image.fromarray(np.full((side, side, 3), i * 20, np.uint8)) for i in range(n)]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], duration=125, loop=0, lossless=True)
    return buf.getvalue()


def test_video_event_round_trips_validates_and_decodes_every_frame() -> None:
    import jsonschema

    ev = ms.VideoEvent(stream_id="s", seq=2, t=0.5, step=2, total_steps=20, num_frames=5, fps=8, width=8,
                       height=8, mime="image/webp", data=_webp_clip(5), eta_s=1.5)
    wire = ev.to_dict()
    jsonschema.validate(wire, ms.event_json_schema())
    assert ms.event_from_dict(wire) == ev
    assert [f.getpixel((0, 0)) for f in ev.frames] == [(v, v, v) for v in (0, 20, 40, 60, 80)]


def test_video_contact_sheet_splits_into_frames_in_reading_order() -> None:
    import io

    from PIL import Image

    sheet = Image.new("RGB", (3 * 4, 2 * 4))  # 5 frames of 4x4: ceil(sqrt(5)) = 3 per row
    for i in range(5):
        sheet.paste((i * 40, 0, 0), (i % 3 * 4, i // 3 * 4, i % 3 * 4 + 4, i // 3 * 4 + 4))
    buf = io.BytesIO()
    sheet.save(buf, format="PNG")
    ev = ms.VideoEvent(stream_id="s", seq=0, t=0.0, step=1, total_steps=2, num_frames=5, fps=8, width=4,
                       height=4, mime="image/png", data=buf.getvalue())
    assert [f.getpixel((1, 1))[0] for f in ev.frames] == [0, 40, 80, 120, 160]


def test_video_event_rejects_a_bad_fps() -> None:
    wire = ms.VideoEvent(stream_id="s", seq=0, t=0.0, step=0, total_steps=1, num_frames=1, fps=8, width=1,
                         height=1, mime="image/webp", data=b"x").to_dict()
    with pytest.raises(ms.EventFormatError, match="fps"):
        ms.event_from_dict({**wire, "fps": 0})


def test_save_makes_missing_folders_as_the_command_line_does(tmp_path, monkeypatch):
    """``ev.save("missing/x.webm")`` was a bare FileNotFoundError, while the command line's
    ``--out new/x.wav`` makes the folders; a video or audio event's ``save`` now makes them too
    (a relative path included), and a folder in the way that is a file is still an error."""
    monkeypatch.chdir(tmp_path)
    clip = ms.VideoEvent(stream_id="v", seq=0, t=0.1, is_final=True, step=2, total_steps=2, num_frames=4, fps=8,
                         width=16, height=16, mime="video/webm", data=b"\x1aE\xdf\xa3clip", finish_reason="stop")
    speech = ms.AudioEvent(stream_id="a", seq=2, t=0.3, is_final=True, data=b"", sample_rate=22050, sample_offset=4,
                           num_samples=0, text_span=(0, 3), audio=b"RIFFwav", finish_reason="stop")
    assert clip.save("missing/x.webm").read_bytes() == clip.data
    assert speech.save(tmp_path / "a" / "b" / "hello.wav").read_bytes() == b"RIFFwav"
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        clip.save(tmp_path / "file" / "x.webm")


def test_an_image_event_saves_its_bytes_under_their_own_suffix(tmp_path):
    """Video and audio events had ``save`` and image events had none (users wrote
    ``open(p, "wb").write(ev.data)``, or ``ev.image.save`` which decodes and re-encodes). Now
    ``ev.save`` writes the bytes as they are, refuses a suffix of another format with the fix, and
    makes missing folders."""
    final = ms.ImageEvent(stream_id="i", seq=3, t=0.2, is_final=True, step=20, total_steps=20, width=1, height=1,
                          mime="image/png", data=b"\x89PNG\r\n\x1a\nimage", finish_reason="stop")
    preview = ms.ImageEvent(stream_id="i", seq=1, t=0.1, step=1, total_steps=20, width=1, height=1,
                            mime="image/jpeg", data=b"\xff\xd8jpeg")
    assert final.save(tmp_path / "new" / "final.png").read_bytes() == final.data
    assert preview.save(tmp_path / "step1.JPEG").read_bytes() == preview.data
    with pytest.raises(ms.InvalidArgumentError, match=r"must end in \.png \(or convert it: ev\.image\.save"):
        final.save(tmp_path / "final.jpg")
    assert not (tmp_path / "final.jpg").exists()


def test_a_save_that_fails_midway_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """Events' ``save`` writes through a temporary file moved over the target (as the command
    line's outputs do): a write that fails (a full disk, a Ctrl-C) leaves the old file as it was
    and no temporary file behind; before, ``write_bytes`` truncated the old file first."""
    import builtins

    target = tmp_path / "clip.webm"
    target.write_bytes(b"old clip")
    clip = ms.VideoEvent(stream_id="v", seq=0, t=0.1, is_final=True, step=2, total_steps=2, num_frames=4, fps=8,
                         width=16, height=16, mime="video/webm", data=b"\x1aE\xdf\xa3new", finish_reason="stop")
    real_open = builtins.open

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[:2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(builtins, "open", lambda f, mode="r", *a, **k: FullDisk(real_open(f, mode, *a, **k))
                        if "w" in mode else real_open(f, mode, *a, **k))
    with pytest.raises(OSError, match="No space left"):
        clip.save(target)
    monkeypatch.undo()
    assert target.read_bytes() == b"old clip"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.webm"]
