"""GGUF files as users have them: `--model file.gguf` for every Llama-family architecture llama.cpp
writes (llama, with Llama 3's rope factors; qwen2 with q/k/v biases; qwen3 with q/k norms), each
with its own chat template, converted once into the cache by content, the file only read; a file
mixing the K-quant types as Q4_K_M does matches transformers' own GGUF loading; a type the kernels
do not run is converted with one line saying so.

The tiny files are written here with gguf's GGUFWriter, as llama.cpp's converter lays them out (its
q/k rope permutation for llama), carrying the default model's tokenizer.
"""

import hashlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import fresh_home, tiny_hf
from ggml_reference import quantize

from specsot_mq import pull as pull_module
from specsot_mq.errors import SpecSotError
from specsot_mq.gguf_convert import open_gguf, save_tokenizer
from specsot_mq.loader import load_model
from specsot_mq.model import Step
from specsot_mq.pull import DEFAULT_MODEL, download_gguf, resolve_model
from specsot_mq.tokenizer import load_tokenizer

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_fields(tmp_path_factory):
    """The default model's GGUF tokenizer (its vocabulary, merges and chat template)."""
    path = download_gguf(DEFAULT_MODEL, tmp_path_factory.mktemp("default"), progress=False)
    return {k: v for k, v in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSOT_HOME", str(fresh_home(tmp_path / "home")))
    return tmp_path / "home"


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, *rest = hf_name.split(".")
    *module, suffix = rest
    return f"blk.{layer}.{LAYER_NAMES['.'.join(module)]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rope permutation of a llama q/k projection's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_field(writer: gguf.GGUFWriter, key: str, field, value=None) -> None:
    """A field gguf's GGUFReader read, written again (with `value` in place of its own, if given)."""
    value = field.contents() if value is None else value
    writer.add_key_value(key, value, field.types[0], field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)


def write_gguf(path: Path, hf_model, arch: str, tokenizer_fields: dict, types=lambda name: "Q8_0") -> Path:
    """hf_model as a GGUF file of architecture `arch`, its 2-D weights of type types(gguf name)."""
    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    for key, field in tokenizer_fields.items():  # copied as they are
        add_field(writer, key, field)
    if rope.get("rope_type") == "llama3":  # llama.cpp keeps Llama 3's rope as a factor per frequency
        d, theta = c.head_dim, rope["rope_theta"]
        freqs = 1.0 / theta ** (np.arange(0, d, 2) / d)
        lo, hi, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
        factors = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            smooth = (old / wavelen - lo) / (hi - lo)
            factors.append(1.0 if wavelen < old / hi else rope["factor"] if wavelen > old / lo
                           else 1 / ((1 - smooth) / rope["factor"] + smooth))  # fmt: skip
        writer.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if arch == "llama" and "q_proj" in name:
            w = permute(w, c.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            w = permute(w, c.num_key_value_heads)
        g = gguf_name(name)
        if w.ndim == 2:
            kind = types(g)
            writer.add_tensor(g, quantize(w, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(g, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, model.new_cache(1, ids.shape[1]), Step.fresh(torch.arange(ids.shape[1])[None])).logits[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("llama", {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 256, "tie_word_embeddings": False}),
    ("qwen2", {}),
    ("qwen3", {}),
], ids=["llama", "llama3-rope", "qwen2", "qwen3"])  # fmt: skip
def test_each_architecture_runs_from_its_gguf_file(home, tmp_path, tokenizer_fields, arch, overrides):
    """`--model file.gguf` for each architecture: the model computes what the original does (within
    Q8_0's rounding and int8 activations), with the file's tokenizer and chat template."""
    from transformers import AutoTokenizer

    from specsot_mq.tokenizer import load_tokenizer

    hf = tiny_hf(arch, vocab_size=49152, **{**SHAPE, **overrides})
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", hf, arch, tokenizer_fields)
    folder = resolve_model(str(path))
    assert folder.parent == home / "models"
    ours = load_model(folder)
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits[0]
    assert rel(logits_of(ours, ids), want) < 0.03
    template = tokenizer_fields["tokenizer.chat_template"].contents()
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template == template
    tokenizer = load_tokenizer(folder)
    assert tokenizer.encode("Name three rivers.") == AutoTokenizer.from_pretrained(str(folder)).encode("Name three rivers.")


@pytest.mark.slow
def test_a_file_mixing_k_quants_matches_transformers_own_gguf_loading(home, tmp_path, tokenizer_fields):
    """A Q4_K_M-like file (Q4_K, Q6_K for v and down in some layers, Q5_0 and Q8_0 elsewhere, Q5_K
    and Q4_0 too): our model on its own blocks against transformers reading the same file."""
    from transformers import AutoModelForCausalLM

    mix = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
           "ffn_up": "Q4_0", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q5_1"}  # fmt: skip
    hf = tiny_hf("llama", vocab_size=49152, tie_word_embeddings=False, **SHAPE)
    path = write_gguf(tmp_path / "mix.gguf", hf, "llama", tokenizer_fields,
                      types=lambda g: mix[g.split(".")[-2] if g.startswith("blk") else g.split(".")[0]])  # fmt: skip
    ours = load_model(resolve_model(str(path)))
    assert [p.format.name for p in ours.layers[0].qkv.parts] == ["Q4_K", "Q5_K", "Q6_K"]
    assert ours.layers[0].native_weights() is not None  # the whole layer in one native call
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits[0]
    got = logits_of(ours, ids)
    assert rel(got, want) < 0.03
    # the same weights, dequantized: what is left is the fp16 KV cache's rounding
    assert rel(logits_of(load_model(resolve_model(str(path)), quantize="none"), ids), want) < 1e-3


def test_the_conversion_is_cached_by_content_and_the_file_only_read(home, tmp_path, monkeypatch):
    hf = tiny_hf("llama", vocab_size=300, **SHAPE)
    fields = {}  # no tokenizer: the converter must not get that far for a cached file
    path = write_gguf(tmp_path / "a.gguf", hf, "llama", fields)
    with pytest.raises(SpecSotError, match="has no tokenizer"):
        resolve_model(str(path))
    converted = []

    def fake_convert(src, out, progress=True):
        converted.append(src)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(pull_module, "convert_apart", fake_convert)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    stale = home / "models" / f".gguf-a-{before[:12]}.staging-x"  # left by a conversion killed midway
    (stale / "model").mkdir(parents=True)
    first = resolve_model(str(path))
    assert first.name == f"gguf-a-{before[:12]}" and not stale.exists()
    assert resolve_model(str(path)) == first and len(converted) == 1  # a second run starts at once
    copy = tmp_path / "copy" / "a.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert resolve_model(str(copy)) == first and len(converted) == 1  # keyed by content, not path
    with open(path, "ab") as f:
        f.write(b"\0" * 32)  # a changed file is converted again
    assert resolve_model(str(path)) != first and len(converted) == 2
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == before


@pytest.mark.slow
def test_the_conversion_runs_in_a_process_of_its_own(home, tmp_path, tokenizer_fields):
    """The process that names a new .gguf (a launcher, a server) gets the converted folder without
    importing what the conversion may need (for a sentencepiece vocabulary transformers, torch,
    sympy), which would stay in its memory for its whole life; a failed conversion's error still
    reaches it."""
    hf = tiny_hf("llama", vocab_size=49152, **SHAPE)
    path = write_gguf(tmp_path / "tiny.gguf", hf, "llama", tokenizer_fields)
    script = ("import sys; from specsot_mq.pull import resolve_model; folder = resolve_model(sys.argv[1]); "
              "print(folder, sorted(m for m in ('torch', 'transformers', 'sympy') if m in sys.modules))")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                         env={**os.environ, "SPECSOT_HOME": str(home)})  # fmt: skip
    assert run.returncode == 0, run.stderr
    folder, imported = run.stdout.split(" ", 1)
    assert imported.strip() == "[]"
    assert (Path(folder) / "tokenizer.json").is_file() and (Path(folder) / "model.safetensors").is_file()
    bare = write_gguf(tmp_path / "bare.gguf", hf, "llama", {})  # no tokenizer: the child's error, as raised
    with pytest.raises(SpecSotError, match="has no tokenizer"):
        resolve_model(str(bare))


def tokenizer_only_gguf(path: Path, tokenizer_fields: dict, **changes) -> Path:
    """A GGUF holding only the default model's tokenizer, with `changes` to its fields (name without
    the "tokenizer.ggml." prefix -> value; token_type as {token id: type})."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, field in tokenizer_fields.items():
        name = key.removeprefix("tokenizer.ggml.")
        if name == "token_type" and name in changes:
            add_field(writer, key, field, [changes[name].get(i, kind) for i, kind in enumerate(field.contents())])
        else:
            add_field(writer, key, field, changes.get(name))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


def load_tokenizer_of(path: Path, folder: Path):
    """The tokenizer the conversion makes of `path`'s vocabulary, saved in `folder`."""
    folder.mkdir()
    save_tokenizer(open_gguf(path), path, folder)
    return load_tokenizer(folder)


TOKENIZER_TEXTS = [
    "Skeleton-of-Thought: outline first,\n then expand 3 points! ünïcödé 🚀", "  two spaces\t\ttabs\r\n\r\nCRLF  ",
    "In 2024, 365.25 days; x=12345", "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>", "def f(x):\n    return x**2  # ok\n",
    "日本語のテキスト、中文文本。", "I'm sure WE'VE, they'll", "Ġloc and () inside", "hello\n\n\nworld", "end.\n\n- item",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    {"pre": "qwen2", "add_bos_token": True, "token_type": {1000: 4, 1001: 4}},  # its own split, bos added, user tokens
    {"pre": "llama-bpe"},
    {"pre": "no-such-split"},  # split as GPT-2 splits, and one line says so
], ids=["qwen2-bos-user-tokens", "llama-bpe", "unknown-split"])  # fmt: skip
def test_a_byte_level_vocabulary_tokenizes_as_transformers_builds_it_from_the_file(tmp_path, tokenizer_fields, changes, capfd):
    """The tokenizer a .gguf's byte-level vocabulary is converted to, built without transformers,
    encodes (with and without special tokens) and decodes every text as the one transformers
    builds from the same file."""
    from transformers import AutoTokenizer

    path = tokenizer_only_gguf(tmp_path / "vocab.gguf", tokenizer_fields, **changes)
    ours = load_tokenizer_of(path, tmp_path / "ours")
    warned = capfd.readouterr().err
    assert ("not one this converter knows" in warned) == (changes["pre"] == "no-such-split")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TOKENIZER_TEXTS:
        for special in (True, False):
            assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special), (text, special)
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids) and ours.decode(ids, True) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.encode("hi") == [1, *ours.encode("hi", False)]) == changes.get("add_bos_token", False)
    # The texts see the split: a blank line before a list splits otherwise under GPT-2's regex.
    gpt2_split = load_tokenizer_of(tokenizer_only_gguf(tmp_path / "gpt2.gguf", tokenizer_fields, pre="gpt-2"), tmp_path / "gpt2")
    assert (ours.encode("end.\n\n- item") == gpt2_split.encode("end.\n\n- item")) == (changes["pre"] == "no-such-split")


