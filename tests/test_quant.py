"""Quantized weights: every GGUF type the kernels run is read exactly (its dequantized matrix is
gguf's own), the packed layout round-trips, the native kernels match gguf's dequantize-then-multiply
within the error of int8 activations, and every row's result is bit for bit the same whatever the
number of rows or threads (what keeps speculative decoding lossless on quantized weights)."""

import numpy as np
import pytest
import torch
from ggml_reference import quantize as ggml_quantize
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specsot_mq import quant
from specsot_mq.model import ForwardOutput, Step
from specsot_mq.quant import FORMATS, QLinear, from_ggml, fuse
from specsot_mq.slots import SlotManager

ISAS = ["avx2", "native"]
TYPES = list(FORMATS)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    if quant.native() is None:
        pytest.skip("the native kernels are not available on this machine")
    if request.param == "avx2":
        monkeypatch.setenv("SPECSOT_KERNEL_ISA", "avx2")
    return request.param


def quantized(w: torch.Tensor, ggml_type: str) -> quant.QWeight:
    """w as GGUF blocks of `ggml_type` (gguf's quantizer, or the reference one for K-quants), packed."""
    return from_ggml(ggml_quantize(w.numpy(), ggml_type), ggml_type, tuple(w.shape))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_every_gguf_type_is_read_exactly(ggml_type):
    w = np.random.default_rng(0).standard_normal((24, 512)).astype(np.float32) * 0.05
    raw = ggml_quantize(w, ggml_type)
    qw = from_ggml(raw, ggml_type, w.shape)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[ggml_type]).reshape(w.shape))
    assert qw.format.name == ggml_type
    assert torch.equal(qw.dequantize(), want)
    assert np.abs(want.numpy() - w).max() < 0.05  # the reference quantizer's blocks mean what gguf reads


@pytest.mark.parametrize("ggml_type", TYPES)
def test_packed_bytes_per_weight_are_the_files(ggml_type):
    """No widening: a packed matrix takes the file's bytes, but for K-quants' 6-bit scales and
    mins, a byte each (Q4_K 4.625 bits per weight against 4.5, Q5_K 5.625 against 5.5)."""
    n, k = 64, 1024
    qw = quantized(torch.randn(n, k), ggml_type)
    file_bytes = ggml_quantize(np.zeros((n, k), np.float32), ggml_type).nbytes
    extra = {"Q4_K": 4 / 144, "Q5_K": 4 / 176}.get(ggml_type, 0.0)
    assert qw.data.numel() == pytest.approx(file_bytes * (1 + extra))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_pack_round_trip_select_scale_and_padding(ggml_type):
    w = torch.randn(21, 512)  # 21 rows: padded to 32 in the packed layout
    qw = quantized(w, ggml_type)
    assert qw.data.shape[0] == 2
    index = torch.tensor([20, 0, 7, 16, 7])
    assert np.array_equal(qw.columns(index.numpy()), qw.columns()[index.numpy()])  # the rows' bytes, read alone
    assert torch.equal(qw.select(index).dequantize(), qw.dequantize()[index])
    assert torch.equal(quant.QWeight.cat([qw, qw.select(index)]).dequantize(), torch.cat([qw.dequantize(), qw.dequantize()[index]]))
    halved = qw.scaled(0.5).dequantize()
    normal = qw.dequantize().abs() > 1e-3  # fp16 scales that stay normal numbers scale exactly
    assert torch.equal(halved[normal], qw.dequantize()[normal] * 0.5)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("shape", [(40, 256), (512, 768), (96, 1536)])
def test_kernel_matches_dequantized_product(isa, ggml_type, shape):
    torch.manual_seed(0)
    qw = quantized(torch.randn(shape) * 0.05, ggml_type)
    layer = QLinear(qw)
    x = torch.randn(7, shape[1])
    want = x @ qw.dequantize().T
    got = layer(x)
    # int8 activations per block of 32 (as llama.cpp's Q8_1): relative error of a dot product
    # stays far below 1%
    rel = (got - want).norm() / want.norm()
    assert rel < 0.01, rel


