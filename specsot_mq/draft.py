"""The EAGLE draft head: one decoder layer of the base model's own code, fed with base features.

At position i the head reads [embedding of token i+1 ; base feature(s) at position i] through a
fully connected layer into one decoder layer, whose output is its guess of the base feature at
position i+1; the base output layer restricted to a reduced draft vocabulary turns that guess into
draft logits for token i+2. The head reuses the base embedding and the base output layer's rows
(nothing of them is stored); it owns only fc, the layer, and the map from draft to base ids.

`feature_layers` names the base hidden states fed in (counted as transformers counts
`output_hidden_states`): EAGLE-1 uses the last one (after the final norm). An EAGLE-3-style head
names several (low, middle, high, then the last): each is RMS-normalised (the middle layers carry
activations in the tens of thousands) and `fuse` maps them together to one feature. The head's own
output is always its guess of the last one, and a deeper draft step reads that guess in place of
the fused base features (so fc always takes [embedding; one feature]).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from specsot_mq import cuda_graphs
from specsot_mq.config import ModelConfig
from specsot_mq.errors import SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.model import DecoderLayer, Linear, LlamaModel, NativeForm, Step, attention_bias, rope_at, static_bias
from specsot_mq.quant import QLinear, onto_huge_pages, quantize

FORMAT = "specsot-eagle-1"


@dataclass(slots=True)
class DraftConfig:
    """What a draft checkpoint carries besides its weights."""

    layer: dict  # ModelConfig fields of the one decoder layer (the base's, with num_layers=1)
    feature_layers: tuple[int, ...]  # base hidden states fed in, transformers counting
    draft_vocab_size: int  # rows of the draft output layer
    base_vocab_size: int
    training: dict | None = None  # how the head was made (command, data, time, tau), for people

    def layer_config(self) -> ModelConfig:
        return ModelConfig(**self.layer)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)})

    @classmethod
    def read(cls, path: str | Path) -> "DraftConfig":
        """The config of a saved head, without its weights."""
        try:
            with safe_open(str(path), framework="numpy") as f:  # the header alone
                return cls.from_json((f.metadata() or {}).get("config", "{}"))
        except (OSError, ValueError, SafetensorError) as e:  # (json's errors are ValueErrors)
            raise SpecSotError(f"draft head {path} cannot be read ({e}): pass a head that train-draft wrote, "
                               "--draft none, or retrain it") from None  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> "DraftConfig":
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise SpecSotError(f"not a {FORMAT} checkpoint: train one with `specsot train-draft`")
        data["feature_layers"] = tuple(data["feature_layers"])
        return cls(**data)

    @classmethod
    def for_base(cls, base: ModelConfig, draft_vocab_size: int, feature_layers: tuple[int, ...] | None = None):
        layer = {f: getattr(base, f) for f in ModelConfig.__slots__}
        layer["num_layers"] = 1
        layer["eos_token_ids"] = list(base.eos_token_ids)
        return cls(layer, feature_layers or (base.num_layers,), draft_vocab_size, base.vocab_size)


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        lc = cfg.layer_config()
        h = lc.hidden_size
        n = len(cfg.feature_layers)
        self.hidden_size = h
        self.fuse = Linear(n * h, h, bias=False) if n > 1 else None
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(lc)
        # Draft id -> base id. Filled from training data (the most frequent tokens first).
        # (on the CPU also when the head is built on the meta device: arange there goes through
        # torch's reference decompositions, whose first use imports sympy: benchmarks/startup.py)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size, device="cpu"), persistent=True)
        cos, sin = LlamaModel.rope_tables(lc)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.embed: nn.Embedding | None = None  # the base's, set by attach()
        self.lm_head: Linear | None = None  # base output rows at d2t, set by attach()

    def attach(self, base: LlamaModel) -> "DraftHead":
        """Share the base embedding and build the draft output layer from the base's rows."""
        if base.cfg.vocab_size != self.cfg.base_vocab_size or base.cfg.hidden_size != self.cfg.layer["hidden_size"]:
            raise SpecSotError(
                "this draft head was trained for another base model (vocabulary or hidden size differ): "
                "pass --draft none or train one with `specsot train-draft`"
            )
        object.__setattr__(self, "embed", base.embed)  # not a submodule: not saved, not trained
        if isinstance(base.lm_head, QLinear) and base.lm_head.parts is not None:
            head = base.lm_head.select(self.d2t)
        else:  # a float layer, or a QLinear without the kernels (its weight dequantized)
            head = Linear(base.cfg.hidden_size, self.cfg.draft_vocab_size, bias=False)
            head.weight = nn.Parameter(base.lm_head.weight.detach()[self.d2t].clone(), requires_grad=False)
        object.__setattr__(self, "lm_head", head)
        return self

    @property
    def device(self) -> torch.device:
        return self.layer.input_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (quantized layers keep their own)."""
        return self.layer.input_norm.weight.dtype

    def prepack(self) -> "DraftHead":
        """Ready for CPU inference: beside a base whose output layer runs the quantized kernels,
        the head's own linears are quantized to 8 bits too (a draft step reads a quarter of the
        bytes: benchmarks/HISTORY.md; drafts are only proposals, verified by the base), else
        reordered for oneDNN."""
        quantized = isinstance(self.lm_head, QLinear) and self.lm_head.parts is not None
        if self.device.type != "cpu":
            return self
        for owner, name in ((self, "fuse"), (self, "fc"), (self.layer, "qkv"), (self.layer, "o"),
                            (self.layer, "gate_up"), (self.layer, "down"), (self, "lm_head")):  # fmt: skip
            m = getattr(owner, name)
            if not isinstance(m, Linear):
                continue
            if quantized and m.in_features % 32 == 0:
                setattr(owner, name, QLinear(quantize(m.weight.float(), "Q8_0"), m.bias))
            elif torch.backends.mkldnn.is_available():
                m.prepack()
        NativeForm.forget_all(self)
        onto_huge_pages(self)
        return self

    def new_cache(self, num_slots: int, capacity: int, graphs: bool | None = None) -> KVCache:
        """The head's own cache; `graphs` as in LlamaModel.new_cache (default: on CUDA, the
        head's steps replay captured graphs: cuda_graphs.replay_head)."""
        cfg = self.cfg.layer_config()
        return cuda_graphs.new_cache(cfg.num_layers, num_slots, cfg.num_kv_heads, capacity, cfg.head_dim, self.dtype,
                                     self.device, graphs)  # fmt: skip

    def _input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer's input: fc over [the tokens' embeddings; the features], base features fused
        first (their layers RMS-normalised, then one linear)."""
        features = features.to(self.dtype)
        if self.fuse is not None and features.shape[-1] != self.hidden_size:
            parts = features.unflatten(-1, (len(self.cfg.feature_layers), -1))
            features = self.fuse(F.rms_norm(parts, parts.shape[-1:]).flatten(-2))
        return self.fc(torch.cat([self.embed(tokens).to(self.dtype), features], dim=-1))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache, step: Step):
        """tokens [B, T] (base ids of token i+1), features at i: base features [B, T, F*H] or
        the head's own predictions [B, T, H]; where they go and what comes back as in
        LlamaModel.forward. Returns (predicted last-layer features [B, T, H], draft logits
        [B, T, draft_vocab], or [R, draft_vocab] of step.logit_rows)."""
        if getattr(cache, "graphs", None) is not None and (out := cuda_graphs.replay_head(self, cache, tokens, features, step)):
            return out
        b, t = tokens.shape
        kv_len = max(step.starts) + t
        cos, sin = rope_at(self.rope_cos, self.rope_sin, step.positions.to(self.device), self.dtype)
        x = self._input(tokens, features)
        if step.mask is None and self.layer.runs_whole(x, cache, step.slots):
            bias = None  # causal, by each row's start: no bias to build (as the base's native stack)
        else:
            bias = attention_bias(step.mask, step.starts, t, kv_len, None, self.layer.cfg.q_per_kv, self.dtype, self.device)
        hidden = self.layer(x, cos, sin, cache, 0, step.slots, step.starts, kv_len, bias)
        if step.logit_rows is not None:
            return hidden, self.lm_head(hidden.reshape(b * t, -1)[step.logit_rows])
        return hidden, self.lm_head(hidden)

    def forward_static(self, ids, positions, slots, starts, mask, keys: int, cache: KVCache, features):
        """forward as a captured step runs it (cuda_graphs.replay_head): every per-step value a
        tensor on the device, as in LlamaModel.forward_static; (hidden, logits) for every row."""
        cos, sin = rope_at(self.rope_cos, self.rope_sin, positions, self.dtype)
        bias = static_bias(mask, starts, keys, self.layer.cfg.q_per_kv, self.dtype)
        entries = starts[:, None] + torch.arange(ids.shape[1], device=ids.device)  # where each new entry goes, [B, T]
        hidden = self.layer(self._input(ids, features), cos, sin, cache, 0, slots, entries, keys, bias)
        return hidden, self.lm_head(hidden)

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Weights (bf16, to stay small) and config in one safetensors file."""
        state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in self.state_dict().items()}  # fmt: skip
        save_file(state, str(path), metadata={"config": self.cfg.to_json()})

    @classmethod
    def load(cls, path: str | Path, base: LlamaModel) -> "DraftHead":
        """A saved head, attached to `base`, in the base's dtype and device."""
        cfg = DraftConfig.read(path)
        state = load_file(str(path))
        with torch.device("meta"):
            head = cls(cfg)
        head.load_state_dict(state, strict=False, assign=True)
        head = head.to(device=base.device, dtype=base.dtype).eval().requires_grad_(False)
        cos, sin = LlamaModel.rope_tables(cfg.layer_config())  # rope stays fp32
        head.rope_cos, head.rope_sin = cos.to(base.device), sin.to(base.device)
        head.d2t = head.d2t.to(device=base.device, dtype=torch.long)
        return head.attach(base)
