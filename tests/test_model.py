"""Our Llama-family decoder against transformers' own implementations (fp32, max abs diff <= 1e-4,
with a cache in the activations' dtype; the fp16 cache the native kernels default to, within 2e-3)."""

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from specsot_mq.model import Step

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
TOL = 1e-4


def new_cache(model, slots: int, capacity: int):
    """A cache in the model's own dtype: these tests check the model's arithmetic exactly."""
    return model.new_cache(slots, capacity, model.dtype)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("prepack", [False, True], ids=["plain", "prepacked"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_incremental_decode_match_transformers(arch, prepack):
    hf = tiny_hf(arch)
    ours = ours_from_hf(hf, prepack=prepack)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = new_cache(ours, 2, 32)
        pre = ours(ids[:, :8], cache, Step.fresh(torch.arange(8).expand(2, 8))).logits
        assert (pre - ref[:, :8]).abs().max() <= TOL
        for t in range(8, 12):  # one token at a time against the cache
            step = ours(ids[:, t : t + 1], cache, Step([0, 1], [t, t], torch.full((2, 1), t))).logits
            assert (step[:, 0] - ref[:, t]).abs().max() <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_the_default_fp16_cache_stays_near_transformers(arch):
    """With the native kernels an fp32 model's cache holds keys and values in fp16 (half the bytes
    to read per step): prefill and steps stay within 2e-3 of transformers' fp32 logits."""
    from specsot_mq.quant import native

    if native() is None:
        pytest.skip("the native kernels are not built here: the cache stays fp32")
    hf = tiny_hf(arch)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = ours.new_cache(2, 32)
        assert cache.k.dtype == torch.float16
        pre = ours(ids[:, :8], cache, Step.fresh(torch.arange(8).expand(2, 8))).logits
        err = [(pre - ref[:, :8]).abs().max()]
        for t in range(8, 12):
            step = Step([0, 1], [t, t], torch.full((2, 1), t))
            err.append((ours(ids[:, t : t + 1], cache, step).logits[:, 0] - ref[:, t]).abs().max())
    assert max(err) <= 2e-3
    assert max(err) > 0  # the fp16 rounding is there: this is not the exact fp32 path


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_mask_step_matches_each_path_decoded_alone(arch):
    """A draft tree (several branches after one prefix) in one forward == each root-to-node path
    run through transformers on its own."""
    hf = tiny_hf(arch)
    ours = ours_from_hf(hf, prepack=True)
    prefix = [5, 17, 3, 60, 42]
    tokens = [7, 11, 13, 19, 23, 29, 31]
    parents = [-1, 0, 0, 1, 1, 2, 4]  # node 0 is the root; depth grows along parents
    depth, anc = [], []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        anc.append({i} | (anc[p] if p >= 0 else set()))
    n = len(tokens)
    mask = torch.tensor([[j in anc[i] for j in range(n)] for i in range(n)])[None]
    with torch.no_grad():
        cache = new_cache(ours, 1, 32)
        ours(torch.tensor([prefix]), cache, Step.fresh(torch.arange(5)[None]))
        positions = torch.tensor([[5 + d for d in depth]])
        tree = ours(torch.tensor([tokens]), cache, Step([0], [5], positions, mask)).logits[0]
    for i in range(n):
        path = sorted(anc[i], key=lambda j: depth[j])
        ref = hf_logits(hf, prefix + [tokens[j] for j in path])[-1]
        assert (tree[i] - ref).abs().max() <= TOL, f"node {i}"


def test_rows_of_different_lengths_in_one_batch():
    """Slots at different lengths decode together; each row equals that sequence alone."""
    hf = tiny_hf("llama")
    ours = ours_from_hf(hf, prepack=True)
    seqs = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [40, 41, 42, 43]]
    cache = new_cache(ours, 4, 32)
    with torch.no_grad():
        for slot, s in zip([3, 0, 2], seqs):  # non-consecutive slots exercise the gather path
            ours(torch.tensor([s[:-1]]), cache, Step([slot], [0], torch.arange(len(s) - 1)[None]))
        last = torch.tensor([[s[-1]] for s in seqs])
        pos = torch.tensor([[len(s) - 1] for s in seqs])
        out = ours(last, cache, Step([3, 0, 2], pos[:, 0].tolist(), pos)).logits[:, 0]
    for row, s in enumerate(seqs):
        assert (out[row] - hf_logits(hf, s)[-1]).abs().max() <= TOL


def test_full_mask_over_cache_gives_branch_isolation():
    """A [B, T, K] mask can hide cached entries: two branches packed in one sequence (a
    branch-index map) see the shared prefix and themselves only, at restarted positions."""
    hf = tiny_hf("qwen2")
    ours = ours_from_hf(hf)
    prefix, a, b = [3, 1, 4, 1], [5, 9], [2, 6]
    cache = new_cache(ours, 1, 32)
    with torch.no_grad():
        ours(torch.tensor([prefix]), cache, Step.fresh(torch.arange(4)[None]))
        mask = torch.zeros(1, 4, 8, dtype=torch.bool)
        mask[:, :, :4] = True
        mask[0, 0, 4] = mask[0, 1, 4:6] = True  # branch a: cache entries 4, 5
        mask[0, 2, 6] = mask[0, 3, 6:8] = True  # branch b: cache entries 6, 7
        pos = torch.tensor([[4, 5, 4, 5]])
        out = ours(torch.tensor([a + b]), cache, Step([0], [4], pos, mask)).logits[0]
    assert (out[:2] - hf_logits(hf, prefix + a)[-2:]).abs().max() <= TOL
    assert (out[2:] - hf_logits(hf, prefix + b)[-2:]).abs().max() <= TOL


def test_sliding_window_matches_mistral():
    hf = tiny_hf("mistral", sliding_window=4)
    ours = ours_from_hf(hf)
    ids = list(range(10, 22))
    with torch.no_grad():
        cache = new_cache(ours, 1, 32)
        out = ours(torch.tensor([ids[:8]]), cache, Step.fresh(torch.arange(8)[None])).logits[0]
        step = ours(torch.tensor([ids[8:9]]), cache, Step([0], [8], torch.tensor([[8]]))).logits[0]
    ref = hf_logits(hf, ids[:9])
    assert (out - ref[:8]).abs().max() <= TOL
    assert (step[0] - ref[8]).abs().max() <= TOL


def test_hidden_states_are_counted_as_transformers_counts_them():
    hf = tiny_hf("llama")
    ours = ours_from_hf(hf)
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
        out = ours(ids, new_cache(ours, 1, 8), Step.fresh(torch.arange(5)[None], hidden_layers=(2, 0, 1)))
    assert [h.shape for h in out.hidden] == [ref[2].shape, ref[0].shape, ref[1].shape]
    for got, want in zip(out.hidden, (ref[2], ref[0], ref[1])):
        assert (got - want).abs().max() <= TOL


def test_a_forward_without_logits_stops_after_the_last_hidden_state_asked():
    """logit_rows=[]: the layers past the last hidden state asked for do not run (their cache
    entries stay empty), and the hidden states are the full forward's."""
    ours = ours_from_hf(tiny_hf("llama", num_hidden_layers=4))
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.no_grad():
        full = ours(ids, new_cache(ours, 1, 8), Step.fresh(torch.arange(5)[None], hidden_layers=(1, 2)))
        cache = new_cache(ours, 1, 8)
        early = ours(ids, cache, Step.fresh(torch.arange(5)[None], logit_rows=[], hidden_layers=(1, 2)))
    assert len(ours.layers) == 4 and early.logits.shape[0] == 0
    assert all(torch.equal(a, b) for a, b in zip(early.hidden, full.hidden))
    assert cache.k[1, 0, :, :5].abs().sum() > 0 and not cache.k[2:].any()  # layers 0 and 1 ran, no later one


def test_logits_of_chosen_rows_and_bad_mask_shape():
    ours = ours_from_hf(tiny_hf("llama"))
    ids = torch.tensor([[4, 8, 15], [16, 23, 42]])
    positions = torch.arange(3).expand(2, 3)
    with torch.no_grad():
        full = ours(ids, new_cache(ours, 2, 8), Step.fresh(positions)).logits
        rows = ours(ids, new_cache(ours, 2, 8), Step.fresh(positions, logit_rows=[5, 1, 2])).logits
        assert rows.shape == (3, 97) and (rows - full.view(6, 97)[[5, 1, 2]]).abs().max() <= 1e-5
        with pytest.raises(ValueError, match="mask must be"):
            ours(ids[:1], new_cache(ours, 1, 8), Step.fresh(positions[:1], mask=torch.ones(1, 3, 5, dtype=torch.bool)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_and_fp32_run_and_agree_roughly(dtype):
    hf = tiny_hf("qwen3")
    ours = ours_from_hf(hf).to(dtype).prepack()
    ids = torch.tensor([[4, 8, 15, 16]])
    with torch.no_grad():
        out = ours(ids, new_cache(ours, 1, 8), Step.fresh(torch.arange(4)[None])).logits.float()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - hf(ids).logits).abs().max() < 0.1


def test_norm_and_rope_round_exactly_as_transformers(monkeypatch):
    """Bit for bit: RMSNorm in bf16 and fp32 (fp32 inside, rounded, then the weight) and rope in
    bf16 (the sign-folded sin table against transformers' rotate_half). In fp32 on a CPU with the
    native kernels, the norm is theirs (the one they run inside a layer): within float rounding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from specsot_mq import model as model_module
    from specsot_mq.model import LlamaModel, RMSNorm, _rope

    g = torch.Generator().manual_seed(0)
    kernel = model_module.native()
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(4, 33, 64, generator=g) * 3).to(dtype)
        ref, ours = LlamaRMSNorm(64, eps=1e-5).to(dtype), RMSNorm(64, 1e-5).to(dtype)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(64, generator=g))
            ours.weight.copy_(ref.weight)
            if dtype == torch.float32 and kernel is not None:
                native = ours(x)
                assert torch.equal(native, kernel.rms_norm(x, ours.weight, 1e-5))
                assert torch.allclose(native, ref(x), rtol=1e-5, atol=1e-6)
                monkeypatch.setattr(model_module, "native", lambda: None)
            assert torch.equal(ours(x), ref(x)), dtype
            monkeypatch.undo()

    hf = tiny_hf("llama")
    cfg = ours_from_hf(hf).cfg
    cos, sin = LlamaModel.rope_tables(cfg)
    positions = torch.randint(0, cfg.max_position, (2, 5), generator=g)
    q = torch.randn(2, 5, 3, cfg.head_dim, generator=g).bfloat16()  # [B, T, heads, D]
    freqs = positions[..., None].float() * cfg.inv_freq()  # the reference tables, built here
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), emb.cos().bfloat16(), emb.sin().bfloat16())
    c, s = cos[positions].bfloat16().unsqueeze(2), sin[positions].bfloat16().unsqueeze(2)
    assert torch.equal(_rope(q, c, s), ref_q.transpose(1, 2))


def test_auto_dtype_is_the_measured_faster_one_where_the_cpu_has_no_native_bf16(monkeypatch):
    """--dtype auto: fp32 for quantized weights (the kernels take fp32), bf16 on a CPU with native
    bf16, and elsewhere whichever dtype ran the timed linear layers faster, measured once; a bad
    name fails before any of it."""
    from specsot_mq import loader
    from specsot_mq.errors import SpecSotError

    cpu = torch.device("cpu")
    measured = loader.faster_cpu_dtype(runs=1)
    assert measured in (torch.float32, torch.bfloat16)
    timed = loader.faster_cpu_dtype.cache_info().misses
    loader.faster_cpu_dtype(runs=1)
    assert loader.faster_cpu_dtype.cache_info().misses == timed  # measured once per process
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(loader, "faster_cpu_dtype", lambda: measured)
    assert loader.resolve_dtype("auto", cpu) == measured
    monkeypatch.setattr(loader, "faster_cpu_dtype", lambda: torch.float32)  # what another CPU might measure
    assert loader.resolve_dtype("auto", cpu) == torch.float32
    assert loader.resolve_dtype("auto", cpu, quantized=True) == torch.float32
    assert loader.resolve_dtype("bf16", cpu) == torch.bfloat16
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)

    def untimed():
        raise AssertionError("native bf16: nothing is timed")

    monkeypatch.setattr(loader, "faster_cpu_dtype", untimed)
    assert loader.resolve_dtype("auto", cpu) == torch.bfloat16
    with pytest.raises(SpecSotError, match="unknown dtype 'fp8'"):
        loader.check_dtype("fp8")
