"""One Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on plain torch.

A forward takes token ids [B, T], the KV cache and a `Step` (each row's slot and where its new
entries go, rope positions, an optional boolean attention mask, which logits and hidden states to
return). Per-step inputs are arguments, never state on the module.

Speed on CPU comes from: q/k/v and gate/up fused into one matmul each, the attention scale folded
into the q projection, torch's fused attention reading the cache in place (in bf16 1.1-2.8x faster
than attention as two matmuls at the shapes decoding uses; `benchmarks/attention.py`),
and, after `prepack()`, weights reordered once for oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specsot_mq import cuda_graphs, cuda_kernels
from specsot_mq.config import ModelConfig
from specsot_mq.kv_cache import KVCache
from specsot_mq.quant import GROUP, QEmbedding, QLinear, QWeight, linear_forward, native, onto_huge_pages, set_prefetch


class Linear(nn.Linear):
    """nn.Linear that can use a oneDNN-prepacked copy of its weight on CPU (inference only)."""

    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        w = self.weight.detach()
        if w.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return  # no oneDNN bf16 kernels on this CPU (AVX2 only): F.linear it is
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and not torch.is_grad_enabled():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, glu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x) (an RMSNorm), or silu(first half) * second half of x (glu), through the layer,
        plus residual: what a decoder layer does around its linears, written once here so that
        QLinear can run each of them as one native call."""
        return linear_forward(self, x, norm, glu, residual)


class RMSNorm(nn.Module):
    folded = False  # its weight multiplies the linear layer after it instead (LlamaModel.prepack on a GPU)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reference implementation's roundings: normalised in fp32, rounded to the input dtype,
        # then the weight. torch's fused kernel without a weight computes exactly the first part
        # (bit for bit, in bf16 and fp32); with the weight inside it would round once, which made
        # the shipped head accept less in bf16 (benchmarks/HISTORY.md).
        kernel = _native_for(x)
        if kernel is not None and x.shape[-1] % 8 == 0:
            # float32 on a CPU with the kernels: the norm they run inside a layer and after the
            # last one (decoder_layers), the same bits whichever runs it
            return kernel.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x, x.shape[-1:], None, self.eps)
        return normed if self.folded else self.weight * normed


@dataclass(slots=True)
class Step:
    """What one forward computes: where each row's new tokens go and what comes back (one record
    per step, as SGLang's per-step inputs; the slot manager, slots.py, says where slots end)."""

    slots: list[int]  # the cache slot of each row
    starts: list[int]  # where each row's new entries go in its slot (a slot named again: after its previous row's)
    positions: torch.Tensor  # [B, T] rope positions of the new tokens
    # True = may attend: [B, T, T] relates the new tokens to each other (a draft tree) while each row
    # sees its slot's entries before its start; [B, T, K], K = max(starts) + T, gives every query's
    # full view. None: causal
    mask: torch.Tensor | None = None
    # the flattened rows (b * T + t) whose logits to compute, in order; None: all. [] (none): the
    # forward ends after the last layer whose hidden state is asked for (the later layers' cache
    # entries are not written), as a router or a draft head's training reads an earlier layer
    logit_rows: list[int] | None = None
    # hidden states to return, counted as transformers counts `output_hidden_states` (0 = embeddings,
    # i = output of layer i, num_layers = after the final norm), for every position
    hidden_layers: tuple[int, ...] = ()
    # where each row may read its slot's shared prefix from, and that prefix's length (0: only its
    # own slot; SlotManager.prefix_sources); None: every row reads its own slot
    sources: tuple[list[int], list[int]] | None = None
    # > 0: the forward starts at this layer (the model's counting), its input the hidden state
    # entering it [B, T, H], the earlier layers' cache entries written already (a prompt the router
    # ran half way, sot/learned_router.py)
    from_layer: int = 0

    @classmethod
    def fresh(cls, positions: torch.Tensor, **fields) -> "Step":
        """Row b in empty slot b (a forward from the start of every slot)."""
        b = positions.shape[0]
        return cls(list(range(b)), [0] * b, positions, **fields)


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [B, T, vocab], or [R, vocab] for Step.logit_rows
    hidden: list[torch.Tensor]  # the hidden states asked for, in the order asked


