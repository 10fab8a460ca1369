"""Weight-only quantization (``load_text_model(quantize=...)``): the layers, the fallbacks, batch
parity of each mode against its own ``generate``, and quality against fp32.

The layer and fallback tests use random weights (milliseconds); the ones marked ``model`` load the
embedded SmolLM2-135M once per mode. Quality figures on the full 32 prompts are printed by
``python benchmarks/cpu_decode.py --quality``; here a smaller set keeps the test near a minute.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import multistream as ms
from multistream.errors import InvalidArgumentError
from multistream.testing._quality import agreement, greedy_tokens, perplexity
from multistream.text._accel.block_layers import Q4Linear, Q8Linear
from multistream.text._accel.kernels import native_kernels
from multistream.text._accel.quantize import (
    QUANTIZED_LAYERS,
    Int4Linear,
    Int8Linear,
    check_quantize,
    kernel_problem,
    mode_problem,
    quantize_model,
)
from multistream.text._loading import AUTO_QUANTIZE_EMBEDDED_CPU, resolve_quantize

from repo_paths import ROOT

DATA = ROOT / "tests" / "data"
CPU = torch.device("cpu")
# On a CPU with a C compiler the modes run on the native block kernels; ATen's otherwise.
BLOCK = native_kernels() is not None
needs_block = pytest.mark.skipif(not BLOCK, reason="the native block kernels did not build here (no C compiler)")


def _paragraphs() -> list[str]:
    return [p.strip() for p in (DATA / "paragraphs.txt").read_text().split("\n\n") if p.strip()]


def _prompts() -> list[str]:
    return [line for line in (DATA / "quality_prompts.txt").read_text().splitlines() if line.strip()]


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    return layer


# -- the option --------------------------------------------------------------------------------


def test_quantize_values_are_checked() -> None:
    assert [check_quantize(v) for v in (None, "none", "INT8", "int4", "auto")] == [None, None, "int8", "int4", "auto"]
    with pytest.raises(InvalidArgumentError, match="quantize must be None, 'int8', 'int4' or 'auto'"):
        check_quantize("int3")
    with pytest.raises(InvalidArgumentError):
        check_quantize(8)


def test_auto_quantizes_only_the_embedded_model_on_a_cpu() -> None:
    assert resolve_quantize("auto", embedded=True, device=CPU) == AUTO_QUANTIZE_EMBEDDED_CPU
    assert resolve_quantize("auto", embedded=False, device=CPU) is None
    assert resolve_quantize("auto", embedded=True, device=torch.device("cuda")) is None
    assert resolve_quantize("int8", embedded=False, device=torch.device("cuda")) == "int8"
    assert resolve_quantize(None, embedded=True, device=CPU) is None


# -- the layers --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_matches_its_dequantized_weight(dtype: torch.dtype) -> None:
    linear = _linear(48, 64, bias=True).to(dtype)
    layer = Int8Linear.from_linear(linear, torch.bfloat16)
    x = torch.randn(2, 3, 64).to(dtype)
    y = layer(x)
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    reference = x.to(torch.bfloat16).float() @ layer.dequantized().t() + linear.bias.float()
    assert torch.allclose(y.float(), reference, atol=0.02, rtol=0.02)
    # ...and the dequantized weight is the original to within the int8 grid.
    assert (layer.dequantized() - linear.weight.float()).abs().max() <= linear.weight.float().abs().max() / 127 * 0.51


def test_int4_layer_matches_its_dequantized_weight() -> None:
    linear = _linear(32, 64, bias=True)
    layer = Int4Linear.from_linear(linear)
    x = torch.randn(5, 64)
    weight = Int4Linear.dequantize(*Int4Linear.quantize_weight(linear.weight))
    reference = x.to(torch.bfloat16).float() @ weight.t() + linear.bias
    assert torch.allclose(layer(x), reference, atol=0.02, rtol=0.02)
    assert float((weight - linear.weight.detach()).norm() / linear.weight.detach().norm()) < 0.1


def test_fused_int4_projections_share_their_rows_in_cudas_packed_layout_too() -> None:
    """CUDA's tinygemm layout packs 8 output rows per leading index of ``packed`` (the CPU's, one),
    so a projection's share of the fused q/k/v buffer is rows ``start/8 .. end/8`` there. Taking
    ``start .. end`` gave q_proj the whole fused buffer and int4 on CUDA failed at its first forward
    ("Expected qScaleAndZeros.size(1) == n"; seen on an H200). Built on the meta device, whose
    shapes are CUDA's (ATen's meta functions), so it runs without a GPU."""
    from multistream.text._accel.quantize import _concat, _share

    widths = (2048, 512, 512)
    for device, rows_per_index in (("cpu", 1), ("meta", 8)):
        layers = [Int4Linear.from_linear(torch.nn.Linear(2048, n, bias=False, device=device)) for n in widths]
        fused = _concat(layers)
        assert fused is not None and fused.packed.shape[0] * rows_per_index == sum(widths)
        _share(fused, layers)
        for layer, n in zip(layers, widths):
            assert layer.packed.shape[0] * rows_per_index == n == layer.scales_and_zeros.shape[1], device


def test_int4_reproduces_weights_that_already_lie_on_a_4_bit_grid() -> None:
    """The embedded model's layers come from GGUF Q4_1 blocks (w = d * q + m, 32 weights a
    block): int4 in groups of 32 stores them again up to the bf16 rounding of d and m."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (32, 4, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 maps each block's min and max to 0 and 15
    d, m = torch.rand(32, 4, 1) * 0.01 + 0.001, torch.randn(32, 4, 1) * 0.05
    weight = (q * d + m).reshape(32, 128)
    back = Int4Linear.dequantize(*Int4Linear.quantize_weight(weight))
    assert float((back - weight).norm() / weight.norm()) < 0.01


