"""Every ServerSettings field is reachable from ``multistream serve`` (flags generated from the
settings, help written once in their docstring)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import multistream as ms
import multistream.server as server_pkg
from multistream import cli
from multistream.server import ServerSettings


def _settings_from(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> ServerSettings:
    seen: dict[str, Any] = {}

    def fake_create_app(**kwargs: Any) -> str:
        seen["settings"] = kwargs["settings"]
        return "app"

    monkeypatch.setattr(server_pkg, "create_app", fake_create_app)
    monkeypatch.setattr(server_pkg, "serve", lambda app, **kw: None)
    assert cli.main(["serve", "--text-model", "none", "--image-model", "none", *argv]) == 0
    return seen["settings"]


def test_client_concurrency_has_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    # An app backend calling from one address for all its users needs more than 16 streams.
    assert _settings_from(["--client-concurrency", "200"], monkeypatch).client_concurrency == 200


def test_every_setting_is_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    for field in dataclasses.fields(ServerSettings):
        flag = "--" + field.name.replace("_", "-")
        kind = str(field.type)
        if "bool" in kind:
            argv, expected = [flag], True
        elif "tuple" in kind:
            argv, expected = [flag, "a.example,b.example"], ("a.example", "b.example")
        elif field.name in ("api_key",):
            argv, expected = [flag, "secret"], "secret"
        elif field.name in ("keys_file", "blocklist_file", "event_log"):
            continue  # these open files or connect; their flags are covered by their own tests
        elif "float" in kind or field.name.endswith("_s"):
            argv, expected = [flag, "7.5"], 7.5
        else:
            argv, expected = [flag, "7"], 7
        assert getattr(_settings_from(argv, monkeypatch), field.name) == expected, flag


def test_older_flag_names_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings_from(["--grace-period", "5", "--heartbeat", "2", "--shutdown-deadline", "3"], monkeypatch)
    assert (settings.grace_period_s, settings.heartbeat_s, settings.shutdown_deadline_s) == (5.0, 2.0, 3.0)


def test_help_comes_from_the_settings_declaration(capsys: pytest.CaptureFixture[str]) -> None:
    from multistream._spec import option_fields

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for field in option_fields(ServerSettings):  # every field is a flag, its help the declared description
        assert "--" + field.name.replace("_", "-") in out, field.name
    doc = next(f for f in option_fields(ServerSettings) if f.name == "client_concurrency").metadata["option"].doc
    assert " ".join(doc.split()) in out


def test_environment_variables_are_read_by_each_fields_type() -> None:
    settings = ServerSettings.from_env({"MULTISTREAM_GRACE_PERIOD_S": "5", "MULTISTREAM_ALLOW_PARTIAL": "true",
                                        "MULTISTREAM_ALLOWED_HOSTS": "a.example, b.example", "MULTISTREAM_API_KEY": "",
                                        "MULTISTREAM_TEXT_CONCURRENCY": "3", "MULTISTREAM_SPECULATE": "0"})
    assert (settings.grace_period_s, settings.allow_partial, settings.allowed_hosts, settings.api_key,
            settings.text_concurrency, settings.speculate) == (5.0, True, ("a.example", "b.example"), None, 3, 0)
    with pytest.raises(ms.InvalidArgumentError) as info:
        ServerSettings.from_env({"MULTISTREAM_QUEUE_SIZE": "many"})
    assert info.value.param == "queue_size" and "MULTISTREAM_QUEUE_SIZE='many' is not a number" in str(info.value)
    with pytest.raises(ms.InvalidArgumentError) as info:
        ServerSettings(max_priority=-1)
    assert info.value.param == "max_priority"
    assert str(info.value) == "ServerSettings.max_priority must be an integer >= 0, got -1"


def test_a_bad_setting_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--text-model", "none", "--image-model", "none", "--queue-size", "0"]) == 2
    # The flag as the user typed it (a newcomer read "ServerSettings.text_concurrency" for --text-concurrency).
    assert "multistream serve: --queue-size must be an integer >= 1, got 0" in capsys.readouterr().err


def test_a_bad_optional_setting_flag_says_leave_it_out_not_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--text-model", "none", "--image-model", "none", "--video-concurrency", "0"]) == 2
    # It said "must be an integer >= 1 or None": no flag value spells None.
    assert ("multistream serve: --video-concurrency must be an integer >= 1 (or leave --video-concurrency out), "
            "got 0") in capsys.readouterr().err


def test_a_bad_setting_from_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MULTISTREAM_QUEUE_SIZE", "0")
    assert cli.main(["serve", "--text-model", "none", "--image-model", "none"]) == 2
    assert "multistream serve: MULTISTREAM_QUEUE_SIZE must be an integer >= 1, got 0" in capsys.readouterr().err


def test_serve_quantize_reaches_the_text_model_loader() -> None:
    """``multistream serve --quantize Q``: a named model loads with ``quantize=Q`` (a picklable
    factory, so Ray replicas get it too); 'auto' keeps the name (the library default)."""
    import pickle

    from multistream.cli.serve import text_model_spec
    from multistream.text import load_text_model

    assert text_model_spec("default") == "default" and text_model_spec("none", "int8") is None
    assert text_model_spec("multistream.testing:ScriptedTextModel", "int8") == "multistream.testing:ScriptedTextModel"
    factory = pickle.loads(pickle.dumps(text_model_spec("default", "none")))
    assert factory.func is load_text_model and factory.args == (None,)
    assert factory.keywords == {"quantize": "none", "compile": False}
    assert text_model_spec("default", "auto", True).keywords == {"quantize": "auto", "compile": True}
    assert text_model_spec("/models/llama", "int4").args == ("/models/llama",)

    seen: dict[str, Any] = {}
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setattr(server_pkg, "create_app", lambda **kwargs: seen.update(kwargs) or "app")
        m.setattr(server_pkg, "serve", lambda app, **kw: None)
        assert cli.main(["serve", "--quantize", "int8", "--image-model", "none"]) == 0
    assert seen["models"]["text"].keywords == {"quantize": "int8", "compile": False}
