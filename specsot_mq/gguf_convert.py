"""Convert a llama-architecture GGUF file into a Hugging Face-format model folder that keeps the
file's quantized weights.

The folder holds `config.json`, `generation_config.json`, the tokenizer files and one
`model.safetensors` with Hugging Face tensor names. Float tensors are stored as float32; a quantized
tensor keeps its GGUF blocks as bytes (uint8 [rows, bytes per row]), its GGUF type and logical
shape in the file's metadata (`QUANT_METADATA`), read back by `specsot_mq.loader`.
"""

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .errors import SpecSotError

SUPPORTED_ARCHITECTURES = ("llama",)

# Per-layer GGUF tensor names (blk.N.<key>.weight) -> Hugging Face names under model.layers.N.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_REQUIRED = object()
QUANT_METADATA = "specsot.quantized"  # safetensors metadata key: {name: [ggml type, rows, cols]}
_FLOAT_TYPES = ("F32", "F16", "BF16")


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file for reading, raising SpecSotError when it cannot be parsed."""
    try:
        return GGUFReader(path)
    # The reader fails in many ways on a damaged file (bad magic, truncated arrays, bad offsets);
    # every one of them means the same thing to the user.
    except Exception as exc:
        raise SpecSotError(
            f"{path} is corrupt or not a GGUF file ({exc}): delete it and download it again"
        ) from exc


def gguf_architecture(reader: GGUFReader, path: Path) -> str:
    """Return the file's `general.architecture` (for example "llama")."""
    return _meta(reader, path, "general.architecture")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a Hugging Face-format Llama folder at `out_dir` from the GGUF at `gguf_path`.

    Quantized weights keep their blocks; llama.cpp's rotary permutation of the q and k projections
    is undone (on rows, which quantization blocks never span), so the layout matches the original
    checkpoint's.
    """
    gguf_path = Path(gguf_path)
    reader = open_gguf(gguf_path)
    arch = gguf_architecture(reader, gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecSotError(
            f"{gguf_path.name} holds a '{arch}' model, which the GGUF converter does not support: "
            f"use a {'/'.join(SUPPORTED_ARCHITECTURES)} GGUF or a Hugging Face-format folder"
        )
    config = llama_config(reader, gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    generation_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {key: config[key] for key in generation_keys if key in config}
    _write_json(out_dir / "generation_config.json", generation)
    console = Console(stderr=True, quiet=not progress)
    with console.status("Converting the tokenizer"):
        save_tokenizer(gguf_path, out_dir)
    write_weights(reader, gguf_path, config, out_dir / "model.safetensors", console)


def llama_config(reader: GGUFReader, path: Path) -> dict:
    """Build a LlamaForCausalLM `config.json` dict from the GGUF metadata."""
    arch = gguf_architecture(reader, path)

    def meta(key, default=_REQUIRED):
        return _meta(reader, path, f"{arch}.{key}", default)

    hidden = meta("embedding_length")
    n_head = meta("attention.head_count")
    rope_theta = float(meta("rope.freq_base", 10000.0))
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SpecSotError(
            f"{path.name} has no tokenizer (tokenizer.ggml.tokens): use a GGUF that embeds one"
        )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": meta("attention.head_count_kv", n_head),
        "head_dim": meta("attention.key_length", hidden // n_head),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        # transformers 4.x reads rope_theta, 5.x reads rope_parameters; write both.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "vocab_size": len(tokens.data),
        "bos_token_id": _meta(reader, path, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, path, "tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # As with rope: 4.x reads torch_dtype, 5.x reads dtype (and warns on torch_dtype alone).
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    pad = _meta(reader, path, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        config["pad_token_id"] = pad
    return config


def save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Save the GGUF's tokenizer and chat template as Hugging Face tokenizer files in `out_dir`."""
    from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes its own class name and keeps the template in chat_template.jinja;
    # the generic class name and an inline template also load with transformers 4.x.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template and "chat_template" not in tokenizer_config:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    _write_json(config_path, tokenizer_config)


def write_weights(
    reader: GGUFReader, path: Path, config: dict, out_path: Path, console: Console
) -> None:
    """Stream every tensor into one safetensors file at `out_path`: float ones as float32,
    quantized ones as their GGUF blocks (see the module docstring).

    Tensors are written one at a time, so peak memory scales with the largest tensor, not the
    whole model.
    """
    plan = []  # (gguf tensor, hf name, logical shape, quantized), in file order
    for tensor in reader.tensors:
        # GGUF lists dimensions fastest-first; Hugging Face (and numpy) want them slowest-first.
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        quantized = tensor.tensor_type.name not in _FLOAT_TYPES and len(shape) == 2
        plan.append((tensor, hf_tensor_name(tensor.name, path), shape, quantized))

    quant = {name: [t.tensor_type.name, *shape] for t, name, shape, q in plan if q}
    # The metadata marks the file as torch-flavoured; some transformers versions insist on it.
    header = {"__metadata__": {"format": "pt", QUANT_METADATA: json.dumps(quant)}}
    offset = 0
    for tensor, name, shape, quantized in plan:
        if quantized:
            stored, dtype, size = [shape[0], tensor.n_bytes // shape[0]], "U8", tensor.n_bytes
        else:
            stored, dtype, size = shape, "F32", 4 * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": stored, "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format wants the data 8-byte aligned

    columns = (
        TextColumn("Converting weights"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )
    with open(out_path, "wb") as out, Progress(*columns, console=console) as bar:
        out.write(len(header_bytes).to_bytes(8, "little"))
        out.write(header_bytes)
        task = bar.add_task("weights", total=len(plan))
        for tensor, name, shape, quantized in plan:
            if quantized:
                weight = np.asarray(tensor.data, dtype=np.uint8).reshape(shape[0], -1)
            else:
                weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
                weight = weight.reshape(shape)
            if name.endswith("self_attn.q_proj.weight"):
                weight = unpermute_rope(weight, config["num_attention_heads"])
            elif name.endswith("self_attn.k_proj.weight"):
                weight = unpermute_rope(weight, config["num_key_value_heads"])
            out.write(np.ascontiguousarray(weight).data)
            bar.advance(task)


def hf_tensor_name(gguf_name: str, path: Path) -> str:
    """Map a llama GGUF tensor name (e.g. `blk.3.attn_q.weight`) to its Hugging Face name."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if suffix == "weight" and len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    if suffix == "weight" and base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.weight"
    raise SpecSotError(
        f"{path.name} has a tensor '{gguf_name}' the llama converter does not know: "
        "use a plain llama GGUF or a Hugging Face-format folder"
    )


def unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (it interleaves each head's two rotary halves).

    llama.cpp stores `w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)`; swapping the same axes back
    on the `(n_head, d/2, 2, in)` view restores the original row order.
    """
    out_features, in_features = weight.shape  # rows: output features; columns: inputs or bytes
    head_dim = out_features // n_head
    return (
        weight.reshape(n_head, head_dim // 2, 2, in_features)
        .swapaxes(1, 2)
        .reshape(out_features, in_features)
    )


def _meta(reader: GGUFReader, path: Path, key: str, default=_REQUIRED):
    """Read one scalar or string metadata value; fields are raw numpy parts in the reader."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise SpecSotError(
                f"{path.name} lacks the GGUF metadata '{key}': the file is corrupt or incomplete; "
                "download it again"
            )
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.item()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
