"""Token confidence (issue 16): logprobs on text events, branching from a token, OpenAI's penalties,
logit_bias and min_p, n choices with one prefill, and the OpenAI chat / completions surface.

The fast tests run on the scripted fake; the ones marked ``model`` check the numbers on the real
embedded SmolLM2 against plain forward passes."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import jsonschema
import pytest
import torch

import multistream as ms
from multistream.stream import Stream
from multistream.ui.view import LiveView, split_delta

from server_fixtures import ScriptedTextModel, make_server

MSGS = [{"role": "user", "content": "Name three colours."}]


# -- the protocol (no model) ----------------------------------------------------------------------


def entry(token_id: int, token: str, logprob: float) -> dict[str, Any]:
    raw = list(token.encode())
    return {"token_id": token_id, "token": token, "bytes": raw, "logprob": logprob,
            "top_logprobs": [{"token_id": token_id, "token": token, "bytes": raw, "logprob": logprob}]}


def test_logprobs_round_trip_and_follow_the_schema() -> None:
    ev = ms.TextEvent(stream_id="s", seq=0, t=0.0, delta="Hi", token_ids=[7], index=0, logprobs=[entry(7, "Hi", -0.2)])
    wire = json.loads(ev.to_json())
    assert ms.event_from_dict(wire) == ev
    jsonschema.validate(wire, ms.event_json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**wire, "logprobs": [{"token": "Hi"}]}, ms.event_json_schema())


def test_undelivered_deltas_merge_their_logprobs_one_per_token() -> None:
    def producer(w: Any) -> None:
        for i, piece in enumerate(["a", "b", "c"]):
            w.text(piece, [i], i, logprobs=[entry(i, piece, -float(i))])
        w.finish_text("", [], 3, finish_reason="stop", text="abc", usage={"prompt_tokens": 1, "completion_tokens": 3},
                      metrics={}, logprobs=[])

    s = Stream(producer)
    s.join(5)  # the consumer is late: the three deltas merged into one
    events = list(s)
    assert events[0].delta == "abc" and events[0].token_ids == [0, 1, 2]
    assert [e["token_id"] for e in events[0].logprobs] == [0, 1, 2]


def test_split_delta_and_the_live_view_cut_tokens_on_a_rewind() -> None:
    assert split_delta("你好", [{"bytes": list("你".encode())[:2]}, {"bytes": list("你".encode())[2:]},
                                {"bytes": list("好".encode())}]) == ["", "你", "好"]
    view = LiveView()
    view.apply(ms.TextEvent(stream_id="s", seq=0, t=0, delta="ab", token_ids=[0, 1], index=0,
                            logprobs=[entry(0, "a", -1), entry(1, "b", -2)]))
    view.apply(ms.TextEvent(stream_id="s", seq=1, t=0, delta="", token_ids=[], index=1, offset=1, revision=1))
    view.apply(ms.TextEvent(stream_id="s", seq=2, t=0, delta="z", token_ids=[5], index=1, offset=1, revision=1,
                            logprobs=[entry(5, "z", -0.1)]))
    assert [(t.start, t.text) for t in view.tokens] == [(0, "a"), (1, "z")] and view.text(0) == "az"


def test_fake_streams_logprobs_and_branches_to_the_chosen_token() -> None:
    llm = ScriptedTextModel(["a", "b", "c", "d"])
    final = llm.generate("x", top_logprobs=2)
    assert final.text == "abcd"
    assert llm.revise(final, 1, token_id=3).wait().text == "ad"
    with pytest.raises(ms.InvalidArgumentError):
        ScriptedTextModel().stream("x", top_logprobs=21)


# -- the server on the fake (no model) ------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_srv():  # type: ignore[no-untyped-def]
    text = ScriptedTextModel([" one", " two", " three", " four"], delay_s=0.0)
    with make_server(text) as srv:
        srv.text = text  # type: ignore[attr-defined]
        yield srv


def test_openai_bodies_refuse_what_is_not_built_in_openai_shape(fake_srv: Any) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=fake_srv.url, timeout=30) as c:
        for body, param in (({**base, "n": 9}, "n"), ({**base, "top_logprobs": 3}, "top_logprobs"),
                            ({**base, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                            ({**base, "logit_bias": {"x": 1}}, "logit_bias"),
                            ({**base, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools")):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            assert error["param"] == param, (body, error)  # the field to fix, as OpenAI names it
        for body in ({"prompt": "x", "suffix": "y"}, {"prompt": "x", "max_tokens": 0}, {"prompt": [1, 2, 3]},
                     {"prompt": "x", "best_of": 3}, {"prompt": "x", "logprobs": 30}):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["message"]


def test_chat_options_reach_the_model_and_n_streams_interleave(fake_srv: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "logit_bias": {"12": -100}, "min_p": 0.1, "top_k": 3, "repetition_penalty": 1.1, "seed": 4, "n": 3,
            "logprobs": True, "top_logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.Client(base_url=fake_srv.url, timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = fake_srv.text.calls[-3:]
    assert [call["logit_bias"] for call in calls] == [{"12": -100}] * 3
    assert calls[0]["presence_penalty"] == 0.5 and calls[0]["min_p"] == 0.1 and calls[0]["top_logprobs"] == 2
    assert calls[0]["seed"] == 4 and len({call["seed"] for call in calls}) == 3  # seeded from (seed, index)
    content = {i: "" for i in range(3)}
    for ch in chunks:
        for choice in ch["choices"]:
            content[choice["index"]] += choice["delta"].get("content") or ""
            if choice["delta"].get("content"):
                assert [t["token"] for t in choice["logprobs"]["content"]] != []
    assert set(content.values()) == {" one two three four"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all("usage" in ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content"))


def test_rewind_body_takes_a_token_id(fake_srv: Any) -> None:
    from multistream.server.bodies import parse_rewind_body
    from multistream.server.settings import ServerSettings

    assert parse_rewind_body({"offset": 3, "token_id": 42}, ServerSettings()) == (3, {"token_id": 42})


# -- the real embedded model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(text_model):  # type: ignore[no-untyped-def]
    # Logprobs are checked against a plain forward of the whole sequence, on the default model
    # (int4 on the native kernels): one arithmetic for decode and prefill makes them equal.
    return text_model


def forward_logprobs(llm: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return llm.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def reference_greedy(llm: Any, ids: list[int], steps: int, *, presence: float = 0.0, frequency: float = 0.0,
                     bias: dict[int, float] | None = None, first: int | None = None) -> list[int]:
    """Greedy decoding with plain forward passes (KV cache), applying OpenAI's penalties as documented."""
    from transformers import DynamicCache

    out: list[int] = []
    cache = DynamicCache()
    feed = list(ids)
    vocab = llm.model.config.vocab_size
    bias_t = torch.zeros(vocab)
    for t, b in (bias or {}).items():
        bias_t[t] = b
    with torch.no_grad():
        for _ in range(steps):
            logits = llm.model(torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1].float()
            counts = torch.zeros(vocab)
            for t in out:
                counts[t] += 1
            adjusted = logits - frequency * counts - presence * (counts > 0).float() + bias_t
            token = first if first is not None and not out else int(torch.argmax(adjusted))
            if token in llm.eos_token_ids:
                break
            out.append(token)
            feed = [token]
    return out


