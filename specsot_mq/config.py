"""Model configuration: one dataclass for the whole Llama family, read from a Hugging Face config.json.

Llama, Mistral, Qwen2 and Qwen3 differ only in switches here (qkv bias, q/k norm, tied embeddings,
sliding window, head_dim), so one model implementation serves all of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specsot_mq.errors import SpecSotError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(slots=True)
class ModelConfig:
    """Shape and switches of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None (default rope), or {"rope_type": "linear"|"llama3", ...}
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None = None  # Mistral
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise SpecSotError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}) in config.json"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3"):
            raise SpecSotError(
                f"rope scaling type '{rope_type}' is not supported: use a model with default, "
                "linear or llama3 rope"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed Hugging Face config.json."""
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs and hf.get("model_type") in SUPPORTED_ARCHITECTURES.values():
            arch = hf["model_type"]
        if arch is None:
            raise SpecSotError(
                f"unsupported architecture {archs or hf.get('model_type', '(none given)')}: SpecSoT runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} models"
            )
        # transformers 5 folds rope settings into `rope_parameters`; older files use rope_theta/rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = hf.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            window = None
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position=hf.get("max_position_embeddings", 4096),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2" or hf.get("attention_bias", False),
            o_bias=arch == "llama" and hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=arch == "qwen3",
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except FileNotFoundError:
            raise SpecSotError(f"{path} not found: a model folder needs config.json") from None
        except (json.JSONDecodeError, KeyError) as e:
            raise SpecSotError(f"{path} is not a usable model config ({e!r}): re-pull or fix the file") from None

    def inv_freq(self) -> torch.Tensor:
        """Rope inverse frequencies, with linear or llama3 scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", "default")
        if kind == "linear":
            return inv / scaling["factor"]
        if kind == "llama3":
            factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
            smooth = (old_len / wavelen - lo) / (hi - lo)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
            return torch.where(is_mid, mid, scaled)
        return inv