def test_a_byte_level_vocabulary_without_merges_is_one_clear_error(tmp_path, tokenizer_fields):
    path = tokenizer_only_gguf(tmp_path / "vocab.gguf", tokenizer_fields)
    reader = open_gguf(path)
    del reader.fields["tokenizer.ggml.merges"]
    with pytest.raises(SpecSotError, match="vocab.gguf has a byte-level vocabulary without its merges"):
        save_tokenizer(reader, path, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_a_missing_or_foreign_file_is_one_clear_error(home, tmp_path):
    with pytest.raises(SpecSotError, match="not found"):
        resolve_model(str(tmp_path / "nothing.gguf"))
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    with pytest.raises(SpecSotError, match="not a GGUF file"):
        resolve_model(str(bad))


@pytest.mark.slow
def test_a_type_the_kernels_do_not_run_is_converted_with_one_line(home, tmp_path, tokenizer_fields, capfd):
    """Q3_K (no kernel of ours) becomes Q8_0 when the file is converted, and one line says so."""
    hf = tiny_hf("llama", vocab_size=49152, **SHAPE)

    def types(g):
        return "Q8_0"

    path = write_gguf(tmp_path / "q3.gguf", hf, "llama", tokenizer_fields, types)
    # swap one projection's blocks for Q3_K blocks: random bytes with a small super-block scale
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "q3k.gguf"), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            add_field(writer, key, field)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.name == "blk.0.ffn_up.weight":
            raw = np.random.default_rng(0).integers(0, 256, (shape[0], shape[1] // 256, 110), dtype=np.uint8)
            raw[..., 108:110] = np.array([0.001], np.float16).view(np.uint8)
            writer.add_tensor(t.name, raw.reshape(shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.Q3_K)
        elif t.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape[0], -1), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = load_model(resolve_model(str(tmp_path / "q3k.gguf")))
    err = capfd.readouterr().err
    assert "1 Q3_K tensors run as Q8_0" in err and err.count("run as Q8_0") == 1
    assert [p.format.name for p in model.layers[0].gate_up.parts] == ["Q8_0"]


def test_the_header_reader_reads_what_ggufs_own_reader_reads(tmp_path):
    """gguf_convert.open_gguf walks the header with struct (gguf's GGUFReader took 7 s on the default
    model's tokenizer): every value type, arrays of numbers, strings and bools, tensors of float and
    block types, against GGUFReader on the same file; a file cut short is one error naming it."""
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7), writer.add_int8("t.i8", -7), writer.add_uint16("t.u16", 700)
    writer.add_int16("t.i16", -700), writer.add_uint32("t.u32", 70000), writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 0.25), writer.add_bool("t.bool", True), writer.add_string("t.str", "héllo")
    writer.add_uint64("t.u64", 2**40), writer.add_int64("t.i64", -(2**40)), writer.add_float64("t.f64", 1e-300)
    writer.add_array("t.strings", ["a", "ĠB", "", "日本"]), writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.5, -1.5]), writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((64,)).astype(np.float16))
    for name, kind in (("c.weight", "Q4_K"), ("d.weight", "Q8_0")):
        writer.add_tensor(name, quantize(rng.standard_normal((4, 512)).astype(np.float32), kind),
                          raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        want, got = theirs.fields[key].contents(), ours.fields[key]
        assert (list(got) if isinstance(got, np.ndarray) else got) == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for got, want in zip(ours.tensors, theirs.tensors):
        assert got.tensor_type == want.tensor_type and got.n_bytes == want.n_bytes
        assert got.shape == tuple(reversed(want.shape.tolist()))
        assert got.data.dtype == want.data.dtype and np.array_equal(got.data, want.data), got.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SpecSotError, match="cut.gguf is corrupt.*d.weight ends past the end of the file"):
        open_gguf(cut)
