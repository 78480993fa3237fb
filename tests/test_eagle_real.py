"""The shipped draft head on the real default model (fp32): speculative greedy output equals
plain greedy output token for token, and the head actually gets tokens accepted."""

import pytest
import torch

from specsot_mq.draft import DraftHead
from specsot_mq.generate import Generator
from specsot_mq.loader import load_model, resolve_draft
from specsot_mq.sampling import SamplingParams
from specsot_mq.speculative import TreeParams
from specsot_mq.tokenizer import chat_prompt_ids, load_tokenizer
from test_real_model import mt_bench_first_turns

pytestmark = pytest.mark.slow


def test_shipped_head_is_small_and_found_by_default(default_model_dir):
    path = resolve_draft("auto", default_model_dir)
    assert path is not None and path.stat().st_size <= 20 * 2**20
    assert resolve_draft("none", default_model_dir) is None


def test_a_draft_path_that_is_no_head_fails_before_any_model_is_loaded(default_model_dir, monkeypatch):
    from specsot_mq import loader
    from specsot_mq.errors import SpecSotError

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the draft head was checked")

    monkeypatch.setattr(loader, "load_model", no_loading)
    with pytest.raises(SpecSotError, match=f"draft head {__file__} cannot be read"):
        loader.load_generator(str(default_model_dir), draft=__file__)


def test_eagle_greedy_equals_plain_greedy_on_mt_bench(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    model = load_model(default_model_dir, dtype=torch.float32)
    head = DraftHead.load(resolve_draft("auto", default_model_dir), model).prepack()
    plain = Generator(model, tokenizer, max_len=1024)
    # A larger branching tree than the default: trees are the harder case for exactness. Every
    # step drafts (no SpeedChooser), so tau is the head's.
    tree = TreeParams(num_draft_tokens=12, depth=5, topk=4, adaptive=False)
    eagle = Generator(model, tokenizer, max_len=1024, draft=head, tree=tree)
    params = SamplingParams(max_tokens=128)
    taus, copied = [], 0
    for question in mt_bench_first_turns(5):
        ids = chat_prompt_ids(tokenizer, question)
        want = plain.generate(ids, params).token_ids
        decoder = eagle.new_decoder(params)
        got = eagle.generate(ids, params, decoder=decoder)
        assert got.token_ids == want, question[:60]
        taus.append(got.tau)
        copied += decoder.stats.lookup_accepted
    assert sum(taus) / len(taus) > 1.3  # the head is trained: it gets drafts accepted
    assert copied > 0  # and the trees' prompt-lookup paths (on by default) got tokens accepted too


def test_the_heads_causal_forward_needs_no_bias_on_the_native_kernels(default_model_dir):
    """With no mask (a draft_extend, a chain) the head's layer runs with no bias tensor, causal by
    each row's start, as the base's native stack does: the same bits as with the causal bias."""
    from specsot_mq.model import Step, attention_bias

    model = load_model(default_model_dir, dtype=torch.float32)
    head = DraftHead.load(resolve_draft("auto", default_model_dir), model).prepack()
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (2, 5))
    feats = torch.randn(2, 5, len(head.cfg.feature_layers) * model.cfg.hidden_size)
    step = Step([0, 1], [3, 0], torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]]))
    outs = []
    for forced in (False, True):
        cache = head.new_cache(2, 16)
        torch.manual_seed(1)
        cache.k.normal_(), cache.v.normal_()  # an earlier prefix in slot 0 (entries 0-2), the same both times
        if forced:  # the bias attention_bias builds for a causal step, handed to the layer
            real = head.layer.forward
            bias = attention_bias(None, step.starts, 5, 8, None, head.layer.cfg.q_per_kv, head.dtype, head.device)
            head.layer.forward = lambda x, cos, sin, c, layer, slots, starts, kv_len, _: real(x, cos, sin, c, layer, slots, starts, kv_len, bias)
        with torch.inference_mode():
            outs.append(head(tokens, feats, cache, step))
        head.layer.__dict__.pop("forward", None)
    with torch.inference_mode():  # the no-bias path is the one that ran
        assert head.layer.runs_whole(torch.zeros(1, 1, model.cfg.hidden_size), head.new_cache(1, 4), [0])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
