"""Each OpenAI endpoint's `serving.py` is a pure translator from a stream's events to the endpoint's
chunks: these tests feed it hand-made events, with no server, no model and no network."""

from __future__ import annotations

from typing import Any

from multistream.events import AudioEvent, ErrorEvent, ImageEvent, TextEvent
from multistream.server.openai._choices import ChoiceState
from multistream.server.openai.chat.serving import ChatChunks
from multistream.server.openai.completions.serving import CompletionChunks, Echo
from multistream.server.openai.images.serving import ImageGenerations
from multistream.server.openai.responses.serving import ResponseBuilder


def _text(seq: int, delta: str, ids: list[int], index: int, **kw: Any) -> TextEvent:
    return TextEvent(stream_id="s", seq=seq, t=0.0, delta=delta, token_ids=ids, index=index, **kw)


def _final(seq: int, index: int, text: str, reason: str = "stop", prompt: int = 3, completion: int = 2,
           **kw: Any) -> TextEvent:
    return _text(seq, "", [], index, is_final=True, finish_reason=reason, text=text,
                 usage={"prompt_tokens": prompt, "completion_tokens": completion}, **kw)


def _deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks if c.get("choices")]


def test_chat_chunks_stream_content_finish_and_usage() -> None:
    chunks = ChatChunks("chatcmpl-s", 7, "m", ["s"], include_usage=True, continuous_usage=True)
    out = chunks.opening()
    out += chunks.feed(0, _text(0, "Hel", [1], 0))
    out += chunks.feed(0, _text(1, "lo", [2], 1))
    out += chunks.feed(0, _final(2, 2, "Hello", reason="cancelled"))
    out += chunks.closing()
    assert _deltas(out) == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert all(c["id"] == "chatcmpl-s" and c["object"] == "chat.completion.chunk" and c["created"] == 7 for c in out)
    # OpenAI has no "cancelled": a stream stopped early ends as "stop"
    assert out[3]["choices"][0]["finish_reason"] == "stop"
    assert out[1]["usage"] == {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}
    assert out[-1]["choices"] == [] and out[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                             "total_tokens": 5}
    assert not chunks.failed


def test_chat_chunks_with_beams_send_only_committed_text() -> None:
    chunks = ChatChunks("c", 0, "m", ["s"], beams=True)
    first = chunks.feed(0, _text(0, "Hello wor", [1, 2], 0, offset=0, committed=6))
    # the beam rewrote the tail: only text that can no longer change went out
    second = chunks.feed(0, _text(1, "world", [3], 2, offset=6, committed=11))
    last = chunks.feed(0, _final(2, 3, "Hello world", offset=11, committed=11))
    assert _deltas(first) == [{"content": "Hello "}]
    assert _deltas(second) == [{"content": "world"}]
    assert _deltas(last) == [{}] and last[0]["choices"][0]["finish_reason"] == "stop"


def test_chat_chunks_an_error_ends_the_stream_in_openais_shape() -> None:
    chunks = ChatChunks("c", 0, "m", ["s"])
    out = chunks.feed(0, ErrorEvent(stream_id="s", seq=0, t=0.0, error={"type": "timeout", "message": "too slow"}))
    assert chunks.failed
    assert out == [{"error": {"message": "too slow", "type": "server_error", "param": None, "code": "timeout"}}]