def test_a_fused_projection_keeps_each_parts_format(isa):
    """q, k and v quantized in different formats (Q4_K_M gives v Q6_K) run as one QLinear whose
    parts keep their formats, with each part's bits; parts of one format merge."""
    torch.manual_seed(2)
    q, k, v = (quantized(torch.randn(n, 256) * 0.05, t) for n, t in ((64, "Q4_K"), (32, "Q4_K"), (32, "Q6_K")))
    parts = fuse([q, k, v])
    assert [p.format.name for p in parts] == ["Q4_K", "Q6_K"] and parts[0].n == 96
    fused = QLinear(parts)
    x = torch.randn(5, 256)
    alone = torch.cat([QLinear(w)(x) for w in (q, k, v)], dim=-1)
    assert torch.equal(fused(x), alone)
    assert torch.equal(fused.rows(torch.tensor([0, 95, 96, 127])), torch.cat([w.dequantize() for w in (q, k, v)])[[0, 95, 96, 127]])
    odd = fuse([quantized(torch.randn(40, 256), "Q4_0"), quantized(torch.randn(16, 256), "Q8_0")])
    assert [p.format.name for p in odd] == ["Q8_0"]  # 40 rows are no whole groups: one format for all


@pytest.mark.parametrize("fused", ["norm", "glu", "residual"])
def test_fused_norm_glu_and_residual_match_torch(isa, fused):
    """What a decoder layer runs around its linears, inside the kernel call: an RMSNorm before,
    silu(gate) * up before, or the residual after, against the same steps in torch ops."""
    from specsot_mq.model import RMSNorm

    torch.manual_seed(3)
    blocks = quant.quantize(torch.randn(96, 320) * 0.05, "Q4_1")
    layer = QLinear(blocks)
    reference = QLinear(blocks)
    reference.parts, reference.weight = None, torch.nn.Parameter(blocks.dequantize(), requires_grad=False)
    x = torch.randn(6, 640 if fused == "glu" else 320) * 3
    norm = RMSNorm(320, 1e-5)
    norm.weight.data = torch.rand(320) + 0.5
    kwargs = {"norm": dict(norm=norm), "glu": dict(glu=True), "residual": dict(residual=torch.randn(6, 96))}[fused]
    want, got = reference(x, **kwargs), layer(x, **kwargs)
    assert (got - want).norm() / want.norm() < 0.01
    assert torch.equal(torch.cat([layer(x[i : i + 1], **{k: v[i : i + 1] if k == "residual" else v for k, v in kwargs.items()})
                                  for i in range(6)]), got)  # fmt: skip


def test_one_native_call_for_all_layers_computes_what_the_modules_compute(isa, monkeypatch):
    """A quantized model runs all its layers, the final norm and the output layer as one native call
    (decoder_layers); the same layers module by module (QLinear, attend_cached, RMSNorm) give the
    same bits, logits and hidden states: a prefill, a step of rows at different lengths, and a
    tree-masked verify."""
    from conftest import ours_from_hf, tiny_hf

    from specsot_mq.model import DecoderLayer

    model = ours_from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=112))
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in ("qkv", "o", "gate_up", "down")]
    assert model.layers[0].native_weights() is None and model.native_head() is None  # float linears: module by module
    names.append("lm_head")
    model.use_quantized({n: quant.quantize(model.get_submodule(n).weight.detach(), "Q4_1") for n in names}, torch.float32)
    assert all(layer.native_weights() is not None for layer in model.layers)  # the swap was seen
    assert model.native_head() is not None
    with torch.no_grad():
        assert model.native_stack(torch.zeros(1, 1, 64), model.new_cache(1, 4)) is not None  # one call for all
    gen = torch.Generator().manual_seed(0)
    prompt, step, tree = (torch.randint(0, 97, shape, generator=gen) for shape in [(2, 9), (2, 1), (2, 3)])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)

    def run():
        cache = model.new_cache(2, 32)
        with torch.no_grad():
            first = model(prompt, cache, Step.fresh(torch.arange(9).expand(2, 9), logit_rows=[8, 3, 14, 15],
                                                    hidden_layers=(1, 0, len(model.layers))))  # fmt: skip
            out = [first.logits, *first.hidden]
            early = model(prompt, model.new_cache(2, 32), Step.fresh(torch.arange(9).expand(2, 9), logit_rows=[],
                                                                     hidden_layers=(1,)))  # stops after layer 0
            assert torch.equal(early.hidden[0], first.hidden[0])
            out.append(model(step, cache, Step([0, 1], [9, 7], torch.tensor([[9], [7]]))).logits)
            out.append(model(tree, cache, Step([0, 1], [10, 8], torch.tensor([[10, 11, 11], [8, 9, 9]]), mask)).logits)
        return out

    fused = run()
    monkeypatch.setattr(DecoderLayer, "native_weights", lambda self: None)
    for a, b in zip(fused, run()):
        assert torch.equal(a, b)


