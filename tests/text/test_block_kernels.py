"""The native CPU kernels (`text/_accel/kernels.c`), their layers and the native decoder layers.

Random weights (milliseconds), except one test on the embedded model's own weights. The default
model's promises that rest on these kernels (a stream's logprobs equal one forward of the whole
sequence, ``score``, ``revise``, rewind, failover) are tested on it in ``test_one_arithmetic.py``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multistream.text._accel import kernels as native
from multistream.text._accel.block_layers import Q4Linear, Q8Linear
from multistream.text._accel.kernels import BLOCK, SOURCE, Activations, QuantizedMatrix, matmul, native_kernels
from multistream.text._accel.native_layers import native_layer
from multistream.text._accel.quantize import quantize_model

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="the block kernels did not build here (no C compiler)")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=generator) * 0.05


@pytest.mark.parametrize("layer_class", [Q4Linear, Q8Linear])
@pytest.mark.parametrize("k", [96, 16416])  # 16416: a row's scales are converted in two pieces
def test_a_block_layer_computes_the_fp32_product_of_its_weights(layer_class, k: int) -> None:
    """fp32 activations (the default): the product of the dequantized weights to float rounding."""
    linear = torch.nn.Linear(k, 40)
    with torch.no_grad():
        linear.weight.copy_(_weight(40, k))
    layer = layer_class.from_linear(linear)
    x = torch.randn(5, k)
    reference = x.double() @ layer.dequantized().double().t() + linear.bias.detach().double()
    got = layer(x)
    assert got.shape == (5, 40) and got.dtype == torch.float32
    assert float((got.double() - reference).abs().max()) < 1e-5 * float(reference.abs().max())
    # ...and the weights lie on their grid: 4 or 8 bits per block.
    error = (layer.dequantized() - linear.weight.detach()).abs().max()
    assert float(error) <= float(linear.weight.detach().abs().max()) / (7 if layer_class is Q4Linear else 127)


@pytest.mark.parametrize("layer_class", [Q4Linear, Q8Linear])
def test_int8_activations_are_an_opt_in_with_llama_cpps_rounding(layer_class) -> None:
    layer = layer_class.from_linear(torch.nn.Linear(128, 24), Activations.INT8)
    x = torch.randn(3, 128)
    reference = x @ layer.dequantized().t() + layer.bias
    error = float((layer(x) - reference).abs().max())
    assert 1e-6 * float(reference.abs().max()) < error < 0.01 * float(reference.abs().max())
    assert "activations=int8" in repr(layer)


@pytest.mark.parametrize("kind", [4, 8])
@pytest.mark.parametrize("activations", list(Activations))
@pytest.mark.parametrize("width", [128, 1536])
def test_each_row_is_computed_as_alone_whatever_the_batch_and_threads(kind: int, activations: Activations,
                                                                        width: int) -> None:
    """What makes a stream in a batch equal to it alone, and a prefill equal to a decode: rows never
    mix, every group of rows (12 with AVX2, 8 with AVX-512, and the rows left over: a token and its
    drafts) repeats the single row's arithmetic, and threads split outputs only. At 1536 inputs (the
    embedded model's down projection) a group of 5 or more rows goes through the blocks in ranges
    (its activations would not stay in L1), its partial sums kept in memory between them."""
    layer_class = Q4Linear if kind == 4 else Q8Linear
    weight_q, scales = layer_class.quantize_weight(_weight(72, width))
    matrix = QuantizedMatrix(kind, weight_q, scales, torch.randn(72), activations)
    group = max(native_kernels().row_group(), 4)
    for rows in range(2, 2 * group + 2):  # every group size and remainder, once with a whole group before it
        x = torch.randn(rows, width)
        together = matmul(x, matrix)
        for i in range(rows):
            assert torch.equal(together[i : i + 1], matmul(x[i : i + 1], matrix)), (rows, i)
    x = torch.randn(9, width)
    batch = matmul(x, matrix)
    assert torch.equal(matmul(x, matrix, threads=1), batch)
    assert torch.equal(matmul(x, matrix, threads=3), batch)


# -- the kernels' thread team ---------------------------------------------------------------------


def _team_case() -> tuple[QuantizedMatrix, torch.Tensor, torch.Tensor]:
    weight_q, scales = Q4Linear.quantize_weight(_weight(256, 256, seed=7))
    matrix = QuantizedMatrix(4, weight_q, scales)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(7))
    return matrix, x, matmul(x, matrix, threads=1)


def test_calls_from_several_threads_at_once_each_get_their_own_answer() -> None:
    """The team runs one call at a time; concurrent callers (two engines in one process) take turns."""
    import concurrent.futures

    matrix, x, expected = _team_case()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda t: matmul(x, matrix, threads=t), [2, 3, 2, 4] * 10))
    assert all(torch.equal(r, expected) for r in results)


def test_more_threads_than_cpus_still_compute_the_same_values() -> None:
    """Barriers that spin must not stall when the team outnumbers the CPUs (they yield)."""
    matrix, x, expected = _team_case()
    for threads in (2, 5, 2 * (os.cpu_count() or 1) + 1):
        assert torch.equal(matmul(x, matrix, threads=threads), expected)


def test_a_forked_child_makes_its_own_workers() -> None:
    """fork() copies only the calling thread: the child must not wait for its parent's workers."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork() on this platform")
    matrix, x, expected = _team_case()
    matmul(x, matrix, threads=2)  # the parent's workers exist now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, report, leave without running the parent's cleanup
        ok = False
        try:
            ok = torch.equal(matmul(x, matrix, threads=2), expected)
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    import select

    ready, _, _ = select.select([read], [], [], 60)
    answer = os.read(read, 1) if ready else b""
    os.close(read)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert answer == b"1", "the forked child hung or computed another answer"


