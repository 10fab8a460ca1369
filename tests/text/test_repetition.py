"""Generation health: repetition loops found per text stream (`RepetitionDetector`), flagged on the final
event, counted in ``/metrics`` (``multistream_repetition_loops_total``) and, with
``stop_on_repetition=True``, ended with ``finish_reason="repetition"``. The embedded model loops on
"Describe Tokyo." under a city schema (a katakana string repeated to the length limit)."""

from __future__ import annotations

import httpx
import openai
import pytest

from multistream.text import parse_text_options
from multistream.text._repetition import RepetitionDetector

from server_fixtures import make_server

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"},
                                         "landmarks": {"type": "array", "items": {"type": "string"}}},
        "required": ["city", "country", "population", "landmarks"]}
TOKYO = [{"role": "user", "content": "Describe Tokyo."}]


def test_a_repeated_unit_is_a_loop() -> None:
    d = RepetitionDetector()
    prefix = list(range(100, 140))
    unit = [7, 8, 9, 10, 11]
    assert not any(d.feed(t) for t in prefix)
    hits = [d.feed(t) for t in unit * 8]
    assert hits.count(True) == 1 and d.found == {"period": 5, "start": 40}
    # 4 copies and 32 tokens at least: found at the loop's 32nd token.
    assert hits.index(True) == 31


def test_ordinary_sequences_are_not_loops() -> None:
    d = RepetitionDetector()
    assert not any(d.feed(t) for t in range(1000))           # all different
    d = RepetitionDetector()
    counting = [t for n in range(1000, 1200) for t in (n, 11)]  # "1000, 1001, 1002, ..."
    assert not any(d.feed(t) for t in counting)
    d = RepetitionDetector()
    assert not any(d.feed(t) for t in [5] * 31)              # a run shorter than 32 tokens
    assert d.feed(5)


def test_the_option_is_checked() -> None:
    assert parse_text_options(stop_on_repetition=True).stop_on_repetition is True
    with pytest.raises(Exception, match="stop_on_repetition must be True or False"):
        parse_text_options(stop_on_repetition="yes")


@pytest.mark.model
def test_the_embedded_model_loops_on_tokyo_and_stops(text_model) -> None:  # type: ignore[no-untyped-def]
    final = text_model.generate(TOKYO, json_schema=CITY, max_new_tokens=160, temperature=0, stop_on_repetition=True)
    assert final.finish_reason == "repetition"
    assert final.usage["completion_tokens"] < 120
    assert final.metrics["repetition_loops"] == 1.0 and final.metrics["repetition_period"] >= 1
    assert "バラ" in final.text  # the katakana string it repeats


@pytest.mark.model
def test_server_counts_loops_and_responses_say_incomplete(text_model) -> None:  # type: ignore[no-untyped-def]
    with make_server(text_model) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.responses.create(model="default", input="Describe Tokyo.", max_output_tokens=160, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
                                    extra_body={"stop_on_repetition": True})
        assert r.status == "incomplete" and r.incomplete_details.reason == "repetition"
        assert r.usage.output_tokens < 120
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'multistream_repetition_loops_total{kind="text"} 1.0' in metrics