def test_quantize_model_replaces_linears_and_keeps_odd_shapes() -> None:
    net = torch.nn.Sequential(_linear(32, 64), torch.nn.ReLU(), _linear(7, 32), _linear(16, 20))
    x = torch.randn(3, 64)
    report = quantize_model(net, "int4", block_kernels=False)
    # ATen: 64->32 takes int4; 32->7 cannot (outputs not a multiple of 16) and gets int8; 20->16 fits neither.
    assert [type(m).__name__ for m in net] == ["Int4Linear", "ReLU", "Int8Linear", "Linear"]
    assert report.by_kind == {"int4": 1, "int8": 1, "kept": 1} and report.mode == "int4"
    assert report.kernels == {"int4": 1, "int8": 1}
    assert net[2](net[1](net[0](x))).shape == (3, 7)
    assert "int4" in report.describe() and "ATen kernels" in report.describe()


@needs_block
def test_the_block_kernels_take_any_output_width_and_whole_input_blocks() -> None:
    net = torch.nn.Sequential(_linear(32, 64), torch.nn.ReLU(), _linear(7, 32), _linear(16, 20))
    report = quantize_model(net, "int4")
    # 32->7 is Q4_1 too (any number of outputs); 20->16 has no whole block of inputs and stays.
    assert [type(m).__name__ for m in net] == ["Q4Linear", "ReLU", "Q4Linear", "Linear"]
    assert report.by_kind == {"int4": 2, "kept": 1} and report.kernels == {"q4": 2}
    assert "block kernels, fp32 activations" in report.describe()
    x = torch.randn(3, 64)
    reference = x @ net[0].dequantized().t()
    assert torch.allclose(net[0](x), reference, atol=0.01 * float(reference.abs().max()))


