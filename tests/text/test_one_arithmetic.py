"""One arithmetic on the default model (``ms.load_text_model()``: int4 on the native kernels).

A token's logits do not depend on how it reached the model: decoded one at a time, prefilled in a
chunk, re-prefilled after an edit, replayed on another replica, or scored. These are the promises
users get on the default; each path is compared with another, bit for bit where both run the same
kernels. (Ray failover on the default model: test_ray_serve.py; beams against transformers' beam
search: test_beams_browser.py and test_text_beams.py; rewind and steer-then-resume: test_text_edits.py.)
"""

from __future__ import annotations

import pytest
import torch

import multistream as ms

pytestmark = pytest.mark.model

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a compiler does in two sentences.",
    "List three fruits and their colours.",
    "What is the capital of France? Answer in one sentence, then add a fact about it.",
]


def _answer(llm, prompt: str, n: int = 40):
    events = list(llm.stream([{"role": "user", "content": prompt}], max_new_tokens=n, temperature=0.0,
                             logprobs=True))
    entries = [e for ev in events for e in ev.logprobs or []]
    return events[-1], entries


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_a_streams_logprobs_are_one_forward_of_the_whole_sequence(llm, prompt: str) -> None:
    final, entries = _answer(llm, prompt)
    prompt_ids = llm.encode_prompt([{"role": "user", "content": prompt}])
    answer = [e["token_id"] for e in entries]
    with torch.no_grad():
        logits = llm.model(torch.tensor([prompt_ids + answer])).logits[0, len(prompt_ids) - 1 : -1]
    reference = logits.float().log_softmax(-1)
    assert reference.argmax(-1).tolist() == answer  # greedy: the same choice at every step
    got = torch.tensor([e["logprob"] for e in entries])
    expected = reference.gather(1, torch.tensor(answer)[:, None])[:, 0]
    assert float((got - expected).abs().max()) <= 1e-6


def test_score_of_prompt_and_answer_equals_the_streams_logprobs(llm) -> None:
    final, entries = _answer(llm, PROMPTS[2])
    prompt_ids = llm.encode_prompt([{"role": "user", "content": PROMPTS[2]}])
    text = llm.tokenizer.decode(prompt_ids) + final.text
    scored = llm.score(text, chat=False)
    ids = [e["token_id"] for e in scored[1:]]
    start = len(prompt_ids) - 1  # scored[0] is None: nothing predicts the first token
    assert ids[start : start + len(entries)] == [e["token_id"] for e in entries]
    for stream_entry, score_entry in zip(entries, scored[1 + start :]):
        assert abs(stream_entry["logprob"] - score_entry["logprob"]) <= 1e-6


@pytest.mark.parametrize("prompt", PROMPTS)
def test_revise_without_a_change_gives_the_original_answer(llm, prompt: str) -> None:
    """A re-prefill of decoded tokens lands on the logits they were decoded with: greedy text is
    regenerated exactly from any cut."""
    final = llm.generate([{"role": "user", "content": prompt}], max_new_tokens=48, temperature=0.0)
    for offset in (len(final.text) // 3, len(final.text) // 2):
        again = llm.revise(final, offset).wait()
        assert again.text == final.text, (offset, again.text, final.text)


def test_a_prompt_prefilled_in_chunks_streams_what_one_prefill_streams() -> None:
    """prefill_budget cuts a long prompt into chunks between decode steps: the same tokens, the same
    logprobs, as a prompt prefilled in one forward."""
    chunked = ms.load_text_model(prefill_budget=7)
    whole = ms.load_text_model()
    try:
        prompt = [{"role": "user", "content": PROMPTS[1] + " Use simple words for a child of ten."}]
        a = list(chunked.stream(prompt, max_new_tokens=24, temperature=0.0, logprobs=True))
        b = list(whole.stream(prompt, max_new_tokens=24, temperature=0.0, logprobs=True))
        assert a[-1].text == b[-1].text
        la = [e["logprob"] for ev in a for e in ev.logprobs or []]
        lb = [e["logprob"] for ev in b for e in ev.logprobs or []]
        assert la == lb
    finally:
        chunked.close()
        whole.close()


def test_int8_activations_are_an_opt_in_that_still_keeps_one_arithmetic() -> None:
    """llama.cpp's int8 rounding (``activations="int8"``): its text drifts from fp32's, but its
    decode and re-prefill still agree."""
    llm = ms.load_text_model(activations="int8")
    try:
        assert llm.quantization.activations == "int8"
        assert "int8 activations" in llm.quantization.describe()
        final = llm.generate([{"role": "user", "content": PROMPTS[0]}], max_new_tokens=32, temperature=0.0)
        assert llm.revise(final, len(final.text) // 2).wait().text == final.text
    finally:
        llm.close()
    with pytest.raises(ms.InvalidArgumentError, match="activations must be 'fp32' or 'int8'"):
        ms.load_text_model(activations="int4")