@pytest.mark.model
def test_logprobs_equal_a_plain_forward_and_greedy_tokens_top_their_alternatives(llm: Any) -> None:
    events = list(llm.stream(MSGS, max_new_tokens=24, logprobs=True, top_logprobs=5))
    ids = [t for ev in events for t in ev.token_ids]
    entries = [e for ev in events for e in ev.logprobs]
    assert len(entries) == len(ids) and [e["token_id"] for e in entries] == ids
    prompt = llm.encode_prompt(MSGS)
    ref = forward_logprobs(llm, prompt + ids)
    for k, (token, e) in enumerate(zip(ids, entries)):
        row = ref[len(prompt) - 1 + k]
        assert abs(row[token].item() - e["logprob"]) < 2e-3
        assert e["top_logprobs"][0]["token_id"] == token  # greedy: its own most likely alternative
        assert len(e["top_logprobs"]) == 5
        assert [a["token_id"] for a in e["top_logprobs"]] == row.topk(5).indices.tolist()
        assert all(abs(a["logprob"] - row[a["token_id"]].item()) < 2e-3 for a in e["top_logprobs"])
    # Not asked: no logprobs on the wire.
    assert all(ev.logprobs is None for ev in llm.stream(MSGS, max_new_tokens=4))


@pytest.mark.model
@pytest.mark.parametrize("prompt", ["请用中文回答：你好，世界。今天天气", "Reply with emoji only: 😀🎉🚀 ❤️ 🌍"])
def test_bytes_spell_the_text_for_cjk_and_emoji(llm: Any, prompt: str) -> None:
    events = list(llm.stream(prompt, chat=False, max_new_tokens=32, logprobs=True))
    final = events[-1]
    spelled = b"".join(bytes(e["bytes"]) for ev in events for e in ev.logprobs)
    assert final.finish_reason == "length"
    # Cut by the length limit, the last character may be incomplete: the text ends where the bytes do.
    complete = spelled.decode("utf-8", errors="ignore")
    assert complete == final.text.rstrip("\ufffd") and any(ord(c) > 0x2E80 for c in final.text)
    assert len(spelled) - len(complete.encode()) < 4


