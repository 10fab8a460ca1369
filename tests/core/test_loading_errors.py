"""Loading fails at once, with the cause and the fix: a folder that does not exist, a name that is no
hub id, a hub id on a machine that cannot reach the hub (no retry loops), a missing voice file, a
CUDA device on a torch without CUDA; ``multistream serve`` says it in one message.

(How fast is a benchmark figure, not a test: benchmarks/startup.py. These tests show that no hub
request is attempted, which is what took most of a minute.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import multistream as ms
from multistream import _hub

from repo_paths import ROOT


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hub is unreachable (the probe says so), and any other attempt to open a connection is
    recorded and refused: what the hub client's retries would do."""
    attempts: list[str] = []
    monkeypatch.setattr(_hub, "_probe", {})
    monkeypatch.setattr(_hub, "_connects", lambda host, port, timeout: attempts.append(f"probe {host}") and False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(f"connect {args[:1]}")
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def test_an_unknown_hub_id_without_network_fails_without_asking_the_hub(no_network: list[str]) -> None:
    with pytest.raises(ms.ModelLoadError, match="hub is not reachable") as info:
        ms.load_text_model("someone/not-a-cached-model")
    assert "huggingface-cli download someone/not-a-cached-model" in str(info.value)
    assert str(info.value).count("Fix:") == 1
    assert no_network == ["probe huggingface.co"]  # one probe, no request from the hub client


def test_the_probe_is_made_once_for_several_loads(no_network: list[str]) -> None:
    for family_load in (ms.load_text_model, ms.load_image_model, ms.load_text_model):
        with pytest.raises(ms.ModelLoadError, match="hub is not reachable"):
            family_load("someone/not-a-cached-model")
    assert no_network == ["probe huggingface.co"]


def test_hf_hub_offline_is_honoured_without_a_probe(no_network: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ms.ModelLoadError, match="HF_HUB_OFFLINE is set"):
        ms.load_text_model("someone/not-a-cached-model")
    assert no_network == []


@pytest.mark.parametrize("name", ["/no/such/dir", "./no/such/dir", "~/no-such-model-folder", "tests/no-such-model"])
def test_a_path_that_does_not_exist_is_reported_as_a_missing_folder(name: str, no_network: list[str]) -> None:
    with pytest.raises(ms.ModelLoadError, match="no such folder") as info:
        ms.load_text_model(name)
    assert "Repo id" not in str(info.value) and str(info.value).count("Fix:") == 1
    assert no_network == []  # a path is never a hub question


def test_a_name_that_is_no_hub_id_says_so(no_network: list[str]) -> None:
    with pytest.raises(ms.ModelLoadError, match="neither a folder here nor a Hugging Face hub id"):
        ms.load_text_model("not a model name!")
    assert no_network == []


def test_image_loader_reports_missing_folders_and_unreachable_ids(no_network: list[str]) -> None:
    with pytest.raises(ms.ModelLoadError, match="no such folder.*diffusers pipeline"):
        ms.load_image_model("./no/such/pipeline")
    with pytest.raises(ms.ModelLoadError, match="hub is not reachable"):
        ms.load_image_model("someone/not-a-cached-pipeline")
    assert no_network == ["probe huggingface.co"]


def test_a_missing_voice_file_is_not_looked_up_on_the_hub(no_network: list[str]) -> None:
    pytest.importorskip("onnxruntime")
    for name in ("missing-voice.onnx", "./voices/missing.onnx"):
        with pytest.raises(ms.ModelLoadError, match="no such file"):
            ms.load_speech_model(name)
    with pytest.raises(ms.ModelLoadError, match="hub is not reachable"):
        ms.load_speech_model("someone/not-a-cached-voice")
    assert no_network == ["probe huggingface.co"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_cuda_without_cuda_is_a_model_load_error_with_the_fix() -> None:
    with pytest.raises(ms.ModelLoadError, match=r"asks for CUDA.*Fix: use device='cpu'"):
        ms.load_text_model(device="cuda")
    with pytest.raises(ms.ModelLoadError, match=r"asks for CUDA.*Fix: use device='cpu'"):
        ms.load_image_model(device="cuda")


def test_speech_cuda_without_cuda_is_a_model_load_error() -> None:
    ort = pytest.importorskip("onnxruntime")
    if torch.cuda.is_available() or "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    with pytest.raises(ms.ModelLoadError, match=r"asks for CUDA.*Fix: use device='cpu'"):
        ms.load_speech_model(device="cuda")


def test_a_load_failure_in_the_server_states_the_fix_once() -> None:
    pytest.importorskip("fastapi")
    from multistream.server.state import load_failure

    exc = ms.ModelLoadError("no such folder: '/x'. Fix: check the path")
    line = load_failure("text", "/x", exc)
    assert line.count("Fix:") == 1 and "--text-model none" in line


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--text-model", "/no/such/dir", "no such folder"),
    ("--speech-model", "./missing.onnx", "no such file"),
])
def test_serve_with_a_missing_model_prints_one_clean_message(flag: str, value: str, message: str) -> None:
    pytest.importorskip("fastapi")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "multistream", "serve", "--port", "0", flag, value],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert message in out and out.count("Fix:") == 1 and "Traceback" not in out, out
    assert "Uvicorn running" not in out  # refused before the server started