def test_chat_completion_of_two_choices() -> None:
    chunks = ChatChunks("c", 0, "m", ["a", "b"], logprobs=True)
    entry = {"token_id": 1, "token": "Hi", "bytes": [72, 105], "logprob": -0.25, "top_logprobs": []}
    states = [ChoiceState(), ChoiceState()]
    states[0].final, states[0].entries = _final(1, 1, "Hi", completion=1), [entry]
    states[1].final, states[1].entries = _final(1, 1, "Yo", reason="length", completion=4), []
    body = chunks.completion(states)
    assert body["object"] == "chat.completion"
    assert [c["message"]["content"] for c in body["choices"]] == ["Hi", "Yo"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_completion_chunks_echo_the_prompt_then_the_completion() -> None:
    echo = Echo("The sky is", 3, [None, {"token_id": 2, "token": " sky", "bytes": list(b" sky"), "logprob": -1.0,
                                      "top_logprobs": []},
                                  {"token_id": 3, "token": " is", "bytes": list(b" is"), "logprob": -0.5,
                                   "top_logprobs": []}])
    chunks = CompletionChunks("cmpl-s", 0, "m", total=1, n=1, echoes=[echo], logprobs=True, include_usage=True)
    out = chunks.opening()
    assert out[0]["choices"][0]["text"] == "The sky is" and out[0]["choices"][0]["finish_reason"] is None
    lp = out[0]["choices"][0]["logprobs"]
    assert lp["tokens"] == ["The", " sky", " is"] and lp["token_logprobs"] == [None, -1.0, -0.5]
    assert lp["text_offset"] == [0, 3, 7]
    entry = {"token_id": 9, "token": " blue", "bytes": list(b" blue"), "logprob": -0.1, "top_logprobs": []}
    out = chunks.feed(0, _text(0, " blue", [9], 0, logprobs=[entry]))
    assert out[0]["choices"][0]["text"] == " blue"
    assert out[0]["choices"][0]["logprobs"]["text_offset"] == [10]  # after the echoed prompt
    out = chunks.feed(0, _final(1, 1, " blue", reason="length", completion=1))
    assert out[0]["choices"][0]["finish_reason"] == "length"
    assert chunks.closing()[0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_completion_with_max_tokens_zero_is_the_echo_alone() -> None:
    chunks = CompletionChunks("c", 0, "m", total=2, n=2, echoes=[Echo("Hi", 1, None)], generate=False)
    opening = chunks.opening()
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in opening] \
        == [(0, "Hi", "length"), (1, "Hi", "length")]
    body = chunks.completion([])
    assert [c["text"] for c in body["choices"]] == ["Hi", "Hi"]
    assert body["usage"]["prompt_tokens"] == 1


def _image(step: int, total: int = 4, final: bool = False, index: int = 0) -> ImageEvent:
    return ImageEvent(stream_id="s", seq=step, t=0.0, is_final=final, step=step, total_steps=total, width=8,
                      height=8, mime="image/png", data=b"img%d" % step, index=index)


def test_image_generations_spread_the_partial_images_over_the_run() -> None:
    gen = ImageGenerations(num_images=1, partial=2, fmt="png")
    names = [[name for name, _ in gen.feed(_image(step, total=6))] for step in range(1, 7)]
    # of 2 partial images over 6 steps: at steps 2 and 4 (ceil(k * 6 / 3))
    assert names == [[], ["image_generation.partial_image"], [], ["image_generation.partial_image"], [], []]
    (name, done), = gen.feed(_image(6, total=6, final=True))
    assert name == "image_generation.completed" and done["size"] == "8x8" and done["output_format"] == "png"


def test_image_generations_response_and_error() -> None:
    gen = ImageGenerations(num_images=1, partial=0, fmt="webp")
    body, status = gen.response([_image(1), _image(4, final=True)])
    assert status == 200 and body["data"] == [{"b64_json": "aW1nNA=="}] and body["output_format"] == "webp"
    error = ErrorEvent(stream_id="s", seq=2, t=0.0, error={"type": "oom", "message": "out of memory"})
    body, status = gen.response([_image(1), error])
    assert status == 500 and body["error"]["code"] == "oom"
    assert gen.feed(error) == [("error", body)] and gen.failed


def test_response_builder_folds_a_text_stream() -> None:
    b = ResponseBuilder("resp_1", "s", {"model": "m", "created_at": 1})
    kinds = [e["type"] for e in b.start()]
    kinds += [e["type"] for e in b.feed(_text(0, "Hi", [1], 0))]
    kinds += [e["type"] for e in b.feed(_final(1, 1, "Hi"))]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    response = b.response()
    assert response["status"] == "completed"
    assert response["output"][0]["content"][0]["text"] == "Hi"


def test_speech_events_delta_then_done_with_usage() -> None:
    from multistream.server.openai.audio.serving import SpeechEvents

    events = SpeechEvents(input_characters=12)
    assert events.payloads(b"", None) == []
    (name, delta), = events.payloads(b"\x01\x02", None)
    assert name == "speech.audio.delta" and delta["audio"] == "AQI="
    end = AudioEvent(stream_id="s", seq=3, t=0.0, is_final=True, data=b"", sample_rate=24000, sample_offset=24000,
                     num_samples=0, text_span=(0, 12), duration_s=1.0,
                     usage={"input_characters": 12, "audio_seconds": 1.0})
    names = [n for n, _ in events.payloads(b"\x03", end)]
    assert names == ["speech.audio.delta", "speech.audio.done"]
    done = events.payloads(b"", end)[0][1]
    assert done["usage"] == {"input_tokens": 12, "output_tokens": 50, "total_tokens": 62, "input_characters": 12,
                             "audio_seconds": 1.0}
    error = ErrorEvent(stream_id="s", seq=1, t=0.0, error={"type": "x", "message": "failed"})
    assert events.payloads(b"", error) == [("error", {"type": "error", "error": {"type": "x", "message": "failed"}})]


def test_a_chat_body_logs_only_the_fields_it_really_ignores(caplog: Any) -> None:
    import logging

    from multistream.server import ServerSettings
    from multistream.server.openai.chat.protocol import chat_kwargs

    base = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level(logging.INFO, logger="multistream"):
        chat_kwargs(base, ServerSettings())  # the model is checked, not ignored: no line
        assert not [r for r in caplog.records if "ignoring" in r.getMessage()]
        chat_kwargs({**base, "user": "u1"}, ServerSettings())
    assert [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()] == [
        "chat completion: ignoring field(s) ['user']"]
