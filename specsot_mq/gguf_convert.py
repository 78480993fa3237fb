"""Convert a Llama-family GGUF file (llama, which Mistral's files use too, qwen2, qwen3) into a
Hugging Face-format model folder that keeps the file's quantized weights.

The folder holds `config.json`, `generation_config.json`, the tokenizer files (with the file's chat
template) and one `model.safetensors` with Hugging Face tensor names. Float tensors keep their
dtype (F32, F16, BF16; norms and biases as float32); a quantized tensor of one of the kernels'
types (gguf_blocks.FORMATS) is stored packed for them (uint8 [groups, records, bytes]), its type and
logical shape in the file's metadata (`PACKED_METADATA`), read back by `specsot_mq.loader`. Other
quantized types are converted to Q8_0, with one line saying so and what it costs.
"""

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .errors import SpecSotError
from .gguf_blocks import FORMATS, GROUP, pack_ggml
from .gguf_tokenizer import byte_level_tokenizer

# GGUF architecture -> (transformers class, model_type, whether llama.cpp permuted q/k for its rope)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# Per-layer GGUF tensor names (blk.N.<key>.<weight|bias>) -> Hugging Face names under model.layers.N.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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
PACKED_METADATA = "specsot.packed"  # safetensors metadata key: {name: [ggml type, rows, cols]}
_FLOAT_TYPES = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2)}  # GGUF type -> safetensors dtype, bytes
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3 rope: a factor per frequency, not a model weight


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # slowest-first, as numpy and Hugging Face list them (GGUF stores fastest-first)
    n_bytes: int
    data: np.ndarray  # a view of the file: floats as their dtype, quantized blocks as uint8 [rows, bytes]


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (key -> int, float, bool, str, or a list / numpy array of them) and
    tensors, their data views of the file mapped into memory.

    gguf's own GGUFReader makes a numpy view of every value (a file's 49k-151k tokens and as many
    merges: 7.2 s for the default model's file, on 2 cores); this walks the header once with struct
    (0.31 s)."""

    fields: dict
    tensors: list[GGUFTensor]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}  # fmt: skip


def _read_gguf(path: Path) -> GGUFFile:
    buf = np.memmap(path, mode="r")
    view = memoryview(buf)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, view, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(view[pos - n : pos]).decode("utf-8")

    def value(kind: int):
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            inner, n = take("I"), take("Q")
            if inner in _SCALARS:  # numbers: one array
                dtype = np.dtype("<" + _SCALARS[inner])
                out = np.frombuffer(view, dtype, n, pos)
                pos += n * dtype.itemsize
                return out
            return [value(inner) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind} at byte {pos}")
        return take(_SCALARS[kind])

    if bytes(view[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    pos = 4
    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (a big-endian file, or one older than version 2)")
    n_tensors, n_fields = take("Q"), take("Q")
    fields = {}
    for _ in range(n_fields):
        key = string()
        fields[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, GGMLQuantizationType(take("I")), dims, take("Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-pos // align) * align
    tensors = []
    for name, kind, dims, offset in infos:
        shape = tuple(reversed(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = math.prod(dims) * size // block
        if start + offset + n_bytes > len(buf):
            raise ValueError(f"tensor {name} ends past the end of the file (truncated?)")
        data = buf[start + offset : start + offset + n_bytes]
        if kind.name in _FLOAT_DTYPES:
            data = data.view(_FLOAT_DTYPES[kind.name]).reshape(shape)
        else:  # blocks (BF16 too, as gguf's reader gives it): bytes per row
            data = data.reshape(*shape[:-1], shape[-1] // block * size)
        tensors.append(GGUFTensor(name, kind, shape, n_bytes, data))
    return GGUFFile(fields, tensors)


def open_gguf(path: Path) -> GGUFFile:
    """Open a GGUF file for reading, raising SpecSotError when it cannot be parsed."""
    try:
        return _read_gguf(path)
    # A damaged file fails in many ways (bad magic, truncated arrays, bad offsets); every one of
    # them means the same thing to the user.
    except Exception as exc:
        raise SpecSotError(
            f"{path} is corrupt or not a GGUF file ({exc}): delete it and download it again"
        ) from exc


def gguf_architecture(reader: GGUFFile, path: Path) -> str:
    """Return the file's `general.architecture` (for example "llama")."""
    return _meta(reader, path, "general.architecture")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a Hugging Face-format folder at `out_dir` from the GGUF at `gguf_path` (never modified).

    Quantized weights keep their blocks, packed; llama.cpp's rotary permutation of a llama file's
    q and k projections is undone (on rows, which quantization blocks never span), so the layout
    matches the original checkpoint's.
    """
    gguf_path = Path(gguf_path)
    reader = open_gguf(gguf_path)
    arch = gguf_architecture(reader, gguf_path)
    if arch not in ARCHITECTURES:
        raise SpecSotError(
            f"{gguf_path.name} holds a '{arch}' model, which the GGUF converter does not support: "
            f"use a {'/'.join(SUPPORTED_ARCHITECTURES)} GGUF (Mistral's files are llama) or a Hugging Face-format folder"
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
        save_tokenizer(reader, gguf_path, out_dir)
    write_weights(reader, gguf_path, config, out_dir / "model.safetensors", console)


def llama_config(reader: GGUFFile, path: Path) -> dict:
    """Build a transformers `config.json` dict (Llama, Qwen2 or Qwen3) from the GGUF metadata."""
    arch = gguf_architecture(reader, path)
    hf_class, model_type, _ = ARCHITECTURES[arch]

    def meta(key, default=_REQUIRED):
        return _meta(reader, path, f"{arch}.{key}", default)

    hidden = meta("embedding_length")
    n_head = meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // n_head)
    rope_theta = float(meta("rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = meta("rope.scaling.type", "none")
    tensors = {t.name: t for t in reader.tensors}
    if ROPE_FREQS in tensors:
        rope = _llama3_rope(np.asarray(tensors[ROPE_FREQS].data, np.float32), rope_theta, head_dim, path)
    elif scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": rope_theta, "factor": float(meta("rope.scaling.factor"))}
    elif scaling != "none":
        raise SpecSotError(f"{path.name} uses '{scaling}' rope scaling, which is not supported: use a model "
                           "with default, linear or Llama 3 rope")  # fmt: skip
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SpecSotError(
            f"{path.name} has no tokenizer (tokenizer.ggml.tokens): use a GGUF that embeds one"
        )
    names = set(tensors)
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": meta("attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        # transformers 4.x reads rope_theta / rope_scaling, 5.x reads rope_parameters; write both.
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "vocab_size": _embedding_rows(tensors["token_embd.weight"]),
        "bos_token_id": _meta(reader, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _meta(reader, path, "tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "mlp_bias": False,
        # As with rope: 4.x reads torch_dtype, 5.x reads dtype (and warns on torch_dtype alone).
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    pad = _meta(reader, path, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        config["pad_token_id"] = pad
    return config


def _embedding_rows(tensor) -> int:
    return tensor.shape[0]


def _llama3_rope(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict:
    """Llama 3's rope parameters from llama.cpp's rope_freqs (it keeps only the factor each
    frequency is divided by). Only low_freq_factor and high_freq_factor over the original context
    shape the curve, so the context is taken as 8192 (Llama 3's) and the two factors solved from
    the frequencies between the bounds, where the factor moves linearly in 1 / wavelength."""
    from .config import ModelConfig

    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv / (2 * math.pi)  # 1 / wavelength
    top = float(factors.max())
    smooth = (1 / factors - 1 / top) / (1 - 1 / top) if top > 1 else np.ones_like(x)
    middle = (factors < top * (1 - 1e-6)) & (factors > 1 + 1e-6)
    if middle.sum() >= 2:  # smooth = (x - a) / (b - a): a line through the middle points
        slope, intercept = np.polyfit(x[middle], smooth[middle], 1)
        a = -intercept / slope
        b = a + 1 / slope
    else:  # no curve to fit: bounds between the frequencies scaled fully and those left alone
        full, none = x[factors >= top * (1 - 1e-6)], x[factors <= 1 + 1e-6]
        a = (full.max() + (none.min() if none.size else 2 * full.max())) / 2 if full.size else 0.0
        b = a
    old = 8192
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": top, "low_freq_factor": round(float(a * old), 4),
            "high_freq_factor": round(float(max(b, a * (1 + 1e-6)) * old), 4), "original_max_position_embeddings": old}  # fmt: skip
    shape = dict(vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1, num_heads=1, num_kv_heads=1,
                 head_dim=head_dim, rope_theta=theta)  # fmt: skip
    scaled, plain = ModelConfig(**shape, rope_scaling=rope).inv_freq(), ModelConfig(**shape).inv_freq()
    if not np.allclose((plain / scaled).numpy(), factors, rtol=1e-3):
        raise SpecSotError(f"{path.name} scales its rope by per-frequency factors that follow no Llama 3 rope: "
                           "use a Hugging Face-format folder of this model")  # fmt: skip
    return rope


def save_tokenizer(reader: GGUFFile, gguf_path: Path, out_dir: Path) -> None:
    """Save the GGUF's tokenizer and chat template as Hugging Face tokenizer files in `out_dir`: a
    byte-level BPE vocabulary built here (gguf_tokenizer), any other through transformers."""
    if reader.fields.get("tokenizer.ggml.model") == "gpt2":
        tokenizer, config = byte_level_tokenizer(reader.fields, gguf_path.name)
        tokenizer.save(str(out_dir / "tokenizer.json"))
        _write_json(out_dir / "tokenizer_config.json", config)
        return
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
    reader: GGUFFile, path: Path, config: dict, out_path: Path, console: Console
) -> None:
    """Stream every tensor into one safetensors file at `out_path`: float ones in their dtype,
    quantized ones packed (see the module docstring).

    Tensors are written one at a time, so peak memory scales with the largest tensor, not the
    whole model.
    """
    plan = []  # (gguf tensor, hf name, logical shape, stored type), in file order
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        # GGUF lists dimensions fastest-first; Hugging Face (and numpy) want them slowest-first.
        shape = list(tensor.shape)
        kind = tensor.tensor_type.name
        if len(shape) != 2 or kind in ("F32",):
            stored = "F32"
        elif kind in _FLOAT_TYPES or kind in FORMATS:
            stored = kind
        else:
            stored = "Q8_0"  # a type the kernels do not run: converted (see _convert_note)
        plan.append((tensor, hf_tensor_name(tensor.name, path), shape, stored))
    _convert_note(plan, path, console)

    packed = {name: [stored, *shape] for t, name, shape, stored in plan if stored in FORMATS}
    # The metadata marks the file as torch-flavoured; some transformers versions insist on it.
    header = {"__metadata__": {"format": "pt", PACKED_METADATA: json.dumps(packed)}}
    offset = 0
    for tensor, name, shape, stored in plan:
        if stored in FORMATS:
            fmt = FORMATS[stored]
            dims = [-(-shape[0] // GROUP), shape[1] // fmt.inputs, GROUP * fmt.column_bytes]
            dtype = "U8"
        else:
            dims, dtype = shape, _FLOAT_TYPES[stored][0]
        size = math.prod(dims) * (1 if dtype == "U8" else _FLOAT_TYPES[stored][1])
        header[name] = {"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format wants the data 8-byte aligned

    columns = (
        TextColumn("Converting weights"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )
    permuted = ARCHITECTURES[gguf_architecture(reader, path)][2]
    with open(out_path, "wb") as out, Progress(*columns, console=console) as bar:
        out.write(len(header_bytes).to_bytes(8, "little"))
        out.write(header_bytes)
        task = bar.add_task("weights", total=len(plan))
        for tensor, name, shape, stored in plan:
            kind = tensor.tensor_type.name
            if kind == stored and stored not in ("F32",):
                weight = np.asarray(tensor.data).view(np.uint8).reshape(shape[0], -1)  # its own bytes
            elif stored == "Q8_0":
                weight = quantize(_float(tensor, shape), GGMLQuantizationType.Q8_0).reshape(shape[0], -1)
            else:
                weight = _float(tensor, shape)
            if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                weight = unpermute_rope(weight.reshape(shape[0], -1), config["num_attention_heads"])
            elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                weight = unpermute_rope(weight.reshape(shape[0], -1), config["num_key_value_heads"])
            if stored in FORMATS:
                weight = pack_ggml(weight, stored, tuple(shape))
            out.write(np.ascontiguousarray(weight).data)
            bar.advance(task)


def _float(tensor, shape: list[int]) -> np.ndarray:
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)


def _convert_note(plan: list, path: Path, console: Console) -> None:
    """One line for the tensors of a type the kernels do not run (Q2_K, Q3_K, IQ*): they become
    Q8_0, and what that costs in bytes."""
    converted = [(t, shape) for t, _, shape, stored in plan if stored == "Q8_0" and t.tensor_type.name != "Q8_0"]
    if not converted:
        return
    kinds = sorted({t.tensor_type.name for t, _ in converted})
    before = sum(int(t.n_bytes) for t, _ in converted)
    after = sum(shape[0] * shape[1] // 32 * 34 for _, shape in converted)
    print(f"specsot: {path.name}: {len(converted)} {'/'.join(kinds)} tensors run as Q8_0 (the native kernels run "
          f"{', '.join(FORMATS)}): {before / 2**20:.0f} MB become {after / 2**20:.0f} MB; a Q4_K_M or Q5_K_M "
          "file runs at its own size", file=sys.stderr)  # fmt: skip


def hf_tensor_name(gguf_name: str, path: Path) -> str:
    """Map a GGUF tensor name (e.g. `blk.3.attn_q.weight`) to its Hugging Face name."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if suffix in ("weight", "bias") and len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if suffix == "weight" and base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.weight"
    raise SpecSotError(
        f"{path.name} has a tensor '{gguf_name}' the converter does not know: "
        f"use a plain {'/'.join(SUPPORTED_ARCHITECTURES)} GGUF or a Hugging Face-format folder"
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


def _meta(reader: GGUFFile, path: Path, key: str, default=_REQUIRED):
    """One metadata value; a missing one is the default, or an error naming it."""
    if key not in reader.fields:
        if default is _REQUIRED:
            raise SpecSotError(
                f"{path.name} lacks the GGUF metadata '{key}': the file is corrupt or incomplete; "
                "download it again"
            )
        return default
    return reader.fields[key]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
