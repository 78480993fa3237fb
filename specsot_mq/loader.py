"""Load a Hugging Face-format model folder (config.json + safetensors) into our LlamaModel, with
quantized weights (kept from a GGUF file by the converter, or quantized at load) in QLinear layers."""

from __future__ import annotations

import functools
import gc
import json
import math
import time
from pathlib import Path

import torch
from safetensors import safe_open

from specsot_mq.config import ModelConfig
from specsot_mq.decode_params import check_quantize
from specsot_mq.errors import SpecSotError
from specsot_mq.gguf_convert import PACKED_METADATA
from specsot_mq.model import LlamaModel
from specsot_mq import quant
from specsot_mq.quant import FORMATS, KINDS, QWeight, fuse
from specsot_mq.split import PREFILL_CHUNK


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: one model.safetensors or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f.name for f in files if not f.exists()]
    if not files or missing:
        raise SpecSotError(
            f"{folder} has no complete safetensors weights (missing: {', '.join(missing) or '*.safetensors'}): "
            "re-pull the model or point --model at a complete folder"
        )
    return files


def read_state_dict(folder: Path, dequantize: bool = False) -> dict[str, torch.Tensor | QWeight]:
    """The folder's weights by Hugging Face name: tensors, and QWeight for the quantized ones
    (float32 tensors instead with `dequantize`, e.g. for a transformers reference)."""
    state = {}
    for f in weight_files(folder):
        try:
            with safe_open(f, framework="pt") as st:
                packed = json.loads((st.metadata() or {}).get(PACKED_METADATA, "{}"))
                for name in st.keys():
                    tensor = st.get_tensor(name)  # a view of the file, mapped
                    if name in packed:  # copied once by prepack (onto_huge_pages), the mapping then let go
                        kind, rows, cols = packed[name]
                        state[name] = QWeight(FORMATS[kind], rows, cols, tensor)
                        if dequantize:
                            state[name] = state[name].dequantize()
                    else:  # norms and biases would keep the whole mapping resident
                        state[name] = tensor.clone()
        except Exception as e:  # safetensors raises several types for a damaged file
            raise SpecSotError(f"{f} cannot be read ({e}): the file is damaged; re-pull the model") from None
    return state


def transformers_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' own model of a folder, quantized weights dequantized to `dtype`: the
    reference that tests and benchmarks compare against."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.load_state_dict(read_state_dict(Path(folder), dequantize=True), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def _cat(parts: list) -> torch.Tensor | list[QWeight]:
    if any(isinstance(p, QWeight) for p in parts):  # a file may quantize some and not others
        return fuse([p if isinstance(p, QWeight) else quant.quantize(p, "Q8_0") for p in parts])
    return torch.cat(parts)


def _scaled(w: torch.Tensor | QWeight, s: float) -> torch.Tensor | QWeight:
    return w.scaled(s) if isinstance(w, QWeight) else w * s