def test_a_tied_lm_head_gets_its_own_quantized_copy_and_the_embedding_stays_exact() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    embedding = model.get_input_embeddings().weight.detach().clone()
    ids = torch.tensor([[1, 5, 9, 20]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = quantize_model(model, "int8")
    assert isinstance(model.lm_head, Q8Linear if BLOCK else Int8Linear)
    assert report.by_kind == {"int8": 15}  # 2 x 7 + the head
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before.argmax(-1), after.argmax(-1))


# -- the fast decode step (quantized Llama-family models) -----------------------------------------

TINY_PROMPTS = ["Hi", "Tell me about cats and why they purr so much.",
                "Write a short poem about the sea at night, with rhymes.", "What is two plus two?"]


def _tiny_llama(tokenizer=None, layers: int = 2, seed: int = 0):
    """A tiny random Llama (``tokenizer``: its vocabulary and special tokens, else 512 ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    specials = {} if tokenizer is None else {"eos_token_id": tokenizer.eos_token_id,
                                             "bos_token_id": tokenizer.bos_token_id}
    # Projections of 64 rows or more (k/v: 2 heads of 32): ATen's int4 packing on AVX-512 CPUs
    # interleaves rows in blocks of 64, so smaller ones would not fuse there and the ATen tests
    # would test another model than on AVX2.
    config = LlamaConfig(vocab_size=512 if tokenizer is None else len(tokenizer), hidden_size=128,
                         intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, **specials)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["block", "aten"])
def tiny_quantized(text_tokenizer, request: pytest.FixtureRequest):
    """A tiny random Llama, quantized like load_text_model does (int4, fused projections, row
    attention): on the native block kernels (its layers then decode natively) and on ATen's."""
    from multistream.text._accel.row_attention import uses_row_attention

    block = request.param == "block"
    if block and not BLOCK:
        pytest.skip("the native block kernels did not build here (no C compiler)")
    model = _tiny_llama(text_tokenizer, layers=4)
    report = quantize_model(model, "int4", block_kernels=block)
    assert uses_row_attention(model) and report.fused == 8
    assert report.native_layers == (4 if block else 0)
    llm = ms.TextModel(model, text_tokenizer, name=f"tiny-int4-{request.param}", max_batch=4)
    yield llm
    llm.close()


def test_quantized_layers_are_kept_and_rebuilt_from_the_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from multistream.text._loading import _quantize

    probe = torch.randint(0, 512, (1, 7))
    first = _tiny_llama()
    with caplog.at_level(logging.INFO, logger="multistream"):
        report = _quantize(first, "int4", "int4", CPU, tmp_path)
    [stored] = list(tmp_path.glob("quantized-int4-*.pt"))
    assert report.mode == "int4" and report.states == {}  # the report keeps no second copy of the weights
    assert "(quantized in" in caplog.text

    caplog.clear()
    second = _tiny_llama()  # the same weights, loaded again
    calls = []  # quantize_weight on the model's own weights (the kernel probes quantize made-up ones)
    own = {p.data_ptr() for p in second.parameters()}
    for cls in (Int4Linear, Int8Linear, Q4Linear, Q8Linear):
        if hasattr(cls, "quantize_weight"):
            real = cls.quantize_weight
            monkeypatch.setattr(cls, "quantize_weight", staticmethod(
                lambda w, *a, real=real, **k: calls.append(w.data_ptr()) or real(w, *a, **k)))
    with caplog.at_level(logging.INFO, logger="multistream"):
        again = _quantize(second, "int4", "int4", CPU, tmp_path)
    monkeypatch.undo()
    assert own.isdisjoint(calls) and "from the quantized-weights cache" in caplog.text
    assert again.by_kind == report.by_kind and again.fused == report.fused
    with torch.no_grad():
        assert torch.equal(first(probe).logits, second(probe).logits)

    # A torn file is ignored with a warning, quantized again and rewritten.
    stored.write_bytes(b"not a torch file")
    third = _tiny_llama()
    with caplog.at_level(logging.WARNING, logger="multistream"):
        _quantize(third, "int4", "int4", CPU, tmp_path)
    assert "ignoring the quantized-weights cache" in caplog.text
    with torch.no_grad():
        assert torch.equal(first(probe).logits, third(probe).logits)
    assert torch.load(stored, weights_only=True).keys() == report_keys(first)


def report_keys(model: torch.nn.Module) -> set[str]:
    """Every quantized layer's name, the fused q/k/v and gate/up layers included (a warm load
    rebuilds those from the cache instead of concatenating and probing them again)."""
    return {name for name, m in model.named_modules() if isinstance(m, QUANTIZED_LAYERS)}


def _together(llm, prompts: list[str], **kwargs: object) -> list:
    streams = [llm.stream(p, **kwargs) for p in prompts]
    finals: list = [None] * len(streams)
    threads = [threading.Thread(target=lambda i=i: finals.__setitem__(i, streams[i].wait())) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return finals


def test_the_fast_decode_step_equals_transformers_forward_bit_for_bit(tiny_quantized) -> None:
    """Past the buffers' spare columns (GROW), alone and in a batch of left-padded rows."""
    from multistream.text._accel.fast_decode import GROW

    n = GROW + 10
    alone = [tiny_quantized.generate(p, max_new_tokens=n) for p in TINY_PROMPTS]
    assert tiny_quantized._batcher._fast is not None
    ids = tiny_quantized.encode_prompt(TINY_PROMPTS[1])
    out = tiny_quantized.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    assert alone[1].text == tiny_quantized.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    together = _together(tiny_quantized, TINY_PROMPTS, max_new_tokens=n)
    assert [f.text for f in together] == [a.text for a in alone]


def test_the_fast_decode_step_keeps_its_prefill_points(tiny_quantized, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request arriving during a fast decode step is prefilled between two of its layers (its
    prompt's start from the prefix cache, the rest there)."""
    batcher = tiny_quantized._batcher
    tiny_quantized.generate("Hi", max_new_tokens=2)  # the fast step is chosen at the first decode
    fast = batcher._fast
    arrived: dict = {}
    name = "step_ragged" if fast.ragged else "step"  # the native stack's step takes lookahead's ragged rows
    step = getattr(fast, name)

    def arriving(*args: object, **kwargs: object) -> torch.Tensor:
        if not arrived and batcher.steps >= 3:
            arrived["stream"] = tiny_quantized.stream(TINY_PROMPTS[3], max_new_tokens=5)
        return step(*args, **kwargs)

    monkeypatch.setattr(fast, name, arriving)
    before = batcher.prefills_inside_steps
    running = tiny_quantized.stream(TINY_PROMPTS[1], max_new_tokens=12)
    final = running.wait()
    joined = arrived["stream"].wait()
    monkeypatch.undo()
    assert batcher.prefills_inside_steps == before + 1
    # On the native layers it began like the prompts before it (the chat template): only its rest
    # ran at the point. ATen's int4 layers keep no prefix cache: a prompt prefilled in pieces rounds
    # differently there from one forward of it.
    native = tiny_quantized.name.endswith("block")
    assert (batcher.prefix_cache is not None) == native
    assert ("cached_prompt_tokens" in joined.metrics) == native
    assert final.text == tiny_quantized.generate(TINY_PROMPTS[1], max_new_tokens=12).text
    assert joined.text == tiny_quantized.generate(TINY_PROMPTS[3], max_new_tokens=5).text


def test_steer_and_rewind_on_the_fast_decode_step(tiny_quantized) -> None:
    """Edits reshape the cache between steps (select, crop): the buffers follow."""
    s = tiny_quantized.stream(TINY_PROMPTS[2], max_new_tokens=30)
    events = []
    for ev in s:
        events.append(ev)
        if len(events) == 5:
            s.rewind(0)
    assert events[-1].is_final and events[-1].usage["completion_tokens"] >= 1
    assert events[-1].text == tiny_quantized.generate(TINY_PROMPTS[2], max_new_tokens=30).text


# -- kernels missing: fallback or a clear error ------------------------------------------------


def _break(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    def missing(*args: object, **kwargs: object) -> torch.Tensor:
        raise NotImplementedError(f"Could not run 'aten::{op}' with arguments from the 'CPU' backend")

    monkeypatch.setattr(torch.ops.aten, op, missing)


def test_a_missing_kernel_is_reported_not_crashed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernel_problem("int4", CPU) is None and kernel_problem("int8", CPU) is None
    _break(monkeypatch, "_weight_int4pack_mm_for_cpu")
    assert "NotImplementedError" in (kernel_problem("int4", CPU) or "")
    with pytest.raises(InvalidArgumentError, match=r"quantize='int4' cannot run on cpu here .* use quantize='int8'"):
        quantize_model(torch.nn.Sequential(_linear(32, 64)), "int4", block_kernels=False)
    # The block kernels still serve int4 where they built.
    assert (mode_problem("int4", CPU) is None) == BLOCK


def test_without_the_block_kernels_the_modes_take_atens(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler (the kernels did not build): quantized layers are ATen's, nothing decodes natively."""
    monkeypatch.setattr("multistream.text._accel.quantize.native_kernels", lambda: None)
    monkeypatch.setattr("multistream.text._accel.native_layers.native_kernels", lambda: None)
    model = _tiny_llama(layers=2)
    report = quantize_model(model, "int4")
    assert report.kernels == {"int4": 14, "int8": 1} and report.native_layers == 0
    assert isinstance(model.lm_head, Int8Linear)


def test_a_kernel_with_wrong_numbers_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda x, w, s: real(x, w, s) * 2)
    assert "off by" in (kernel_problem("int8", CPU) or "")


@pytest.mark.model
@pytest.mark.parametrize(("auto", "broken", "expected"), [
    ("int4", "_weight_int4pack_mm_for_cpu", "int8"),
    ("int8", "_weight_int8pack_mm", None),
])
def test_auto_falls_back_with_one_log_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                           auto: str, broken: str, expected: str | None) -> None:
    monkeypatch.setattr("multistream.text._loading.AUTO_QUANTIZE_EMBEDDED_CPU", auto)
    monkeypatch.setattr("multistream.text._accel.quantize.native_kernels", lambda: None)  # ATen's kernels only
    _break(monkeypatch, broken)
    with caplog.at_level(logging.WARNING, logger="multistream"):
        llm = ms.load_text_model(quantize="auto", compile=False)
    try:
        lines = [r.getMessage() for r in caplog.records if "quantize='auto'" in r.getMessage()]
        assert len(lines) == 1, lines
        assert broken.split("_")[2] in lines[0] or "int" in lines[0]
        assert ("using int8" if expected else "using the weights as loaded") in lines[0]
        assert llm.quantization.mode == expected and llm.quantization.fallback
        assert llm.generate("Say hi", max_new_tokens=4).usage["completion_tokens"] >= 1
    finally:
        llm.close()
    with pytest.raises(InvalidArgumentError, match=f"quantize='{auto}' cannot run on cpu"):
        ms.load_text_model(quantize=auto)


# -- each mode on the embedded model: streams, batches exactly against its own generate -----------

PARITY_PROMPTS = [
    "Hi",
    "Tell me about cats and why they purr so much.",
    "Write a short poem about the sea at night, with rhymes.",
    "What is two plus two?",
]


@pytest.fixture(scope="module", params=[None, "int8", "int4"], ids=["fp32", "int8", "int4"])
def quantized_llm(request: pytest.FixtureRequest):
    # compile=False: the eager step is bit for bit transformers' forward, which the test checks too.
    llm = ms.load_text_model(quantize=request.param, max_batch=4, compile=False)
    yield llm
    llm.close()


@pytest.mark.model
def test_each_mode_loads_and_reports_itself(quantized_llm) -> None:
    report = quantized_llm.quantization
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    kinds = {type(layer.get_submodule(n)).__name__ for layer in quantized_llm.model.model.layers for n in names}
    if report.mode is None:
        assert kinds == {"Linear"} and report.fused == 0
    else:
        assert report.requested == report.mode and report.bytes_after < report.bytes_before / 2
        bits = report.mode[-1]
        assert kinds == {f"Q{bits}Linear" if BLOCK else f"Int{bits}Linear"}
        # the head stays 8-bit in both modes
        assert isinstance(quantized_llm.model.lm_head, Q8Linear if BLOCK else Int8Linear)
        assert report.fused == 60  # q/k/v and gate/up of each of the 30 layers, one call each
        assert report.native_layers == (30 if BLOCK else 0)  # each decodes a token in two native calls


@pytest.mark.model
def test_each_mode_batches_exactly_like_its_own_generate(quantized_llm) -> None:
    alone = [quantized_llm.generate(p, max_new_tokens=20) for p in PARITY_PROMPTS]
    finals = _together(quantized_llm, PARITY_PROMPTS, max_new_tokens=20)  # one batch of 4 rows
    assert [f.text for f in finals] == [a.text for a in alone]
    assert [f.usage for f in finals] == [a.usage for a in alone]
    # ...and the stream alone is transformers' own greedy generate on the same (quantized) model.
    ids = quantized_llm.encode_prompt(PARITY_PROMPTS[2])
    out = quantized_llm.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert alone[2].text == quantized_llm.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.mark.model
def test_the_default_is_int4_on_the_eager_fast_step(text_model) -> None:
    """load_text_model() on a CPU: int4 weights (quantize='auto'), the eager fast decode step (no
    compile: it costs ~50 s a load), and each stream in a batch equals its output alone."""
    assert text_model.quantization.requested == "auto"
    assert text_model.quantization.mode == AUTO_QUANTIZE_EMBEDDED_CPU == "int4"
    assert text_model.compiled is None
    alone = [text_model.generate(p, max_new_tokens=24) for p in PARITY_PROMPTS]
    assert text_model._batcher._fast is not None
    together = _together(text_model, PARITY_PROMPTS, max_new_tokens=24)
    assert [f.text for f in together] == [a.text for a in alone]
    assert [f.usage for f in together] == [a.usage for a in alone]


@pytest.mark.model
def test_logprobs_on_the_default_model_are_its_own_generate_logits(text_model) -> None:
    """Token confidence on the default (int4) model: each step's logprobs are the log-softmax of
    the logits transformers' own generate computes on the same quantized model, step by step."""
    prompt = PARITY_PROMPTS[1]
    events = list(text_model.stream(prompt, max_new_tokens=12, logprobs=True, top_logprobs=3))
    entries = [e for ev in events for e in ev.logprobs or []]
    ids = text_model.encode_prompt(prompt)
    out = text_model.model.generate(torch.tensor([ids]), max_new_tokens=len(entries), do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert [e["token_id"] for e in entries] == out.sequences[0, len(ids):].tolist()
    for entry, logits in zip(entries, out.logits):
        reference = logits[0].float().log_softmax(-1)
        assert abs(entry["logprob"] - reference[entry["token_id"]].item()) < 1e-4
        assert [a["token_id"] for a in entry["top_logprobs"]] == reference.topk(3).indices.tolist()


def test_the_compiled_step_batches_exactly_and_computes_what_the_eager_one_does(text_tokenizer) -> None:
    """compile=True's step on a tiny quantized Llama: a stream in a batch equals it alone (each
    row's arithmetic is its own), and its logits are the eager step's to rounding."""
    import shutil

    from multistream.text._accel.compiled_decode import compile_decode

    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        pytest.skip("torch.compile needs a C++ compiler on a CPU; this machine has none")
    model = _tiny_llama(text_tokenizer, layers=2, seed=1)
    report = quantize_model(model, "int4", block_kernels=False)  # the compiled step is ATen's kernels'
    if report.fused < 4:
        pytest.skip("ATen's int4 weights do not concatenate on this CPU (its packing interleaves rows), so the "
                    "projections are not fused and the compiled step does not apply")
    llm = ms.TextModel(model, text_tokenizer, name="tiny-int4-compiled", max_batch=4)
    def second_token_logprobs() -> list[dict[int, float]]:
        # The second token is the first decode step's (the first comes from the prefill).
        out = []
        for p in TINY_PROMPTS:
            events = list(llm.stream(p, max_new_tokens=2, logprobs=True, top_logprobs=5))
            second = [e for ev in events for e in (ev.logprobs or [])][1]
            out.append({a["token_id"]: a["logprob"] for a in second["top_logprobs"]})
        return out

    try:
        eager = second_token_logprobs()
        report = compile_decode(model)
        assert report.compiled, report.error
        alone = [llm.generate(p, max_new_tokens=12) for p in TINY_PROMPTS]
        together = _together(llm, TINY_PROMPTS, max_new_tokens=12)
        assert [f.text for f in together] == [a.text for a in alone]
        for before, after in zip(eager, second_token_logprobs()):
            assert abs(max(before.values()) - max(after.values())) < 0.05
            assert all(abs(before[t] - after[t]) < 0.05 for t in before.keys() & after.keys())
    finally:
        llm.close()


def test_a_compile_failure_leaves_the_eager_step_with_one_log_line(tiny_quantized, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from multistream.text._accel.compiled_decode import compile_decode
    from multistream.text._accel.fast_decode import compiled_decode

    if tiny_quantized.name.endswith("block"):
        pytest.skip("the native layers leave compile_decode nothing to compile (tested below)")

    def no_compiler(*args: object, **kwargs: object) -> object:
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger="multistream"):
        report = compile_decode(tiny_quantized.model)
    assert not report.compiled and "cc is not found" in report.error
    assert [r.getMessage() for r in caplog.records] == [
        "compiling the decode step failed (RuntimeError: Compiler: cc is not found); decoding eagerly"]
    assert compiled_decode(tiny_quantized.model) is None
    assert tiny_quantized.generate("Hi", max_new_tokens=3).usage["completion_tokens"] == 3


def test_compile_is_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="compile must be True or False"):
        ms.load_text_model(compile="yes")


@pytest.mark.model
@needs_block
def test_compile_on_the_native_layers_is_skipped_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="multistream"):
        llm = ms.load_text_model(compile=True)
    try:
        lines = [r.getMessage() for r in caplog.records if "compile=True" in r.getMessage()]
        assert lines == ["compile=True: the native decoder layers already run this model's decode step; not compiling"]
        assert llm.compiled is not None and not llm.compiled.compiled and "native" in llm.compiled.error
        assert llm.generate("Hi", max_new_tokens=3).usage["completion_tokens"] == 3
    finally:
        llm.close()


@pytest.mark.model
def test_compile_where_it_cannot_apply_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="multistream"):
        llm = ms.load_text_model(quantize=None, compile=True)
    llm.close()
    assert llm.compiled is None
    assert [r.getMessage() for r in caplog.records if "compile" in r.getMessage()] == [
        "compile=True: this model's decode step cannot be compiled (it needs quantize= and a Llama-family model "
        "on a CPU); decoding eagerly"]


# -- quality against fp32 -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_reference():
    llm = ms.load_text_model(quantize=None)
    prompts = _prompts()[:8]
    encoded = [llm.encode_prompt(p) for p in prompts]
    tokens = [greedy_tokens(llm.model, ids, 32, llm.eos_token_ids) for ids in encoded]
    ppl = perplexity(llm.model, llm.tokenizer, _paragraphs())
    llm.close()
    return encoded, tokens, ppl


# Measured on the full 32 prompts (benchmarks/cpu_decode.py --quality); the bounds leave room for
# other CPUs' rounding. bf16 weights, for scale, share 0.7 of the fp32 greedy prefix.
MIN_AGREEMENT = {"int8": 0.3, "int4": 0.45}


@pytest.mark.model
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quality_holds_against_fp32(fp32_reference, mode: str) -> None:
    encoded, reference, reference_ppl = fp32_reference
    llm = ms.load_text_model(quantize=mode, compile=False)  # (greedy_tokens runs the model's own forward)
    try:
        tokens = [greedy_tokens(llm.model, ids, 32, llm.eos_token_ids) for ids in encoded]
        ppl = perplexity(llm.model, llm.tokenizer, _paragraphs())
    finally:
        llm.close()
    shared = sum(agreement(r, t) for r, t in zip(reference, tokens)) / len(reference)
    print(f"{mode}: greedy agreement {shared:.2f}, perplexity {ppl:.3f} vs fp32 {reference_ppl:.3f}")
    assert shared >= MIN_AGREEMENT[mode]
    assert abs(ppl / reference_ppl - 1) <= (0.03 if mode == AUTO_QUANTIZE_EMBEDDED_CPU else 0.05)


def test_a_warm_load_trusts_the_cache_instead_of_scanning_and_probing(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A load from the quantized-weights cache neither scans each weight for the kernels' range
    (``_fits``: a pass over every fp32 matrix) nor concatenates and probes the fused layers again."""
    from multistream.text._accel import quantize as q
    from multistream.text._loading import _quantize

    probe = torch.randint(0, 512, (1, 7))
    first = _tiny_llama(layers=2)
    _quantize(first, "int4", "int4", CPU, tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(q, "_fits", lambda *a, real=q._fits: calls.append("fits") or real(*a))
    monkeypatch.setattr(q, "_probed_concat", lambda *a, real=q._probed_concat: calls.append("concat") or real(*a))
    second = _tiny_llama(layers=2)
    again = _quantize(second, "int4", "int4", CPU, tmp_path)
    assert calls == [] and again.fused == 4 and again.layers == 15
    with torch.no_grad():
        assert torch.equal(first(probe).logits, second(probe).logits)


@pytest.mark.skipif(not BLOCK, reason="the native block kernels did not build here (no C compiler)")
def test_a_cache_of_atens_layers_is_not_taken_where_the_block_kernels_run(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache file holding ATen's layers (written while the block kernels were unavailable) does not
    give a load where they run ATen's layers: those are quantized again, as a fresh load would."""
    from multistream.text._loading import _quantize

    with monkeypatch.context() as patched:
        patched.setattr("multistream.text._accel.quantize.native_kernels", lambda: None)
        patched.setattr("multistream.text._accel.native_layers.native_kernels", lambda: None)
        aten = _quantize(_tiny_llama(layers=2), "int8", "int8", CPU, tmp_path)
    assert aten.kernels == {"int8": 15}
    again = _quantize(_tiny_llama(layers=2), "int8", "int8", CPU, tmp_path)
    assert again.kernels == {"q8": 15} and again.native_layers == 2