def test_a_forward_from_a_middle_layer_finishes_what_the_lower_layers_began(isa, monkeypatch):
    """Step.from_layer (a direct answer's prefill going on from the router's forward): the lower
    layers run first (logit_rows=[]), then the rest from their hidden state over the same cache;
    the logits, the hidden states and every cache entry are the full forward's, bit for bit, in
    one native call and module by module."""
    from conftest import ours_from_hf, tiny_hf

    from specsot_mq.model import DecoderLayer

    model = ours_from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=112, num_hidden_layers=4))
    names = [f"layers.{i}.{n}" for i in range(4) for n in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
    model.use_quantized({n: quant.quantize(model.get_submodule(n).weight.detach(), "Q4_1") for n in names}, torch.float32)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3, 10)[None]  # after 3 entries already there (a fixed prompt beginning)

    def run():
        caches, outs = [model.new_cache(1, 16), model.new_cache(1, 16)], []
        with torch.no_grad():
            for cache in caches:
                model(ids[:, :3], cache, Step.fresh(torch.arange(3)[None]))
            outs.append(model(ids, caches[0], Step([0], [3], positions, logit_rows=[6], hidden_layers=(1, 3, 4))))
            lower = model(ids, caches[1], Step([0], [3], positions, logit_rows=[], hidden_layers=(2, 1)))
            upper = model(lower.hidden[0], caches[1], Step([0], [3], positions, logit_rows=[6], hidden_layers=(3, 4),
                                                            from_layer=2))  # fmt: skip
            outs.append(ForwardOutput(upper.logits, [lower.hidden[1], *upper.hidden]))
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        return outs

    native = run()
    monkeypatch.setattr(DecoderLayer, "native_weights", lambda self: None)
    modules = run()
    for full, resumed in (native, modules):
        assert torch.equal(full.logits, resumed.logits)
        assert all(torch.equal(a, b) for a, b in zip(full.hidden, resumed.hidden))


def test_the_greedy_scan_picks_what_torch_max_picks(isa):
    """sampling.greedy_tokens on float32 runs the kernels' scan: the index of each row's largest
    value, the first where several are (ties, a row of -inf), the first NaN where there is one."""
    from specsot_mq.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 8, 19, 49152):
        x = torch.randn(2, 6, vocab, generator=g)
        x[0, 1] = 3.0
        x[0, 2, torch.randint(0, vocab, (2,), generator=g)] = float("nan")
        x[0, 3] = float("-inf")
        x[0, 4, torch.randint(0, vocab, (3,), generator=g)] = 100.0
        x[0, 5] = torch.randint(0, 3, (vocab,), generator=g).float()
        assert torch.equal(greedy_tokens(x), x.max(dim=-1).indices)
        assert torch.equal(quant.native().greedy(x), x.max(dim=-1).indices)


