"""The command line's generation flags come from the option specs (issue 26, item 4): each option has
its flag, the help is the spec's description and default, and a flag not given is not passed, so the
Python default (the model's generation_config where it says so) applies."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

import multistream.image as image_pkg
import multistream.text as text_pkg
from multistream._spec import add_cli_options, cli_values, option_fields
from multistream.cli import build_parser, main
from multistream.image import PREVIEW_MODES, ImageOptions
from multistream.testing import ScriptedImageModel, ScriptedTextModel
from multistream.text import TextOptions


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _help(name: str) -> str:
    return " ".join(_sub(name).format_help().split())


def test_every_scalar_text_option_has_a_flag_defaulting_to_unset() -> None:
    parser = _sub("text")
    args = parser.parse_args(["hi"])
    for field in option_fields(TextOptions):
        if field.name in ("chat", "parallel_tool_calls", "logit_bias", "json_schema", "tools", "tool_choice",
                          "early_stopping", "cache_salt"):
            continue
        assert field.name in args.option_names, field.name
        assert getattr(args, field.name) is None, field.name  # not given: Python's default applies
    assert cli_values(args, args.option_names) == {}


def test_text_help_says_what_python_says() -> None:
    text = _help("text")
    assert "--temperature TEMPERATURE a number >= 0 (0 = greedy); unset: the model's generation_config" in text
    assert "0 = greedy)" in text and "default: 0.0" not in text.split("--temperature")[1].split("--top-p")[0]
    assert "--max-new-tokens MAX_NEW_TOKENS an integer >= 1: tokens to generate at most (default: 256)" in text


@pytest.mark.parametrize("command", ["image", "video"])
def test_a_flag_with_a_default_does_not_say_what_null_means(command: str) -> None:
    """``--preview-max-side``'s help said "unset: full size (default: 256)": leaving the flag out
    gives 256; null (full size) is the Python call's and the server's, which no flag value spells."""
    text = _help(command)
    after = text.rsplit("PREVIEW_MAX_SIDE", 1)[1].split(" --", 1)[0]  # its help, after the usage line
    assert "(default: 256)" in after and "unset" not in after, after


def test_preview_help_lists_every_mode() -> None:
    text = _help("image")
    after = text.split("--preview PREVIEW one of", 1)[1].split("--preview-every", 1)[0]
    for mode in PREVIEW_MODES:
        assert mode in after, mode
    assert "--format PREVIEW_FORMAT" in text and "--max-side PREVIEW_MAX_SIDE" in text  # older spellings kept


def test_text_command_passes_only_given_options(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    class Recording(ScriptedTextModel):
        def stream(self, prompt: Any, **options: Any) -> Any:
            calls.append(options)
            return super().stream(prompt, **options)

    monkeypatch.setattr(text_pkg, "load_text_model", lambda *a, **k: Recording(["a", "b"]))
    assert main(["text", "hi"]) == 0
    assert main(["text", "hi", "--top-k", "5", "--stop", "x", "--stop", "y", "--allowed", "[ab]+", "--logprobs",
                 "--max-new-tokens", "9"]) == 0
    assert calls[0] == {"chat": None}
    assert calls[1] == {"chat": None, "top_k": 5, "stop": ["x", "y"], "allowed": "[ab]+", "logprobs": True,
                        "max_new_tokens": 9}


@pytest.mark.model
def test_the_text_summary_line_says_how_lookahead_drafted(text_model, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A copied answer (the default model, the default speculate="auto") reports its decode steps
    and drafts kept beside its tokens/s; without drafts the line is as it was."""
    monkeypatch.setattr(text_pkg, "load_text_model", lambda *a, **k: text_model)
    copy = "Copy this line exactly: def add(a, b): return a + b  # adds two numbers"
    expected = text_model.generate(copy, max_new_tokens=40).metrics
    assert expected["drafted_tokens"] > 0
    assert main(["text", copy, "--max-new-tokens", "40"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    steps, kept, drafted = (int(expected[k]) for k in ("decode_steps", "accepted_tokens", "drafted_tokens"))
    assert f"tokens/s, {steps} decode steps ({kept} of {drafted} drafts kept), finish: stop]" in line, line
    assert main(["text", copy, "--max-new-tokens", "40", "--speculate", "0"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "drafts" not in line and line.endswith("tokens/s, finish: stop]"), line


def test_image_command_passes_only_given_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    calls: list[dict[str, Any]] = []

    class Recording(ScriptedImageModel):
        def stream(self, prompt: str, **options: Any) -> Any:
            calls.append(options)
            return super().stream(prompt, **options)

    monkeypatch.setattr(image_pkg, "load_image_model", lambda *a, **k: Recording())
    assert main(["image", "x", "--out", str(tmp_path / "a")]) == 0
    assert main(["image", "x", "--out", str(tmp_path / "b.webp"), "--steps", "3", "--quality", "50"]) == 0
    assert calls[0] == {"final_format": "png"}
    assert calls[1] == {"final_format": "webp", "steps": 3, "preview_quality": 50}


def test_a_flag_for_each_wire_kind() -> None:
    parser = argparse.ArgumentParser()
    names = add_cli_options(parser, ImageOptions, names=("steps", "preview"))
    assert names == ["steps", "preview"]
    assert cli_values(parser.parse_args(["--steps", "4"]), names) == {"steps": 4}
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "four"])


@pytest.mark.model
def test_the_text_command_says_when_the_answer_loops_and_how_to_end_it_there(
        text_model, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The 135M model loops on some prompts ("A gentle rain, a gentle rain, ..." to the token limit);
    the command names the loop and the flag that ends it, and says nothing once the flag has."""
    monkeypatch.setattr(text_pkg, "load_text_model", lambda *a, **k: text_model)
    # Two prompts the default model loops on (from token 6 and 12 with AVX2); the first that loops on
    # this CPU (the kernels' vector width may change a greedy answer) is the one tested.
    runs = ((prompt, text_model.generate(prompt, max_new_tokens=96).metrics)
            for prompt in ("Write a haiku about rain.", "Write a haiku about snow."))
    prompt, expected = next(((p, m) for p, m in runs if m.get("repetition_loops")), (None, None))
    assert expected is not None, "neither prompt loops on this CPU: the test needs another"
    assert main(["text", prompt, "--max-new-tokens", "96"]) == 0
    hint, line = capsys.readouterr().err.strip().splitlines()[-2:]
    assert hint == (f"multistream: from token {int(expected['repetition_start'])} the answer repeats a "
                    f"{int(expected['repetition_period'])}-token unit; --stop-on-repetition ends it there "
                    "(or --repetition-penalty 1.2)"), hint
    assert line.endswith("finish: length]"), line
    assert main(["text", prompt, "--max-new-tokens", "96", "--stop-on-repetition"]) == 0
    err = capsys.readouterr().err
    assert "repeats a" not in err and err.strip().endswith("finish: repetition]"), err
