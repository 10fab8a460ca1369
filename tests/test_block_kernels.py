"""The native block-quantized kernels (`_block_kernels.c`), their layers and the native decoder layers.

Random weights (milliseconds), except one test on the embedded model's own weights. Decode
parity of whole models (a stream in a batch equals it alone, and equals the model's own
``generate``) is in ``test_quantize.py``, which runs on these kernels wherever they build.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multistream.text._block_kernels import BLOCK, SOURCE, block_matmul, native_kernels
from multistream.text._block_layers import Q4Linear, Q8Linear
from multistream.text._native_layers import native_layer
from multistream.text._quantize import quantize_model

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="the block kernels did not build here (no C compiler)")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=generator) * 0.05


@pytest.mark.parametrize("layer_class", [Q4Linear, Q8Linear])
def test_a_block_layer_computes_its_dequantized_weight_to_int8_activation_rounding(layer_class) -> None:
    linear = torch.nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_(_weight(40, 96))
    layer = layer_class.from_linear(linear)
    x = torch.randn(5, 96)
    reference = x @ layer.dequantized().t() + linear.bias.detach()
    got = layer(x)
    assert got.shape == (5, 40) and got.dtype == torch.float32
    # Activations are rounded to int8 per block of 32: within ~1 % of the output's scale.
    assert float((got - reference).abs().max()) < 0.01 * float(reference.abs().max())
    # ...and the weights to their grid: 4 or 8 bits per block.
    error = (layer.dequantized() - linear.weight.detach()).abs().max()
    assert float(error) <= float(linear.weight.detach().abs().max()) / (7 if layer_class is Q4Linear else 127)


@pytest.mark.parametrize("kind", [4, 8])
def test_each_row_of_a_batch_is_computed_as_alone_whatever_the_threads(kind: int) -> None:
    """What makes a stream in a batch equal to it alone: rows never mix, and one thread or two sum
    each output in the same order."""
    weight = _weight(72, 128)
    layer = (Q4Linear if kind == 4 else Q8Linear).from_linear(torch.nn.Linear(128, 72, bias=False))
    layer.weight_q, layer.scales = (Q4Linear if kind == 4 else Q8Linear).quantize_weight(weight)
    x = torch.randn(9, 128)
    batch = layer(x)
    for i in range(9):
        assert torch.equal(batch[i : i + 1], layer(x[i : i + 1]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batch)


def test_q4_and_q8_hold_gguf_weights_exactly() -> None:
    """Weights that lie on GGUF's Q4_1 grid (w = q * d + m, fp16 d and m) or Q8_0 grid come back
    bit for bit: the embedded model loses nothing to its re-quantization."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 4, BLOCK), generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 maps each block's minimum and maximum to 0 and 15
    d = (torch.rand(16, 4, 1, generator=generator) * 0.01 + 0.001).half().float()
    m = (torch.randn(16, 4, 1, generator=generator) * 0.05).half().float()
    weight = (q * d + m).reshape(16, 4 * BLOCK)
    assert torch.equal(Q4Linear.dequantize(*Q4Linear.quantize_weight(weight)), weight)
    q8 = torch.randint(-127, 128, (16, 4, BLOCK), generator=generator).float()
    q8[..., 0] = 127
    weight8 = (q8 * d).reshape(16, 4 * BLOCK)
    assert torch.equal(Q8Linear.dequantize(*Q8Linear.quantize_weight(weight8)), weight8)


@pytest.mark.model
def test_the_embedded_models_weights_come_back_exactly(exact_text_model) -> None:
    layer = exact_text_model.model.model.layers[7]
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        weight = layer.get_submodule(name).weight.detach()
        assert torch.equal(Q4Linear.dequantize(*Q4Linear.quantize_weight(weight)), weight)
    embedding = exact_text_model.model.get_input_embeddings().weight.detach()[:4096]
    assert torch.equal(Q8Linear.dequantize(*Q8Linear.quantize_weight(embedding)), embedding)


def test_a_bad_shape_is_a_clear_error() -> None:
    layer = Q4Linear.from_linear(torch.nn.Linear(64, 16))
    with pytest.raises(RuntimeError, match="in_features 48 must be a multiple of 32"):
        block_matmul(torch.randn(1, 48), 4, layer.weight_q, layer.scales, None, 16)