def hf_to_ours(state: dict[str, torch.Tensor | QWeight], cfg: ModelConfig,
               layers: tuple[int, int] | None = None) -> dict[str, torch.Tensor | QWeight]:  # fmt: skip
    """Rename Hugging Face weights to ours, fusing q/k/v and gate/up, and folding the attention
    scale 1/sqrt(head_dim) into the q projection (or the q norm, which comes after it).
    Quantized weights (QWeight) stay quantized; a fused projection is a list of parts. `layers`
    [first, last): only those layers' weights (the embedding with the first, the output layer with
    the last; the final norm always); (0, 0): no layer, the embedding and the output layer alone."""
    scale = 1.0 / math.sqrt(cfg.head_dim)
    first, last = layers or (0, cfg.num_layers)
    out = {"norm.weight": state["model.norm.weight"]}
    if first == 0:
        out["embed.weight"] = state["model.embed_tokens.weight"]
    if last in (cfg.num_layers, 0):
        out["lm_head.weight"] = state["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
    for i in range(first, last):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        q_scale = 1.0 if cfg.qk_norm else scale
        out[q + "qkv.weight"] = _cat(
            [_scaled(state[a + "q_proj.weight"], q_scale), state[a + "k_proj.weight"], state[a + "v_proj.weight"]]
        )
        if cfg.qkv_bias:
            out[q + "qkv.bias"] = torch.cat(
                [state[a + "q_proj.bias"] * q_scale, state[a + "k_proj.bias"], state[a + "v_proj.bias"]]
            )
        out[q + "o.weight"] = state[a + "o_proj.weight"]
        if cfg.o_bias:
            out[q + "o.bias"] = state[a + "o_proj.bias"]
        if cfg.qk_norm:
            out[q + "q_norm.weight"] = state[a + "q_norm.weight"] * scale
            out[q + "k_norm.weight"] = state[a + "k_norm.weight"]
        out[q + "input_norm.weight"] = state[p + "input_layernorm.weight"]
        out[q + "post_norm.weight"] = state[p + "post_attention_layernorm.weight"]
        out[q + "gate_up.weight"] = _cat([state[m + "gate_proj.weight"], state[m + "up_proj.weight"]])
        out[q + "down.weight"] = state[m + "down_proj.weight"]
        if cfg.mlp_bias:
            out[q + "gate_up.bias"] = torch.cat([state[m + "gate_proj.bias"], state[m + "up_proj.bias"]])
            out[q + "down.bias"] = state[m + "down_proj.bias"]
    return out


_LINEARS = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight")
def runs_quantized(folder: Path, quantize: str, device: torch.device) -> bool:
    """Whether load_model(folder, quantize=quantize) on `device` runs quantized weights."""
    return device.type == "cpu" and (quantize in KINDS or (quantize == "auto" and is_quantized(folder)))


def _quantized_as_asked(weights: dict, quantize: str, device: torch.device) -> dict:
    """'auto' keeps weights as stored; 'none' (and any device but the CPU, where the kernels run)
    dequantizes them; 'int4' / 'int8' quantize a float model's linear layers (the output layer and
    embedding to 8 bits either way, as 4-bit GGUF files keep them)."""
    check_quantize(quantize)
    if quantize == "none" or device.type != "cpu":
        return {k: _dequantized(v) for k, v in weights.items()}
    if quantize == "auto":
        return weights
    out, done = dict(weights), {}
    for name, w in weights.items():
        kind = KINDS[quantize] if name.endswith(_LINEARS) else "Q8_0" if name in ("embed.weight", "lm_head.weight") else None
        if kind and torch.is_tensor(w) and w.dim() == 2 and w.shape[1] % 32 == 0:
            if id(w) not in done:  # a tied embedding and output layer stay one matrix
                done[id(w)] = quant.quantize(w, kind)
            out[name] = done[id(w)]
    return out


def _dequantized(w: torch.Tensor | QWeight | list[QWeight]) -> torch.Tensor:
    if isinstance(w, list):
        return torch.cat([p.dequantize() for p in w])
    return w.dequantize() if isinstance(w, QWeight) else w


def _is_quantized(w) -> bool:
    return isinstance(w, (QWeight, list))


def is_quantized(folder: Path) -> bool:
    """Whether a folder's weights hold quantized tensors (reads the safetensors headers only)."""
    for f in weight_files(folder):
        with safe_open(f, framework="pt") as st:
            if json.loads((st.metadata() or {}).get(PACKED_METADATA, "{}")):
                return True
    return False


def load_model(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    prepack: bool = True,
    quantize: str = "auto",
    layers: tuple[int, int] | None = None,
) -> LlamaModel:
    """Build the model of a Hugging Face-format folder, activations in `dtype` on `device`, ready
    for inference; `quantize` as in _quantized_as_asked (quantized weights run in QLinear).
    `layers` [first, last): only that range of its layers (split.py), the others never loaded;
    (0, 0): no layer, only the embedding and the output layer, which an EAGLE head reads where the
    layers run in range servers (split.SplitModel's edges)."""
    folder = Path(folder)
    device = torch.device(device)
    cfg = ModelConfig.from_folder(folder)
    if layers is not None and layers != (0, 0) and not 0 <= layers[0] < layers[1] <= cfg.num_layers:
        raise SpecSotError(f"layers {layers[0]}:{layers[1]} are not a range of the model's {cfg.num_layers} layers")
    try:
        weights = hf_to_ours(read_state_dict(folder), cfg, layers)
    except KeyError as e:
        raise SpecSotError(f"{folder} lacks weight {e} that its config.json implies: re-pull the model") from None
    weights = _quantized_as_asked(weights, quantize, device)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.load_state_dict({k: v for k, v in weights.items() if torch.is_tensor(v)}, strict=False, assign=True)
    if cfg.tie_embeddings and torch.is_tensor(weights.get("lm_head.weight")) and "embed.weight" in weights:
        model.lm_head.weight = model.embed.weight
    model.use_quantized({k.removesuffix(".weight"): v for k, v in weights.items() if _is_quantized(v)}, dtype)
    if layers == (0, 0):  # the edges alone
        model.layers = torch.nn.ModuleList()
    elif layers is not None:  # the range alone (the other layers were never given weights)
        from specsot_mq.split import split_layers

        bounds = [b for b in ((0, layers[0]), layers, (layers[1], cfg.num_layers)) if b[0] < b[1]]
        model = split_layers(model, bounds)[bounds.index(layers)]
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SpecSotError(f"{folder} lacks weights {missing[:3]}: re-pull the model")
    rope = model.rope_cos, model.rope_sin
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.rope_cos, model.rope_sin = rope[0].to(device), rope[1].to(device)  # rope stays fp32
    return model.prepack() if prepack else model


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def check_dtype(dtype: str) -> None:
    """A bad --dtype fails here, before a model is pulled."""
    if dtype != "auto" and dtype not in DTYPES:
        raise SpecSotError(f"unknown dtype '{dtype}': use auto, bf16 or fp32")


def resolve_dtype(dtype: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """The activations' dtype. 'auto': bf16 on CUDA; on a CPU float32 with quantized weights (the
    kernels take float32), else bf16 where the CPU has native bf16 (AVX-512 BF16 / AMX), else
    whichever of the two runs widened linear layers faster on this CPU (faster_cpu_dtype)."""
    check_dtype(dtype)
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if quantized:
            return torch.float32
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else faster_cpu_dtype()
    return DTYPES[dtype]


@functools.cache
def faster_cpu_dtype(runs: int = 3) -> torch.dtype:
    """bf16 or fp32, whichever runs a widened model's linear layers faster on this CPU, timed once
    per process (a few tenths of a second). On a CPU without native bf16 a bf16 weight is
    converted as it is read: half the bytes of fp32, and the conversions' cost; which wins depends
    on the CPU and the rows. So both run what decoding runs: a one-row step and a 6-row verify
    through six 4096 x 1024 linear layers (96 MB in fp32, more than a CPU's caches hold, as a
    model's weights are), the way the model's Linear runs them; the lower sum of the two wins."""
    from specsot_mq.model import Linear

    seconds = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            layers = []
            for _ in range(6):
                layer = torch.nn.utils.skip_init(Linear, 1024, 4096, bias=False, dtype=dtype)
                layer.weight.fill_(0.01)  # the values do not change the time
                layer.prepack()
                layers.append(layer)
            total = 0.0
            for rows in (1, 6):
                x = torch.randn(rows, 1024, dtype=dtype)
                best = math.inf
                for _ in range(runs + 1):  # the first pass warms up
                    start = time.perf_counter()
                    for layer in layers:
                        layer.linear(x)
                    best = min(best, time.perf_counter() - start)
                total += best
            seconds[dtype] = total
    return min(seconds, key=seconds.get)


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SpecSotError(f"unknown device '{device}': use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecSotError(f"device '{device}' asked for but this machine has no CUDA GPU: use --device cpu")
    return dev


SHIPPED_DRAFTS = Path(__file__).parent / "drafts"


def resolve_draft(draft: str | None, model_folder: Path) -> Path | None:
    """'none' -> no draft; 'auto' (or None) -> the head shipped with the project for this model, or
    one trained into the cache by `specsot train-draft`, else none; anything else is a path."""
    from specsot_mq.pull import specsot_home

    if draft == "none":
        return None
    if draft in (None, "auto"):
        name = f"{model_folder.name}.safetensors"
        return next((p for p in (SHIPPED_DRAFTS / name, specsot_home() / "drafts" / name) if p.is_file()), None)
    path = Path(draft).expanduser()
    if not path.is_file():
        raise SpecSotError(f"draft head {path} not found: pass a .safetensors head, 'auto' or 'none'")
    from specsot_mq.draft import DraftConfig

    DraftConfig.read(path)  # a file that is no head fails now, before a model is loaded
    return path


def load_generator(
    model: str | None = None,
    dtype: str = "auto",
    device: str | None = None,
    max_len: int = 4096,
    num_slots: int = 1,
    draft: str | None = "auto",
    tree=None,
    quantize: str = "auto",
    prefix_cache_mb: int = 256,
    ranges: list[dict[str, str]] | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
):
    """The model named or given by path (pulled if it is a known name not yet cached), its
    tokenizer, its EAGLE draft head (see resolve_draft), and a Generator with caches of
    `max_len` positions for `num_slots` sequences and a prefix store of `prefix_cache_mb`;
    quantize: see load_model. tree: TreeParams (default TreeParams(), whose
    prompt lookup also drafts for a model without a head; TreeParams(lookup=0) there decodes
    plainly). `ranges`: the range servers (remote_range.py) that hold the model's layers: for each
    range in order, its servers (replicas) as {name: address}. This process then holds no layer
    and runs the model through them (a prompt longer than `prefill_chunk` tokens prefilled in
    pieces of that many, pipelined: split.SplitModel); with a draft head it holds a copy of the
    embedding and the output layer, which the head reads, and the features come from the ranges."""
    from specsot_mq.draft import DraftHead
    from specsot_mq.generate import Generator
    from specsot_mq.pull import resolve_model
    from specsot_mq.speculative import TreeParams
    from specsot_mq.tokenizer import load_tokenizer

    dev = resolve_device(device)
    check_dtype(dtype)  # a bad flag fails before a model is pulled
    check_quantize(quantize)
    if max_len < 1:
        raise SpecSotError(f"--max-len must be at least 1 token, got {max_len}")
    folder = resolve_model(model)
    activations = resolve_dtype(dtype, dev, runs_quantized(folder, quantize, dev))
    draft_path = resolve_draft(draft, folder)
    if ranges:
        from specsot_mq.remote_range import RemoteRange
        from specsot_mq.split import SplitModel

        cfg = ModelConfig.from_folder(folder)
        # a long prefill over a slow range takes minutes; a range that dies is seen at once (RemoteRange)
        parts = [RemoteRange(list(servers.values()), cfg, activations, dev, timeout_s=600, name=list(servers))
                 for servers in ranges]  # fmt: skip
        # an EAGLE head reads the embedding and the output layer: a copy of them here (the edges)
        edges = load_model(folder, dtype=activations, device=dev, quantize=quantize, layers=(0, 0)) if draft_path else None
        net = SplitModel(parts, prefill_chunk, edges)
    else:
        net = load_model(folder, dtype=activations, device=dev, quantize=quantize)
    head = DraftHead.load(draft_path, net).prepack() if draft_path else None
    gen = Generator(net, load_tokenizer(folder), max_len=max_len, num_slots=num_slots, draft=head,
                    tree=tree or TreeParams(), prefix_cache_mb=prefix_cache_mb)  # fmt: skip
    settle()
    return gen


def settle() -> None:
    """What loading made lives as long as the process (the tokenizer's vocabulary and merges, the
    model's modules: hundreds of thousands of objects). Frozen, the garbage collector stops walking
    them in each full collection (tens of ms, in the middle of some answer's step). Call it once
    the model, tokenizer and head are loaded (load_generator does)."""
    gc.collect()
    gc.freeze()