def test_rows_sharing_a_copied_prefix_read_it_from_one_slot_with_the_same_bits(isa):
    """Slots that hold copies of one prompt prefix (a question's points) read it from one of them
    in a batched step, a tree verify and a prefill of suffixes: the logits are the bits of every
    row reading its own slot."""
    from conftest import ours_from_hf, tiny_hf

    model = ours_from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=112))
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
    model.use_quantized({n: quant.quantize(model.get_submodule(n).weight.detach(), "Q4_1") for n in names}, torch.float32)
    gen = torch.Generator().manual_seed(0)
    prefix, suffix, step = (torch.randint(0, 112, shape, generator=gen) for shape in [(1, 20), (3, 4), (3, 2)])
    mask = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool).expand(3, 2, 2)

    def run(share: bool):
        slots = SlotManager(model.new_cache(4, 40))
        cache = slots.cache
        with torch.no_grad():
            model(prefix, cache, Step([1], [0], torch.arange(20)[None], logit_rows=[19]))
            cache.copy(1, [3, 0], 20)
            if share:
                slots.claim([1, 3, 0], tuple(prefix[0].tolist()), copy=0)
            sources = slots.prefix_sources([3, 0, 1])
            assert (sources is not None) == share
            out = [model(suffix, cache, Step([3, 0, 1], [20] * 3, torch.arange(20, 24).expand(3, 4), sources=sources)).logits]
            positions = torch.tensor([[24, 25], [22, 23], [24, 25]])
            out.append(model(step, cache, Step([3, 0, 1], [24, 22, 24], positions, mask, sources=sources)).logits)
        return out

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_rows_are_bit_identical_whatever_the_batch(isa, ggml_type):
    torch.manual_seed(1)
    layer = QLinear(quantized(torch.randn(200, 512), ggml_type))
    x = torch.randn(17, 512)
    whole = layer(x)
    one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(17)])
    assert torch.equal(whole, one_by_one)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x[3:9]), whole[3:9])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_both_instruction_sets_compute_the_same_bits(monkeypatch, ggml_type):
    if quant.native() is None or quant.native().isa() != "avx512-vnni":
        pytest.skip("needs a CPU with AVX-512 VNNI to compare against its AVX2 path")
    layer = QLinear(quantized(torch.randn(64, 512), ggml_type))
    x = torch.randn(13, 512)
    vnni = layer(x)
    monkeypatch.setenv("SPECSOT_KERNEL_ISA", "avx2")
    assert torch.equal(layer(x), vnni)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_select_and_rows_keep_the_exact_values(isa, ggml_type):
    qw = quantized(torch.randn(50, 256), ggml_type)
    layer = QLinear(qw, bias=None)
    index = torch.tensor([49, 0, 7, 8, 31])
    assert torch.equal(layer.rows(index), qw.dequantize()[index])
    assert torch.equal(layer.rows(index.view(1, 5)), qw.dequantize()[index].view(1, 5, 256))  # an embedding's [B, T]
    picked = layer.select(index)
    x = torch.randn(3, 256)
    assert torch.equal(picked(x), layer(x)[:, index])


def test_without_the_kernels_the_dequantized_weights_run(monkeypatch):
    monkeypatch.setattr(quant, "_native", False)
    blocks = quant.quantize(torch.randn(16, 64), "Q8_0")
    layer = QLinear(blocks, bias=torch.ones(16))
    x = torch.randn(2, 64)
    assert layer.parts is None
    torch.testing.assert_close(layer(x), x @ blocks.dequantize().T + 1)


@pytest.mark.slow
def test_real_model_logits_match_the_dequantized_reference(default_model_dir):
    """The default model on its own Q4_1/Q8_0 blocks against the same weights dequantized to fp32
    (the reference): the logits' relative L2 error is under 7% on average over the positions and
    under 35% at any one (int8 activations, as llama.cpp's; the first tokens, whose activations are
    the largest, err the most), and the greedy token is the reference's at 90% of positions or
    more, the others being near-ties of the reference."""
    from specsot_mq.loader import load_model
    from specsot_mq.tokenizer import chat_prompt_ids, load_tokenizer

    if quant.native() is None:
        pytest.skip("the native kernels are not available on this machine")
    tokenizer = load_tokenizer(default_model_dir)
    ids = torch.tensor([chat_prompt_ids(tokenizer, "Explain how a rainbow forms, step by step, for a curious child.")])
    positions = torch.arange(ids.shape[1])[None]
    ours, ref = load_model(default_model_dir), load_model(default_model_dir, quantize="none")
    with torch.no_grad():
        got = ours(ids, ours.new_cache(1, ids.shape[1]), Step.fresh(positions)).logits[0]
        want = ref(ids, ref.new_cache(1, ids.shape[1]), Step.fresh(positions)).logits[0]
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert rel.mean() < 0.07 and rel.max() < 0.35, (rel.mean(), rel.max())
    agree = got.argmax(-1) == want.argmax(-1)
    assert agree.float().mean() >= 0.9, agree.float().mean()
    top2 = want.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1])[~agree] < 1.5).all()  # disagreements only where the reference nearly ties


# A quantized tiny model's logits and greedy tokens (a prefill, a step, a tree-masked verify),
# saved to argv[1], the kernels' instruction set printed: run natively and on an emulated CPU.
_FORWARD_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from ggml_reference import quantize
from specsot_mq import quant
from specsot_mq.config import ModelConfig
from specsot_mq.model import LlamaModel, Step
from specsot_mq.sampling import greedy_tokens