class NativeForm(nn.Module):
    """A module whose form for the native kernels (`_native_form()`, None where they cannot run it)
    is worked out once, by native_form(): setting an attribute (a swapped linear) or moving the
    module forgets it."""

    def native_form(self):
        if "_native" not in self.__dict__:
            self.__dict__["_native"] = self._native_form()
        return self.__dict__["_native"]

    @staticmethod
    def forget_all(module: nn.Module) -> None:
        """Forget the native forms of every NativeForm in `module` (they hold its weights' tensors:
        before those move, quant.onto_huge_pages)."""
        for m in module.modules():
            m.__dict__.pop("_native", None)

    def __setattr__(self, name, value):
        self.__dict__.pop("_native", None)
        super().__setattr__(name, value)

    def _apply(self, *args, **kwargs):
        self.__dict__.pop("_native", None)
        return super()._apply(*args, **kwargs)

    def _native_form(self):
        raise NotImplementedError


class DecoderLayer(NativeForm):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(h, cfg.rms_eps)
        self.qkv = Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=cfg.qkv_bias)
        self.o = Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_eps) if cfg.qk_norm else None
        self.post_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_up = Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)

    def native_weights(self):
        """The layer's weights as the native kernels' `Layer`, where they can run the whole layer
        (decoder_layers): every linear quantized with the kernels, no biases but q/k/v's (Qwen2),
        no q/k norms."""
        return self.native_form()

    def _native_form(self):
        linears = (self.qkv, self.o, self.gate_up, self.down)
        kernel = native()
        if kernel is None or self.q_norm is not None or self.cfg.head_dim % 8 or not all(
            isinstance(m, QLinear) and m.parts is not None and m.out_features % GROUP == 0 for m in linears
        ) or any(m.bias is not None for m in linears[1:]):
            return None
        qkv, o, gate_up, down = (m.native_weights() for m in linears)
        first, second = (self.input_norm.weight, self.input_norm.eps), (self.post_norm.weight, self.post_norm.eps)
        return kernel.Layer(*first, qkv, o, *second, gate_up, down, self.cfg.num_heads, self.cfg.num_kv_heads,
                            self.qkv.bias)

    def _kernel(self, x: torch.Tensor, cache, slots):
        """The native kernels where they run this layer's parts on x, else None."""
        # (slots as a tensor: a captured step's, cuda_graphs.py: torch ops, or the fused kernels on a GPU)
        if self.q_norm is None and isinstance(cache, KVCache) and not torch.is_tensor(slots):
            return _native_for(x)
        return None

    def runs_whole(self, x: torch.Tensor, cache, slots) -> bool:
        """Whether forward runs the whole layer in one native call (where bias None means causal,
        each row seeing its slot's entries up to its own: LlamaModel.forward's stack)."""
        return self._kernel(x, cache, slots) is not None and self.native_weights() is not None

    def forward(self, x, cos, sin, cache: KVCache, layer: int, slots, starts, kv_len, bias):
        cfg = self.cfg
        b, t, _ = x.shape
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kernel = self._kernel(x, cache, slots)
        if kernel is not None and (weights := self.native_weights()) is not None:
            # the whole layer in one native call: the same steps as below, with no Python between
            return kernel.decoder_layers(x, [weights], layer, cos, sin, cache.k, cache.v, slots, starts, bias, [])[0]
        qkv = self.qkv(x, norm=self.input_norm)
        fused = torch.is_tensor(slots) and self.q_norm is None and _fused_for(x, d)
        if kernel is not None and d % 8 == 0:
            # rope, the cache write and attention in one native call, each row's sums in one
            # fixed order (see attention())
            attended = kernel.attend_cached(qkv, cos, sin, cache.k[layer], cache.v[layer], slots, starts, bias, nh, nkv)
        elif fused:  # a captured step on a GPU: rope and the cache write in one kernel (cuda_kernels.py)
            q = cuda_kernels.rope_store(qkv, cos, sin, cache.kv[:, layer], slots, starts, nh, nkv)
            attended = attention(q, *cache.view(layer, slots, kv_len), bias)
        else:
            qkv = qkv.view(b, t, nh + 2 * nkv, d)
            v = qkv[:, :, nh + nkv :]
            if self.q_norm is not None:
                q, k = _rope(self.q_norm(qkv[:, :, :nh]), cos, sin), _rope(self.k_norm(qkv[:, :, nh : nh + nkv]), cos, sin)
            else:  # q and k rotated in one go
                qk = _rope(qkv[:, :, : nh + nkv], cos, sin)
                q, k = qk[:, :, :nh], qk[:, :, nh:]
            cache.write(layer, slots, starts, k.transpose(1, 2), v.transpose(1, 2))
            keys, values = cache.view(layer, slots, kv_len)
            attended = attention(q, keys, values, bias)
        x = self.o(attended, residual=x)
        if fused:
            return self.down(cuda_kernels.silu_mul(self.gate_up(x, norm=self.post_norm)), residual=x)
        return self.down(self.gate_up(x, norm=self.post_norm), glu=True, residual=x)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention of q [B, T, H, D] (the scale folded in) over keys and values
    [B, KV, K, D] (strided views of the cache are read in place), under attention_bias()'s bias
    (None with T > 1: causal, every row from its slot's start, so K = T);
    returns [B, T, H * D]. torch's fused kernel runs with the q heads that share a kv head laid out
    as rows of one head: no repeated keys, and faster on CPU than torch's own grouped-query path
    (benchmarks/attention.py). In float32 on a CPU the native kernel runs it instead: each query
    row's sums run over its visible keys in cache order, so a row computes the same bits in a
    one-token step as in a tree verify (what keeps speculative decoding on quantized weights,
    where a last-bit difference can flip an int8 rounding, lossless)."""
    kernel = _native_for(q)
    if kernel is not None and q.shape[-1] % 8 == 0:
        return kernel.attention(q, keys, values, bias)
    if q.is_cuda and not cuda_graphs.capturing():
        # An eager step on a GPU: its shapes change from step to step, and cuDNN's attention makes
        # a plan for each new shape (tens of ms, the H100 run in benchmarks/HISTORY.md); the flash
        # and memory-efficient kernels need none. A captured step keeps the default, planned once.
        with sdpa_kernel(_UNPLANNED):
            return _sdpa(q, keys, values, bias)
    return _sdpa(q, keys, values, bias)


_UNPLANNED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b, t, h, d = q.shape
    if bias is None and t > 1:  # causal from the slots' start (a GPU's prefill): the fused kernels' own mask
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True, scale=1.0, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, h * d)
    kv = keys.shape[1]
    g = h // kv
    q = q.reshape(b, t, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # an fp16 cache (cache_dtype) read with grad on
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=1.0)
    return out.view(b, kv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)


def cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for activations in `dtype`: float16 where the native attention runs
    them (float32 on a CPU with the kernels; it reads fp16 keys and values at half the bytes, and
    rounds what it stores to nearest even), else the activations' own."""
    if dtype == torch.float32 and torch.device(device).type == "cpu" and native() is not None:
        return torch.float16
    return dtype


def _fused_for(x: torch.Tensor, head_dim: int) -> bool:
    """Whether cuda_kernels runs a captured step's rope, cache write and gate on x (inference only)."""
    return not torch.is_grad_enabled() and head_dim & (head_dim - 1) == 0 and cuda_kernels.available(x.device)


def _native_for(x: torch.Tensor):
    """The native kernels where they run x: float32 on the CPU, inference only (no backward)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled():
        return native()
    return None


def rope_at(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, 1, D] at positions [B, T] from rope_tables' tables, in `dtype`."""
    b, t = positions.shape
    at = positions.reshape(-1)
    cos = cos_table.index_select(0, at).view(b, t, 1, -1).to(dtype)
    return cos, sin_table.index_select(0, at).view(b, t, 1, -1).to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on x [B, T, heads, D] with cos and sign-folded sin [B, T, 1, D]
    (rope_tables): x * cos + [-x2, x1] * sin, written as [x2, x1] * [-sin1, sin2], the same bits
    with one kernel fewer."""
    half = x.shape[-1] // 2
    turned = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    if x.is_cuda:  # one kernel fewer; on a CPU its fused multiply-add would round as the row count falls
        return torch.addcmul(x * cos, turned, sin)
    return x * cos + turned * sin


class LlamaModel(NativeForm):
    """The decoder, or a contiguous range of its layers (split.py's split_layers): a range that
    does not begin at layer 0 takes the hidden state before its first layer [B, T, H] instead of
    token ids, one that does not end at the last layer returns the hidden state after its own last
    layer (as hidden state `last_layer`) and no logits, and its cache holds its own layers."""

    first_layer = 0  # the model's index of self.layers[0] (split_layers sets it on a range)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # given its weight, nn.Embedding skips its random init: on the meta device that init imports
        # torch._dynamo (torch's compiler stack, resident from then on in every process that loads a model)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = self.rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_position, head_dim] in fp32, indexed by position at each forward; the
        first half of sin is negated, as _rope wants it."""
        with torch.device("cpu"):  # also when the model is being built on the meta device
            freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float), cfg.inv_freq())
            return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)

    @property
    def last_layer(self) -> int:
        """One past the model's index of this range's last layer (cfg.num_layers: the whole model's end)."""
        return self.first_layer + len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (quantized weights keep their own)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def use_quantized(self, weights: dict[str, QWeight | list[QWeight]], dtype: torch.dtype) -> None:
        """Swap the linear layers named in `weights` ('layers.3.qkv', 'lm_head', 'embed') for
        QLinear over those blocks; a tied embedding reads the output layer's rows."""
        made: dict[int, QLinear] = {}
        for name, blocks in weights.items():
            parent, _, attr = name.rpartition(".")
            owner = self.get_submodule(parent) if parent else self
            if id(blocks) not in made:
                bias = getattr(owner, attr).bias if attr != "embed" else None
                made[id(blocks)] = QLinear(blocks, None if bias is None or bias.is_meta else bias, dtype)
            layer = made[id(blocks)]
            setattr(owner, attr, QEmbedding(layer) if attr == "embed" else layer)

    def prepack(self) -> "LlamaModel":
        """Ready for inference on its device. On a CPU: every float linear weight reordered once
        for oneDNN, the quantized ones gathered onto huge pages (quant.onto_huge_pages) and their
        kernels' prefetch for few rows set by whether they fit the CPU's cache (quant.set_prefetch). On a GPU,
        where a step is its kernel launches: each layer's two norms folded into the linear layer
        after them (the norm's weight scales that layer's input columns), two kernels a layer
        fewer."""
        if self.device.type == "cpu":
            if torch.backends.mkldnn.is_available():
                for m in self.modules():
                    if isinstance(m, Linear):
                        m.prepack()
            NativeForm.forget_all(self)
            onto_huge_pages(self)
            set_prefetch(self)
        elif self.device.type == "cuda":
            for layer in self.layers:
                for norm, linear in ((layer.input_norm, layer.qkv), (layer.post_norm, layer.gate_up)):
                    if isinstance(linear, Linear) and not norm.folded:
                        w = linear.weight
                        w.data.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
                        norm.weight.data.fill_(1.0)  # the state stays what it computes (a head's start reads it)
                        norm.folded = True
        return self

    def native_stack(self, x: torch.Tensor, cache: KVCache) -> list | None:
        """Every layer's native weights, where the kernels can run all of them on x in one call."""
        if _native_for(x) is None or not isinstance(cache, KVCache):
            return None
        stack = [layer.native_weights() for layer in self.layers]
        return None if any(layer is None for layer in stack) else stack

    def attends_in_place(self, cache: KVCache) -> bool:
        """Whether forwards over `cache` run every layer in the one native call, whose attention
        reads each row's keys where they lie: rows of one slot then cost what rows of their own
        do (the torch path gathers a copy of the slot for every row). layout.py runs causal rows of
        different lengths as a token per batch row only then."""
        return self.native_stack(torch.empty(0, dtype=self.dtype, device=self.device), cache) is not None

    def native_head(self):
        """The final norm and output layer as the native kernels' `Head`, where decoder_layers can run
        them after the last layer (a quantized output layer without bias)."""
        return self.native_form()

    def _native_form(self):
        lm, kernel = self.lm_head, native()
        ok = kernel is not None and isinstance(lm, QLinear) and lm.parts is not None and lm.bias is None
        if not (ok and lm.out_features % GROUP == 0 and self.cfg.hidden_size % 32 == 0):
            return None
        return kernel.Head(self.norm.weight, self.norm.eps, lm.native_weights())

    def new_cache(self, num_slots: int, capacity: int, dtype: torch.dtype | None = None,
                  graphs: bool | None = None) -> KVCache:  # fmt: skip
        """A cache of `num_slots` sequences of up to `capacity` tokens, in `dtype` (default:
        cache_dtype's choice for this model); `graphs`: whether steps over it replay captured CUDA
        graphs (default: on CUDA, cuda_graphs.wanted; on a CPU the same steps run uncaptured)."""
        dtype = dtype or cache_dtype(self.dtype, self.device)
        cfg = self.cfg
        return cuda_graphs.new_cache(len(self.layers), num_slots, cfg.num_kv_heads, capacity, cfg.head_dim, dtype,
                                     self.device, graphs)  # fmt: skip

    def forward(self, input_ids: torch.Tensor, cache: KVCache, step: Step) -> ForwardOutput:
        """Run the decoder over new tokens input_ids [B, T] (a range after the first: the hidden
        state before its first layer, [B, T, H]), writing their keys and values into the cache
        where `step` says, and return the logits and hidden states it asks for (a range before the
        last: no logits; hidden states are counted in the whole model's layers). Over a cache with
        CUDA graphs, a step whose shape fits one replays it (cuda_graphs.py)."""
        if getattr(cache, "graphs", None) is not None and (out := cuda_graphs.replay(self, cache, input_ids, step)):
            return out
        b, t = input_ids.shape[:2]
        first = self.first_layer
        slots, starts = step.slots, step.starts
        kv_len = max(starts) + t
        cfg = self.cfg
        dev = self.device  # (a caller may make the step's tensors on the host)
        input_ids, mask = input_ids.to(dev), None if step.mask is None else step.mask.to(dev)
        cos, sin = self._rope(step.positions.to(dev))
        rows = step.logit_rows

        want = set(step.hidden_layers)
        depth = len(self.layers)  # the layers to run: [skip, depth) of this range's
        if rows == [] and want and 0 < max(want) - first < depth:
            depth = max(want) - first
        skip = max(step.from_layer - first, 0)
        saved = {}
        x = (self.embed(input_ids) if first == 0 and not skip else input_ids).to(self.dtype)
        stack = self.native_stack(x, cache)
        window_ok = cfg.sliding_window is None or kv_len <= cfg.sliding_window
        if stack is not None and mask is None and window_ok:
            bias = None  # causal: the native attention sees each row's keys by its start (Placement)
        elif x.device.type == "cuda" and mask is None and window_ok and not any(starts):
            bias = None  # causal from position 0 (a prefill): SDPA's own causal mask (attention())
        else:
            bias = attention_bias(mask, starts, t, kv_len, cfg.sliding_window, cfg.q_per_kv, self.dtype, self.device)
        if stack is not None:
            # every layer in one native call, with one team of threads (decoder_layers), and the
            # final norm and output layer in it too where the kernels run them
            inner = sorted(i - first - skip for i in want if first + skip <= i < first + depth)
            head = self.native_head() if depth == len(self.layers) and self.last_layer == cfg.num_layers else None
            picked = (list(range(b * t)) if rows is None else rows) if head is not None else []
            x, *kept = native().decoder_layers(x, stack[skip:depth], skip, cos, sin, cache.k, cache.v, slots, starts,
                                               bias, inner, head, picked, *(step.sources or ([], [])))  # fmt: skip
            logits = kept.pop(0) if head is not None else None  # with a head, its logits follow the state
            saved.update(zip((first + skip + i for i in inner), kept))
            if head is not None:
                saved[self.cfg.num_layers] = x  # through the final norm
                logits = logits.view(b, t, -1) if rows is None else logits  # [R, V] already
                return ForwardOutput(logits, [saved[i] for i in step.hidden_layers])
        else:
            x = self._layers(x, cos, sin, cache, slots, starts, kv_len, bias, want, depth, saved, skip)
        if first + depth < cfg.num_layers:  # stopped early, or a range before the last: no logits
            saved[first + depth] = x
            return ForwardOutput(x.new_zeros(0, self.cfg.vocab_size), [saved[i] for i in step.hidden_layers])
        return self._head(x, rows, step.hidden_layers, saved)

    def forward_static(self, ids, positions, slots, starts, mask, keys: int, cache: KVCache,
                       hidden_layers: tuple[int, ...]) -> ForwardOutput:  # fmt: skip
        """The whole model's forward as a captured step runs it (cuda_graphs.py), every per-step
        value a tensor on the device: ids and positions [B, T], each row's slot and start [B], a
        mask [B, T, T] over the new tokens (each row also sees its slot's entries before its
        start); `keys` cache entries attended per row; logits for every row."""
        cos, sin = self._rope(positions)
        bias = static_bias(mask, starts, keys, self.cfg.q_per_kv, self.dtype)
        at = starts[:, None] + torch.arange(ids.shape[1], device=ids.device)  # where each new entry goes, [B, T]
        saved = {}
        x = self._layers(self.embed(ids).to(self.dtype), cos, sin, cache, slots, at, keys, bias, set(hidden_layers),
                         len(self.layers), saved)  # fmt: skip
        return self._head(x, None, hidden_layers, saved)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_at(self.rope_cos, self.rope_sin, positions, self.dtype)

    def _layers(self, x, cos, sin, cache, slots, starts, kv_len, bias, want: set[int], depth: int, saved: dict,
                skip: int = 0):  # fmt: skip
        """Layers [skip, depth) in torch ops (the hidden states in `want` kept in `saved`)."""
        for i, layer in enumerate(self.layers[skip:depth], skip):
            if self.first_layer + i in want:
                saved[self.first_layer + i] = x
            x = layer(x, cos, sin, cache, i, slots, starts, kv_len, bias)
        return x

    def _head(self, x, rows: list[int] | None, hidden_layers, saved: dict) -> ForwardOutput:
        """The final norm and the output layer after the last layer. The norm runs on every
        position, so hidden state num_layers (EAGLE features) covers every position like the other
        layers do; only the logits are for the rows asked."""
        x = self.norm(x)
        saved[self.cfg.num_layers] = x
        if rows is not None:
            x = x.reshape(-1, x.shape[-1])[rows]
        return ForwardOutput(self.lm_head(x), [saved[i] for i in hidden_layers])


