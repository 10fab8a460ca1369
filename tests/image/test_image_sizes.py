"""Image sizes: each model declares the sizes it can make, and every surface (Python, the command
line, the native route, the OpenAI route) refuses another size before any work, naming them.

On main, 100x100 reached diffusers (which needs multiples of 8) and failed inside the run: an
``error`` event in Python, a traceback on the command line, a 500 from the OpenAI route; and
1024x1024 ran on the 64-pixel embedded model for minutes.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys

import httpx
import openai
import pytest
from PIL import Image
from test_image import one_thread  # noqa: F401

import multistream as ms
from multistream.image import EMBEDDED_IMAGE_SIZES, EMBEDDED_MODEL_DIR, ImageSizes
from multistream.testing import _random_pipelines as rp

from repo_paths import ROOT

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from server_fixtures import make_server

ACCEPTED = "multiples of 16 from 32 to 128 pixels, native 64x64"

needs_embedded = pytest.mark.skipif(not (EMBEDDED_MODEL_DIR / "model_index.json").is_file(),
                                    reason="the embedded image model is not installed")


# --- the declaration ----------------------------------------------------------------------------


def test_sizes_name_the_nearest_ones() -> None:
    sizes = ImageSizes(multiple=16, min_side=32, max_side=128, native=(64, 64))
    assert sizes.check(48, 128) == (48, 128) and sizes.check(None, None) == (None, None)
    with pytest.raises(ms.InvalidArgumentError, match=r"width=100 is not a multiple of 16: .*use e\.g\. width=96 or 112"):
        sizes.check(64, 100)
    with pytest.raises(ms.InvalidArgumentError, match=r"height=1024 is above 128: .*use e\.g\. height=128"):
        sizes.check(1024, 64)
    with pytest.raises(ms.InvalidArgumentError, match=r"height=16 is below 32: .*use e\.g\. height=32"):
        sizes.check(16, 64)


def test_a_pipeline_accepts_its_real_factor_up_to_twice_its_native_side() -> None:
    # The tiny test pipeline's VAE downsamples by 2, but diffusers' Stable Diffusion wants
    # multiples of 8 whatever the VAE: the factor that counts is 8.
    sd = ms.load_image_model(rp.tiny_sd_pipeline(scheduler="ddim"))
    assert sd.vae_scale_factor == 2
    native = sd.default_size
    assert sd.sizes == ImageSizes(multiple=8, min_side=8, max_side=2 * max(native), native=native, why=sd.sizes.why)
    with pytest.raises(ms.InvalidArgumentError, match="height=36 is not a multiple of 8"):
        sd.stream("x", height=36, width=32)
    with pytest.raises(ms.InvalidArgumentError, match=f"width={4 * max(native)} is above {2 * max(native)}"):
        sd.stream("x", width=4 * max(native))
    final = sd.generate("x", steps=2, seed=0, height=40, width=24, preview="none")
    assert (final.width, final.height) == (24, 40)
    sd.close()


# --- Python ------------------------------------------------------------------------------------


@pytest.mark.model
@needs_embedded
@pytest.mark.parametrize(("height", "width"), [(100, 100), (1024, 1024), (8192, 8192), (16, 64), (64, 72)])
def test_embedded_model_refuses_sizes_it_cannot_make_at_call_time(shapes: ms.ImageModel, height: int, width: int) -> None:
    # Refused by stream() itself, so no request ever reaches the engine (on main 8192x8192 grew
    # to 6.6 GB and could not be cancelled for minutes).
    assert shapes.sizes is EMBEDDED_IMAGE_SIZES
    with pytest.raises(ms.InvalidArgumentError, match=ACCEPTED):
        shapes.stream("a red circle on a blue background", height=height, width=width)


@pytest.mark.model
@needs_embedded
def test_embedded_model_makes_every_accepted_shape(shapes: ms.ImageModel) -> None:
    for height, width in [(32, 128), (128, 48), (None, None)]:
        final = shapes.generate("a red circle on a blue background", steps=2, seed=0, height=height, width=width,
                                preview="none")
        assert final.type == "image" and final.finish_reason == "stop"
        assert (final.height, final.width) == (height or 64, width or 64) == final.image.size[::-1]


# --- the command line --------------------------------------------------------------------------


def test_cli_refuses_a_size_before_the_model_loads(monkeypatch, tmp_path, capsys) -> None:
    import multistream.image._loading as loading
    from multistream import cli

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded for a size it cannot make")

    # The package's lazy name first: read after the module's is patched, it would keep the patch.
    monkeypatch.setattr("multistream.image.load_image_model", must_not_load)
    monkeypatch.setattr(loading, "load_image_model", must_not_load)
    out = tmp_path / "out"
    assert cli.main(["image", "x", "--width", "100", "--height", "100", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--height 100 is not a multiple of 16" in err and ACCEPTED in err  # the flag, as the CLI spells it
    assert not out.exists()


@pytest.mark.model
@needs_embedded
def test_cli_process_exits_2_with_the_sizes_and_no_traceback(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "multistream", "image", "a red circle", "--width", "1024",
                           "--height", "1024", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--height 1024 is above 128" in proc.stderr and ACCEPTED in proc.stderr
    assert "Traceback" not in proc.stderr


# --- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(shapes: ms.ImageModel):
    with make_server(image=shapes) as live:
        yield live


@pytest.mark.model
@needs_embedded
def test_native_route_answers_400_with_the_sizes(server) -> None:
    r = httpx.post(f"{server.url}/v1/image", json={"prompt": "x", "width": 100, "height": 100}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_argument" and ACCEPTED in error["message"]


@pytest.mark.model
@needs_embedded
@pytest.mark.parametrize("size", ["100x100", "1024x1024", "64x200"])
def test_openai_sdk_gets_bad_request_for_a_size_the_model_cannot_make(server, size: str) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt="a red circle", size=size)  # type: ignore[arg-type]
    body = caught.value.body
    assert isinstance(body, dict) and ACCEPTED in body["message"] and body["type"] == "invalid_request_error"
    # About the field the client sent, in its terms (it was param None and "height=100 ..." before).
    assert body["param"] == "size", body
    assert body["message"].startswith(f"size '{size}' is not one this image model makes"), body["message"]
    assert "e.g. size='64x64'" in body["message"]


@pytest.mark.model
@needs_embedded
@pytest.mark.parametrize("size", [None, "auto", "48x96"])
def test_openai_size_auto_or_omitted_is_the_native_size(server, size: str | None) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    extra = {} if size is None else {"size": size}
    out = client.images.generate(prompt="a red circle on a blue background", extra_body={"steps": 2}, **extra)
    image = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json or "")))
    expected = (64, 64) if size in (None, "auto") else (48, 96)
    assert image.size == expected
    assert out.size == f"{expected[0]}x{expected[1]}"  # type: ignore[attr-defined]