torch.set_num_threads(2)
cfg = ModelConfig(vocab_size=112, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=64)
model = LlamaModel(cfg).eval().requires_grad_(False)
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
names = [f"layers.{i}.{n}" for i in range(2) for n in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
types = list(quant.FORMATS) * 2  # every format the kernels run, in some layer
weights = {}
for name, kind in zip(names, types):
    w = model.get_submodule(name).weight.detach()
    weights[name] = quant.from_ggml(quantize(w.numpy(), kind), kind, tuple(w.shape))
model.use_quantized(weights, torch.float32)
prompt, step, tree = (torch.randint(0, 112, shape, generator=gen) for shape in [(2, 9), (2, 1), (2, 3)])
mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
cache = model.new_cache(2, 32)
with torch.no_grad():
    out = [model(prompt, cache, Step.fresh(torch.arange(9).expand(2, 9))).logits]
    out.append(model(step, cache, Step([0, 1], [9, 9], torch.tensor([[9], [9]]))).logits)
    out.append(model(tree, cache, Step([0, 1], [10, 10], torch.tensor([[10, 11, 11], [10, 11, 11]]), mask)).logits)
out.append(greedy_tokens(out[0]))
torch.save(out, sys.argv[1])
print(quant.native().isa())
"""


def test_a_cpu_without_avx512_runs_the_avx2_kernels(tmp_path):
    """On an emulated AVX2-only EPYC (qemu-user's EPYC-Rome: AVX2, FMA, F16C, no AVX-512), the
    kernels built here pick their AVX2 path by themselves, run without an AVX-512 instruction, and
    compute the same bits as this machine's AVX2 path (SPECSOT_KERNEL_ISA=avx2), for a model whose
    linears hold every format the kernels run: what a user with such a CPU runs, checked where CI
    has only AVX-512 machines."""
    import os
    import platform
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if quant.native() is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the native kernels are not available on this machine")
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("qemu-x86_64 is not installed (apt-get install qemu-user): the AVX2-only CPU check skips")
    if subprocess.run([qemu, "-cpu", "EPYC-Rome", "/bin/true"], capture_output=True).returncode != 0:
        pytest.skip("qemu-x86_64 cannot run a program on this machine (a sandbox that forbids it?)")
    script = tmp_path / "forward.py"
    script.write_text(_FORWARD_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "SPECSOT_KERNEL_ISA"}

    def run(prefix: list[str], out: str, extra: dict) -> str:
        done = subprocess.run([*prefix, sys.executable, str(script), str(tmp_path / out), str(Path(__file__).parent)],
                              env={**env, **extra},
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1]

    assert run([], "host.pt", {"SPECSOT_KERNEL_ISA": "avx2"}) == "avx2"
    assert run([qemu, "-cpu", "EPYC-Rome"], "emulated.pt", {}) == "avx2"
    host, emulated = torch.load(tmp_path / "host.pt"), torch.load(tmp_path / "emulated.pt")
    assert len(host) == len(emulated) == 4
    for a, b in zip(host, emulated):
        assert torch.equal(a, b)


def test_packed_weights_move_onto_one_huge_page_buffer_and_compute_the_same():
    """LlamaModel.prepack gathers every packed weight into one 2 MB-aligned buffer (asking the OS
    for huge pages), each weight on a cache line of its own, and the logits stay the same bits."""
    import mmap

    from conftest import ours_from_hf, tiny_hf

    if quant.native() is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("needs the native kernels and Linux's madvise")
    model = ours_from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=112))
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
    model.use_quantized({n: quant.quantize(model.get_submodule(n).weight.detach(), "Q4_1") for n in names}, torch.float32)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))

    def logits():
        with torch.no_grad():
            return model(ids, model.new_cache(2, 16), Step.fresh(torch.arange(7).expand(2, 7))).logits

    before = logits()
    old = [p.data for n in names for p in model.get_submodule(n).parts]
    model.prepack()
    for p in old:  # what the kernels' forms built by the first forward held: forgotten, not read
        p.zero_()
    packed = [p.data for n in names for p in model.get_submodule(n).parts]
    storages = {p.untyped_storage().data_ptr() for p in packed}
    assert len(storages) == 1
    assert min(p.data_ptr() for p in packed) % (2 << 20) == 0
    assert all(p.data_ptr() % 64 == 0 for p in packed)
    assert torch.equal(logits(), before)


def test_ragged_rows_get_the_bits_of_padded_rows(isa, monkeypatch):
    """Causal rows of different lengths run as a token per batch row (SlotLayout._ragged) where
    the native kernels run the model: a prefill of prompts of three lengths gives each prompt's
    last logits and cache entries as it alone would, and a step of chains of 3, 1 and 2 tokens the
    logits of the padded [B, T] forward. Module by module (attention gathering a slot's copy per
    row), the rows stay padded."""
    from conftest import ours_from_hf, tiny_hf

    from specsot_mq.layout import SlotLayout
    from specsot_mq.model import DecoderLayer

    model = ours_from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=112))
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
    model.use_quantized({n: quant.quantize(model.get_submodule(n).weight.detach(), "Q4_1") for n in names}, torch.float32)
    shapes, forward = [], type(model).forward

    def recorded(self, ids, *args, **kwargs):  # the shape of every forward's input
        shapes.append(tuple(ids.shape))
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", recorded)
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, 97, (n,), generator=gen).tolist() for s, n in ((0, 5), (1, 9), (2, 7))}
    steps = [[3, 4, 5], [6], [7, 8]]
    with torch.no_grad():
        layout = SlotLayout(model, SlotManager(model.new_cache(3, 32)))
        pre = layout.prefill(prompts)
        for s, ids in prompts.items():
            alone = model.new_cache(1, 32)
            last = model(torch.tensor([ids]), alone, Step.fresh(torch.arange(len(ids))[None])).logits[0, -1]
            assert torch.equal(pre.last_logits[s], last)
            n = len(ids)
            assert layout.slots[s].length == n
            assert torch.equal(layout.slots.cache.k[:, s, :, :n], alone.k[:, 0, :, :n])
        positions = [list(range(len(prompts[s]), len(prompts[s]) + len(x))) for s, x in enumerate(steps)]
        ragged, _ = layout.forward([0, 1, 2], steps, positions)
        causal = [torch.ones(len(x), len(x), dtype=torch.bool).tril() for x in steps]
        padded, _ = layout.forward([0, 1, 2], steps, positions, masks=causal)  # the same places: nothing committed
        assert shapes[0] == (21, 1) and shapes[-2:] == [(6, 1), (3, 3)]  # ragged prefill and step, padded
        monkeypatch.setattr(DecoderLayer, "native_weights", lambda self: None)
        layout.forward([0, 1, 2], steps, positions)
        assert shapes[-1] == (3, 3)
    for i, x in enumerate(steps):
        assert torch.equal(ragged[i, : len(x)], padded[i, : len(x)])


def test_prepack_prefetches_few_rows_where_the_weights_fit_the_cache_and_either_way_computes_the_same_bits(isa, monkeypatch):
    """quant.set_prefetch (run by LlamaModel.prepack) sets the kernels' prefetch_min_rows to 1 where
    the packed weights fit half the CPU's last-level cache, else 4, and returns it; the prefetch is a
    hint only, so one to three rows give the same bits either way."""
    from conftest import ours_from_hf, tiny_hf

    kernel = quant.native()
    model = ours_from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=112))
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
    model.use_quantized({n: quant.quantize(model.get_submodule(n).weight.detach(), "Q4_1") for n in names}, torch.float32)
    try:
        kernel.set_prefetch_min_rows(7)
        model.prepack()
        assert kernel.prefetch_min_rows() == (1 if quant.last_level_cache_bytes() > 0 else 4)  # a tiny model fits
        monkeypatch.setattr(quant, "last_level_cache_bytes", lambda: 1000)  # a cache smaller than its weights
        assert quant.set_prefetch(model) == 4 == kernel.prefetch_min_rows()
        layer, x = model.get_submodule("layers.0.gate_up"), torch.randn(3, 64)
        got = {}
        for rows in (1, 4):
            kernel.set_prefetch_min_rows(rows)
            got[rows] = [layer(x[:k]) for k in (1, 2, 3)]
        assert all(torch.equal(a, b) for a, b in zip(got[1], got[4]))
    finally:
        kernel.set_prefetch_min_rows(4)