@pytest.mark.model
def test_penalties_and_logit_bias_equal_a_reference_loop(llm: Any) -> None:
    prompt = llm.encode_prompt(MSGS)
    plain = reference_greedy(llm, prompt, 30)
    bias = {plain[0]: -100.0, plain[3]: 3.0}
    for presence, frequency in ((0.0, 1.2), (1.5, 0.0), (0.6, 0.8)):
        ref = reference_greedy(llm, prompt, 30, presence=presence, frequency=frequency, bias=bias)
        final = llm.generate(MSGS, max_new_tokens=30, presence_penalty=presence, frequency_penalty=frequency,
                             logit_bias={str(k): v for k, v in bias.items()})
        got = [t for t in llm._finished[final.stream_id].answer_ids]
        assert got == ref, (presence, frequency)
    assert got != plain
    # In a batch with other streams (greedy and sampled), the penalised rows are still exact.
    others = [llm.stream(MSGS, max_new_tokens=30, temperature=0.9, seed=i) for i in range(2)]
    again = llm.stream(MSGS, max_new_tokens=30, presence_penalty=0.6, frequency_penalty=0.8,
                       logit_bias={str(k): v for k, v in bias.items()})
    final = again.wait()
    for s in others:
        s.wait()
    assert llm._finished[final.stream_id].answer_ids == ref


@pytest.mark.model
def test_min_p_one_at_high_temperature_is_greedy(llm: Any) -> None:
    greedy = llm.generate(MSGS, max_new_tokens=24, temperature=0).text
    assert llm.generate(MSGS, max_new_tokens=24, temperature=1.5, min_p=1.0, seed=3).text == greedy
    assert llm.generate(MSGS, max_new_tokens=24, temperature=1.5, seed=3).text != greedy


@pytest.mark.model
def test_three_choices_share_one_prefill_and_choice_zero_is_the_seeded_stream(llm: Any) -> None:
    steps = llm._batcher.steps
    streams = llm.choices(MSGS, 3, max_new_tokens=16, temperature=1.0, seed=11)
    finals = [s.wait() for s in streams]
    assert len(finals) == 3 and all(f.finish_reason in ("stop", "length") for f in finals)
    assert len({f.text for f in finals}) > 1
    assert finals[0].text == llm.generate(MSGS, max_new_tokens=16, temperature=1.0, seed=11).text
    assert llm._batcher.steps - steps < 3 * 16  # they decoded together
    # Greedy choices are the greedy answer, each.
    greedy = llm.generate(MSGS, max_new_tokens=12).text
    assert [s.wait().text for s in llm.choices(MSGS, 3, max_new_tokens=12)] == [greedy] * 3


