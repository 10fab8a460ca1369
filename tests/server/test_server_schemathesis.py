"""A short schemathesis run over the server's own OpenAPI spec: no input gives a 5xx, and every
response matches the schema the spec publishes (benchmarks/schemathesis_fuzz.py runs longer)."""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from multistream.server import ServerSettings, create_app  # noqa: E402
from multistream.testing import ScriptedVideoModel  # noqa: E402

from server_fixtures import ScriptedImageModel, ScriptedTextModel, live_server  # noqa: E402

FUZZ_SETTINGS = dict(max_new_tokens=32, default_max_new_tokens=8, max_steps=4, max_image_side=64, max_images=2,
                     max_prompt_chars=2000, queue_timeout_s=5.0, grace_period_s=1.0)


def fuzz_app() -> Any:
    return create_app(ScriptedTextModel(), ScriptedImageModel(steps=2, size=16),
                      video_model=ScriptedVideoModel(steps=2, num_frames=2, size=16),
                      settings=ServerSettings(**FUZZ_SETTINGS))  # type: ignore[arg-type]


APP = fuzz_app()
schema = schemathesis.openapi.from_dict(APP.openapi())


@pytest.fixture(scope="module")
def base_url():  # type: ignore[no-untyped-def]
    with live_server(APP) as srv:
        yield srv.url


@schema.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_no_server_error_and_responses_match_the_schema(case: Any, base_url: str) -> None:
    case.call_and_validate(base_url=base_url, checks=[not_a_server_error, response_schema_conformance], timeout=30)