def static_bias(mask: torch.Tensor, starts: torch.Tensor, keys: int, groups: int, dtype) -> torch.Tensor:
    """attention_bias() of a [B, T, T] mask from tensors alone (a captured step's): [B, 1,
    groups * T, keys], each row seeing its slot's entries before its start and, among the T after,
    what the mask says."""
    b, t, _ = mask.shape
    rel = torch.arange(keys, device=mask.device)[None, None, :] - starts[:, None, None]  # key's place among the new
    inside = mask.gather(2, rel.clamp(0, t - 1).expand(b, t, keys)) & (rel < t)
    allowed = (rel < 0) | inside
    bias = torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, float("-inf"))
    return bias.repeat(1, groups, 1)[:, None]


def attention_bias(mask, starts, t, kv_len, window, groups, dtype, device) -> torch.Tensor | None:
    """Additive attention bias [B, 1, groups * T, K] (0 or -inf), built once per forward for all
    layers: the rows of one kv head's query group (`groups` q heads x T tokens) repeat the T rows.

    mask: None (causal, within the sliding window if any), [B, T, T] over the new tokens (each row
    also sees its whole cached prefix), or [B, T, K] over every cache entry. See LlamaModel.forward.
    """
    b = len(starts)
    if mask is None and len(set(starts)) == 1 and t == 1 and (window is None or kv_len <= window):
        return None  # one new token per row at the same length: every cached entry is visible
    start = torch.tensor(starts, device=device)[:, None, None]
    key = torch.arange(kv_len, device=device)[None, None, :]
    query = start + torch.arange(t, device=device)[None, :, None]  # cache index of each query
    if mask is None:
        allowed = key <= query
        if window is not None:
            allowed &= query - key < window
    elif tuple(mask.shape) == (b, t, kv_len):
        allowed = mask.to(torch.bool)
    elif tuple(mask.shape) == (b, t, t):
        # New-token mask: each row sees its own cache, then the mask over its T new entries.
        cols = (start + torch.arange(t, device=device)[None, None, :]).expand(b, t, t)
        allowed = (key < start).expand(b, t, kv_len).clone().scatter_(2, cols, mask.to(torch.bool))
    else:
        raise ValueError(f"mask must be [B, T, T] = {[b, t, t]} or [B, T, K] = {[b, t, kv_len]}, got {list(mask.shape)}")
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return bias.repeat(1, groups, 1)[:, None]
