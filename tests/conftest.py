"""Shared fixtures: tiny random models of each supported architecture, and the real default model."""

import pytest
import torch

from specsot_mq.config import ModelConfig
from specsot_mq.loader import hf_to_ours
from specsot_mq.model import LlamaModel

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_hf(arch: str, **overrides):
    """A random transformers model (fp32, eval) of the given architecture."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    config = config_cls(**{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so those code paths are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_from_hf(hf_model, prepack: bool = False) -> LlamaModel:
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    model = LlamaModel(cfg)
    missing, unexpected = model.load_state_dict(hf_to_ours(hf_model.state_dict(), cfg), strict=False)
    assert not unexpected and all(k.startswith("rope") for k in missing), (missing, unexpected)
    model.eval().requires_grad_(False)
    return model.prepack() if prepack else model


def fresh_home(path):
    """An empty $SPECSOT_HOME (no run files, models or routers) whose compiled kernels are the real
    cache's: a process started there loads them, where building them again takes a minute."""
    from specsot_mq.pull import specsot_home

    kernels = specsot_home() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "kernels").exists():
        (path / "kernels").symlink_to(kernels, target_is_directory=True)
    return path


@pytest.fixture(scope="session")
def default_model_dir():
    """The real default model, pulled into the cache on first use."""
    from specsot_mq.pull import resolve_model

    return resolve_model(None)