def test_idle_workers_sleep_instead_of_spinning() -> None:
    """After a call the workers wait a few milliseconds for the next one, then sleep: an idle
    process costs no CPU."""
    matrix, x, _ = _team_case()
    matmul(x, matrix, threads=2)
    import time

    time.sleep(0.3)
    before = os.times()
    time.sleep(1.0)
    after = os.times()
    used = (after.user - before.user) + (after.system - before.system)
    assert used < 0.3, f"the process used {used:.2f} s of CPU in 1 s of idling"


_CONTENDED_TEAM = """
import json, os, torch
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # this thread and every thread it makes: one CPU
from transformers import LlamaConfig, LlamaForCausalLM
from multistream.text._accel.kernels import native_kernels
from multistream.text._accel.quantize import quantize_model
torch.manual_seed(0)
config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = LlamaForCausalLM(config).eval()
quantize_model(model, "int4")
ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    torch.set_num_threads(1)
    alone = model(ids).logits
    torch.set_num_threads(2)  # two threads on one CPU: each barrier waits for a preempted teammate
    team = [model(ids).logits for _ in range(20)]
print(json.dumps({"same": all(torch.equal(t, alone) for t in team), "contention": native_kernels().contention()}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_a_team_whose_teammate_is_preempted_runs_calls_on_the_callers_thread_alone() -> None:
    """Another busy process on the same cores preempts a teammate for whole time slices, and each
    barrier of the static split waits for it (one `while True` process beside a 2-thread decode on
    2 cores cut it from 105 to 37 tok/s). Two threads on one CPU are that case for certain: the
    team notices its stalled barriers and sends the next calls to the caller alone, with the same
    values."""
    import json

    done = subprocess.run([sys.executable, "-c", _CONTENDED_TEAM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["same"], "a contended team computed other values"
    stalled, alone = report["contention"]
    assert stalled >= 1 and alone >= 1, report


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


# -- the kernel boundary: bad input is an error, never a read out of bounds ---------------------


def test_a_bad_shape_is_a_clear_error() -> None:
    layer = Q4Linear.from_linear(torch.nn.Linear(64, 16))
    with pytest.raises(RuntimeError, match="CPU rows of width 64"):
        layer(torch.randn(1, 48))
    weight_q, scales = Q4Linear.quantize_weight(_weight(16, 48 + 16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        matmul(torch.randn(1, 48), QuantizedMatrix(4, weight_q[:, :24].contiguous(), scales[:, :1].contiguous()))
    with pytest.raises(RuntimeError, match="needs scales"):
        matmul(torch.randn(1, 64), QuantizedMatrix(4, weight_q[:, :32].contiguous(), scales[:, :1].contiguous()))


@pytest.mark.parametrize("cast", [torch.float16, torch.bfloat16])
def test_a_model_cast_after_quantizing_raises_instead_of_reading_garbage(cast: torch.dtype) -> None:
    """``model.half()`` / ``.to(bfloat16)`` casts the fp16 scales and the fp32 bias the kernels read
    (a bf16 bias read as fp32 is out of bounds): the next call raises, naming the fix."""
    net = torch.nn.Sequential(torch.nn.Linear(64, 32))
    quantize_model(net, "int4")
    net.to(cast)
    with pytest.raises(RuntimeError, match="buffers were changed after quantizing"):
        net(torch.randn(1, 64, dtype=cast))
    model = _tiny_llama()
    quantize_model(model, "int4")
    model.to(cast)
    if cast == torch.bfloat16:  # the scales become bf16
        with pytest.raises(RuntimeError, match="after quantizing"):
            model(torch.tensor([[1, 2, 3]]))
    else:  # fp16 scales stay what they were; fp16 hidden states take transformers' path, read as fp32
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_a_batch_without_position_ids_reads_each_rows_own_rotary_row() -> None:
    """transformers passes one row of positions for a batch without padding; every row gets it (the
    kernels read one rotary row per token, never past the tensor)."""
    model = _tiny_llama()
    quantize_model(model, "int4")
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch = model(ids).logits
        for i in range(3):
            assert torch.equal(batch[i], model(ids[i : i + 1]).logits[0])


def test_tokens_outside_the_kv_buffers_are_refused() -> None:
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    shape = native.LayerShape(hidden=32, heads=2, kv_heads=1, dim=8, intermediate=32, scaling=0.3)
    tokens = native.Tokens.of_rows(cos, sin, rows=1, tokens=1, past=6, starts=None)
    with pytest.raises(RuntimeError, match="column 6 of KV buffers"):
        native.KVBuffers(torch.zeros(1, 1, 6, 8), torch.zeros(1, 1, 6, 8)).struct(shape, tokens)
    with pytest.raises(RuntimeError, match="must not be negative"):
        native.Tokens(cos, sin, torch.tensor([0]), torch.tensor([-1]), torch.tensor([0]))


def test_a_failed_allocation_raises_memory_error() -> None:
    """The C code returns -2 when malloc fails; the wrapper raises instead of handing back zeros."""
    with pytest.raises(MemoryError, match="could not allocate"):
        native._check_status(-2, "a block-quantized matmul")


def test_the_library_is_loaded_only_from_a_private_folder(tmp_path: Path) -> None:
    """A cache folder others can write to is never where the library is loaded from (loading a
    library from a shared writable path is running whoever wrote it): a private temporary folder
    is used instead, with a log line."""
    shared = tmp_path / "cache"
    (shared / "kernels").mkdir(parents=True)
    os.chmod(shared / "kernels", 0o777)
    script = (
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from multistream.text._accel.kernels import native_kernels\n"
        "print(native_kernels().path)\n"
    )
    env = {**os.environ, "MULTISTREAM_CACHE": str(shared)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert shared not in path.parents and "not private to this user" in done.stderr
    assert not path.parent.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_one_openmp_runtime_is_loaded() -> None:
    """The kernels bring no OpenMP runtime beside torch's (pytorch#98836: two in one process); they
    run on their own thread team."""
    native_kernels()
    runtimes = native.openmp_runtimes()
    assert len(runtimes) == 1, runtimes


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# Each instruction set the source has code for, built explicitly (the -march=native build picks one):
# the suite checks all that this CPU can run, whichever one the machine's own build is.
_ISA_BUILDS = {
    "portable C": (["-O2"], set()),
    "avx2": (["-O3", "-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "avx512": (["-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f"], {"avx2", "fma", "f16c", "avx512f"}),
}


@pytest.mark.parametrize("isa", list(_ISA_BUILDS))
def test_every_instruction_set_build_computes_what_the_machine_build_does(tmp_path: Path, isa: str) -> None:
    """Machines without AVX2 (ARM, old x86) get the same source's portable C, AVX2 machines the
    8-lane kernels, AVX-512 ones 16-lane products: build each one this CPU runs and compare them
    with the loaded build, layers included (builds differ by float rounding only)."""
    flags, needs = _ISA_BUILDS[isa]
    missing = needs - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    built = tmp_path / "kernels.so"
    subprocess.run([compiler, *flags, "-pthread", "-ffp-contract=off", "-fPIC", "-shared", str(SOURCE), "-o", str(built),
                    "-lm"], check=True)
    library = ctypes.CDLL(str(built))
    native._declare(library)
    assert library.ms_kernel_isa() == isa.encode()
    for kind, layer_class in ((4, Q4Linear), (8, Q8Linear)):
        weight, scales = layer_class.quantize_weight(_weight(48, 160, seed=kind))
        matrix = QuantizedMatrix(kind, weight, scales)
        x = torch.randn(5, 160)
        out, one_by_one = torch.empty(5, 48), torch.empty(5, 48)
        qmat = matrix.struct()
        assert library.ms_matmul(x.data_ptr(), 5, ctypes.byref(qmat), out.data_ptr(), 1) == 0
        assert torch.allclose(out, matmul(x, matrix), rtol=1e-5, atol=1e-6)
        for r in range(5):  # one arithmetic within the build: a row alone equals that row in a group
            assert library.ms_matmul(x[r:].data_ptr(), 1, ctypes.byref(qmat), one_by_one[r:].data_ptr(), 2) == 0
        assert torch.equal(out, one_by_one)
    model = _tiny_llama()
    quantize_model(model, "int4")
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        machine = model(ids).logits
        original = native._loaded
        native._loaded = native.NativeKernels(library, built, isa)
        try:
            other = model(ids).logits
        finally:
            native._loaded = original
    assert torch.allclose(machine, other, rtol=1e-4, atol=1e-5)


# -- native decoder layers ------------------------------------------------------------------------


def _tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def _dequantized_copy(model):
    """The same model with plain fp32 linear layers holding the quantized weights (the reference:
    what "fp32 activations" must compute)."""
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM(model.config).eval()
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, (Q4Linear, Q8Linear)) and not name.endswith(("qkv_fused", "gate_up_fused")):
            state[f"{name}.weight"] = module.dequantized()
    reference.load_state_dict({**{k: v for k, v in model.state_dict().items() if k in reference.state_dict()},
                               **state}, strict=False)
    return reference


def test_native_layers_compute_what_fp32_computes_with_the_same_weights() -> None:
    model = _tiny_llama()
    report = quantize_model(model, "int4")
    assert report.native_layers == 2 and all(native_layer(layer) for layer in model.model.layers)
    reference = _dequantized_copy(model)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    assert float((got - expected).abs().max()) < 1e-4


def test_prefill_decode_and_chunks_compute_the_same_logits_bit_for_bit() -> None:
    """One arithmetic: a token's logits are the same whether it was decoded, prefilled whole, in
    chunks, or in a batch of rows."""
    from transformers import DynamicCache

    model = _tiny_llama(layers=3)
    quantize_model(model, "int4")
    ids = torch.randint(0, 300, (1, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model(ids).logits[0]
        for chunks in ([1] * 14, [5, 9], [3, 1, 6, 4]):
            cache, pieces, start = DynamicCache(), [], 0
            for size in chunks:
                pieces.append(model(ids[:, start : start + size], cache=cache, use_cache=True).logits[0])
                start += size
            assert torch.equal(torch.cat(pieces), whole), chunks
        batch = model(torch.cat([ids, ids.flip(1)])).logits
    assert torch.equal(batch[0], whole)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 1)])
def test_query_heads_that_share_a_kv_head_attend_together_as_each_would_alone(heads: int, kv_heads: int) -> None:
    """Heads of 64 values that share a KV head (the embedded model's grouped-query attention) read its
    columns once for up to three of them: a prefill, a short decode (a task per head when the
    threads need the split), a decode past a long context (a task per KV head) all give the same
    logits bit for bit, and those of fp32 with the same weights. Groups of 3 and of 4 (3 + 1)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=192, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                         max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    report = quantize_model(model, "int4")
    assert report.native_layers == 2
    reference = _dequantized_copy(model)
    ids = torch.randint(0, 300, (1, 1060), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = model(ids).logits[0]
        assert float((whole - reference(ids).logits[0]).abs().max()) < 1e-4
        cache, pieces, start = DynamicCache(), [], 0
        for size in [1] * 12 + [1038] + [1] * 10:  # short decode, a long prefill, decode past 1024 columns
            pieces.append(model(ids[:, start : start + size], cache=cache, use_cache=True).logits[0])
            start += size
    assert torch.equal(torch.cat(pieces), whole)


def test_generate_and_a_padded_batch() -> None:
    """model.generate decodes natively; a mask that hides columns (left padding in generate) is not
    the native path's to read: that batch takes transformers' path."""
    model = _tiny_llama()
    quantize_model(model, "int4")
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    calls = []
    first = native_layer(model.model.layers[0])
    forward = first.forward
    first.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    with torch.no_grad():
        padded = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert not calls
        out = model.generate(ids[1:], max_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert calls and padded.shape == (2, 8)
    with torch.no_grad():
        whole = model(out.sequences[:, :-1]).logits[0, -3:]
    assert torch.equal(torch.cat(out.logits), whole)


def test_without_a_compiler_quantized_layers_fall_back_to_aten_with_one_log_line(tmp_path: Path) -> None:
    """A fresh cache and no working C compiler: one warning, then ATen's kernels (a plain process)."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from multistream.text._accel.kernels import native_kernels, native_problem\n"
        "from multistream.text._accel.quantize import quantize_model\n"
        "net = torch.nn.Sequential(torch.nn.Linear(64, 32))\n"
        "report = quantize_model(net, 'int4')\n"
        "print(type(net[0]).__name__, native_kernels() is None, native_problem())\n"
    )
    env = {**os.environ, "MULTISTREAM_CACHE": str(tmp_path), "CC": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["Int4Linear", "True"]
    assert "could not build kernels.c" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "block-quantized CPU kernels are unavailable" in line]
    assert len(warnings) == 1 and "use ATen's kernels" in warnings[0]


def test_a_run_of_native_layers_in_one_call_equals_the_models_forward() -> None:
    """FastDecode's NativeStack (one C call per run of layers, writing the engine's own KV buffers)
    against transformers' forward of the same token through the native layers: bit for bit."""
    fast, reference, rows = _decode_step_case(layers=3)
    with torch.no_grad():
        got = fast.step(torch.tensor([[11]]), torch.tensor([[5]]), rows, None, points=frozenset({1}),
                        prefill_point=lambda: None)
    assert torch.equal(got[0], reference)


def _decode_step_case(layers: int):
    """A quantized tiny Llama's `FastDecode`, the model's own logits for token 11 after
    [3, 9, 27, 81, 4], and the cache of those five tokens (the step to take: token 11 at position 5)."""
    from transformers import DynamicCache

    from multistream.text._accel.fast_decode import FastDecode
    from multistream.text._kv_rows import RowCache

    model = _tiny_llama(layers=layers)
    quantize_model(model, "int4")
    fast = FastDecode.for_model(model)
    assert fast is not None and fast.native_stack is not None
    ids = torch.tensor([[3, 9, 27, 81, 4, 11]])
    with torch.no_grad():
        reference = model(ids).logits[0, -1]
        cache = DynamicCache()
        model(input_ids=ids[:, :5], cache=cache, use_cache=True)
    return fast, reference, RowCache(cache, torch.ones(1, 5, dtype=torch.long))


@pytest.mark.parametrize("waiting", [False, True])
def test_prefill_points_stop_the_one_call_only_when_a_request_waits(waiting: bool) -> None:
    """With the engine's arrival flag, the native step is one C call that stops at a prefill point
    only when the flag is set (then the point's prefill runs and the call goes on from there); the
    logits are the same bit for bit either way, and equal the model's forward."""
    import ctypes

    fast, reference, rows = _decode_step_case(layers=4)
    assert fast.native_stack is not None
    calls: list[tuple[int, int]] = []
    decode = fast.native_stack.decode

    def counted(start, end, *args, **kwargs):
        hidden, done = decode(start, end, *args, **kwargs)
        calls.append((start, done))
        return hidden, done

    fast.native_stack.decode = counted  # type: ignore[method-assign]
    flag = ctypes.c_int32(1 if waiting else 0)
    prefills: list[int] = []

    def prefill_point() -> None:  # the engine's: it takes the arrivals, which clears the flag
        prefills.append(len(calls))
        flag.value = 0

    with torch.no_grad():
        got = fast.step(torch.tensor([[11]]), torch.tensor([[5]]), rows, None, points=frozenset({2, 3}),
                        prefill_point=prefill_point, arrivals=flag)
    assert torch.equal(got[0], reference)
    if waiting:  # stopped before layer 2, prefilled, then layers 2..3 in a second call
        assert calls == [(0, 2), (2, 4)] and prefills == [1]
    else:
        assert calls == [(0, 4)] and prefills == []


def test_stop_points_are_checked() -> None:
    import ctypes

    from multistream.text._accel.kernels import StopPoints

    with pytest.raises(TypeError, match="ctypes.c_int32"):
        StopPoints(frozenset({1}), 4, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        StopPoints(frozenset({1}), 4, ctypes.c_int32(0)).struct(2, 6)


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