def test_the_portable_c_build_computes_what_the_vector_build_does(tmp_path: Path) -> None:
    """Machines without AVX2 (ARM, old x86) get the same source's portable C: build it here without
    -march=native and compare."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    portable = tmp_path / "portable.so"
    subprocess.run([compiler, "-O2", "-fPIC", "-shared", str(SOURCE), "-o", str(portable), "-lm"], check=True)
    library = ctypes.CDLL(str(portable))
    library.ms_kernel_isa.restype = ctypes.c_char_p
    assert library.ms_kernel_isa() == b"portable C"
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for kind, layer_class in ((4, Q4Linear), (8, Q8Linear)):
        function = getattr(library, f"ms_matmul_q{kind}")
        function.argtypes = [pointer, pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int]
        weight, scales = layer_class.quantize_weight(_weight(48, 160, seed=kind))
        x = torch.randn(3, 160)
        out = torch.empty(3, 48)
        assert function(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), None, out.data_ptr(), 3, 160, 48, 1) == 0
        vector = block_matmul(x, kind, weight, scales, None, 48)
        assert torch.allclose(out, vector, rtol=1e-5, atol=1e-5)


def _tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def test_a_native_decoder_layer_computes_what_transformers_layer_does() -> None:
    """The two native calls against transformers' forward of the same (block-quantized) layers."""
    model = _tiny_llama()
    report = quantize_model(model, "int4")
    assert report.native_layers == 2 and all(native_layer(layer) for layer in model.model.layers)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        for layer in model.model.layers:  # transformers' own path for the same weights
            layer.multistream_native_off, layer.multistream_native = layer.multistream_native, None
        torch_path = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    assert torch.equal(native.sequences, torch_path.sequences)
    for a, b in zip(native.logits[1:], torch_path.logits[1:]):  # the decode steps (the first is the prefill's)
        assert torch.allclose(a, b, atol=2e-3, rtol=1e-3)


def test_a_padded_batch_in_generate_takes_transformers_path() -> None:
    """A mask that hides columns (left padding in generate) is not the native path's to read."""
    model = _tiny_llama()
    quantize_model(model, "int4")
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    calls = []
    native = native_layer(model.model.layers[0])
    rest = native.rest
    native.rest = lambda *a, **k: calls.append(1) or rest(*a, **k)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert not calls
        model.generate(ids[1:], max_new_tokens=3, do_sample=False)
    assert calls


def test_without_a_compiler_quantized_layers_fall_back_to_aten_with_one_log_line(tmp_path: Path) -> None:
    """A fresh cache and no working C compiler: one warning, then ATen's kernels (a plain process)."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from multistream.text._block_kernels import native_kernels, native_problem\n"
        "from multistream.text._quantize import quantize_model\n"
        "net = torch.nn.Sequential(torch.nn.Linear(64, 32))\n"
        "report = quantize_model(net, 'int4')\n"
        "print(type(net[0]).__name__, native_kernels() is None, native_problem())\n"
    )
    env = {**os.environ, "MULTISTREAM_CACHE": str(tmp_path), "CC": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["Int4Linear", "True"]
    assert "could not build _block_kernels.c" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "block-quantized CPU kernels are unavailable" in line]
    assert len(warnings) == 1 and "use ATen's kernels" in warnings[0]


def test_a_layer_cast_after_quantizing_is_a_clear_error_not_garbage() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(64, 32))
    quantize_model(net, "int4")
    net.to(torch.bfloat16)  # casts the fp16 scales the kernel reads
    with pytest.raises(RuntimeError, match="buffers were changed after quantizing"):
        net(torch.randn(1, 64))


def test_a_run_of_native_layers_in_one_call_equals_them_one_by_one() -> None:
    """FastDecode's NativeStack (one C call for several layers) against each layer's own call."""
    from transformers import DynamicCache

    from multistream.text._fast_decode import FastDecode
    from multistream.text._kv_rows import RowCache

    model = _tiny_llama(layers=3)
    quantize_model(model, "int4")
    fast = FastDecode.for_model(model)
    assert fast is not None and fast.native_stack is not None
    stack = fast.native_stack

    def one_step(use_stack: bool) -> torch.Tensor:
        fast.native_stack = stack if use_stack else None
        cache = DynamicCache()
        ids = torch.tensor([[3, 9, 27, 81, 4], [0, 0, 7, 8, 9]])
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            rows = RowCache(cache, torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]))
            return fast.step(torch.tensor([[11], [12]]), torch.tensor([[5], [3]]), rows, [0, 2],
                             points=frozenset({1}), prefill_point=lambda: None)

    assert torch.equal(one_step(True), one_step(False))


def test_only_the_llama_layer_is_computed_natively() -> None:
    """A family whose layer has more than the Llama layer (Qwen3's q/k norms) keeps transformers' forward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = Qwen3ForCausalLM(config).eval()
    report = quantize_model(model, "int4")
    assert report.mode == "int4" and report.native_layers == 0
    assert not any(native_layer(layer) for layer in model.model.layers)