@pytest.mark.model
def test_branching_from_an_alternative_is_exact(llm: Any) -> None:
    prompt = llm.encode_prompt(MSGS)
    final = llm.generate(MSGS, max_new_tokens=20, top_logprobs=3)
    request = llm._finished[final.stream_id]
    k = 4
    kept_ids = request.answer_ids[:k]
    offset = len(llm.tokenizer.decode(kept_ids))
    alt = request.answer_logprobs[k]["top_logprobs"][1]["token_id"]
    expected = kept_ids + reference_greedy(llm, prompt + kept_ids, 16, first=alt)
    revised = llm.revise(final, offset, token_id=alt, max_new_tokens=16)
    events = list(revised)
    got = llm._finished[events[-1].stream_id].answer_ids
    assert len(got) == 16 and got == expected[: len(got)]  # max_new_tokens counts the kept tokens too
    assert events[0].logprobs is not None and len(events[0].logprobs) == k  # the kept part keeps its logprobs
    # The same on a running stream: rewind(offset, token_id=alt).
    s = llm.stream(MSGS, max_new_tokens=60, top_logprobs=3)
    seen = ""
    for ev in s:
        seen = seen[: ev.offset] + ev.delta
        if len(seen) > offset + 8 and ev.revision == 0:
            s.rewind(offset, token_id=alt)
        if ev.is_final:
            break
    req = llm._finished[s.stream_id]
    assert req.answer_ids[: k + 1] == kept_ids + [alt]
    assert req.answer_ids == (kept_ids + reference_greedy(llm, prompt + kept_ids, 60 - k, first=alt))[: len(req.answer_ids)]
    with pytest.raises(ms.InvalidArgumentError):
        llm.revise(final, offset, token_id=10**9)


@pytest.mark.model
def test_score_equals_the_prompt_forward(llm: Any) -> None:
    text = "The capital of France is Paris."
    ids = llm.encode_prompt(text, chat=False)
    entries = llm.score(text, chat=False, top_logprobs=2)
    ref = forward_logprobs(llm, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        assert abs(entries[i]["logprob"] - ref[i - 1, ids[i]].item()) < 2e-3


@pytest.fixture(scope="module")
def srv(llm: Any):  # type: ignore[no-untyped-def]
    with make_server(llm) as s:
        yield s


@pytest.mark.model
def test_openai_sdk_chat_logprobs_streamed_and_not(srv: Any, llm: Any) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="unused")
    r = client.chat.completions.create(model="default", messages=MSGS, max_tokens=10, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)
    ref = forward_logprobs(llm, llm.encode_prompt(MSGS) + llm.tokenizer(r.choices[0].message.content,
                                                                          add_special_tokens=False)["input_ids"])
    assert abs(content[0].logprob - ref[len(llm.encode_prompt(MSGS)) - 1].max().item()) < 2e-3
    streamed = []
    for chunk in client.chat.completions.create(model="default", messages=MSGS, max_tokens=10, logprobs=True,
                                                top_logprobs=3, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed += [(t.token, round(t.logprob, 3)) for t in c.logprobs.content]
    assert streamed == [(t.token, round(t.logprob, 3)) for t in content]
    # n=3 streams three interleaved choices.
    by_index: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="default", messages=MSGS, max_tokens=8, n=3, temperature=1.0,
                                                seed=5, stream=True):
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert sorted(by_index) == [0, 1, 2] and all(by_index.values())
    r = client.chat.completions.create(model="default", messages=MSGS, max_tokens=8, n=3, temperature=1.0, seed=5)
    assert [c.message.content for c in r.choices] == [by_index[i] for i in range(3)]


@pytest.mark.model
def test_openai_sdk_completions_echo_scores_the_prompt(srv: Any, llm: Any) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="unused")
    text = "The capital of France is Paris"
    r = client.completions.create(model="default", prompt=text, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    ids = llm.encode_prompt(text, chat=False)
    ref = forward_logprobs(llm, ids)
    assert r.choices[0].text == text and lp.token_logprobs[0] is None and "".join(lp.tokens) == text
    assert all(abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 2e-3 for i in range(1, len(ids)))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    # Generation, a list of prompts, n, stop, seed; streamed and not.
    r = client.completions.create(model="default", prompt=["One, two,", "Monday, Tuesday,"], max_tokens=6, n=2,
                                  temperature=0.8, seed=1, logprobs=2, stop=["\n"])
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in r.choices)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="default", prompt="One, two,", max_tokens=6, stream=True) if ch.choices)
    assert streamed == client.completions.create(model="default", prompt="One, two,", max_tokens=6).choices[0].text


@pytest.mark.model
def test_langchain_chat_openai_streams_logprobs(srv: Any) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model="default", max_tokens=8,
                                       logprobs=True, top_logprobs=2, temperature=0)
    chunks = list(chat.stream("Name three colours."))
    logprobs = [t for c in chunks for t in (c.response_metadata.get("logprobs") or {}).get("content", [])]
    text = "".join(c.content for c in chunks)
    assert text and "".join(t["token"] for t in logprobs) == text
    assert all(t["logprob"] <= 0 and not math.isnan(t["logprob"]) for t in logprobs)
