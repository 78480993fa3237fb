"""Real model sizes against llama.cpp's own llama-bench, side by side in one run.

For each shape (random weights of a real model's shape, written as a Hugging Face folder, then
converted and quantized by llama.cpp's own convert_hf_to_gguf.py and llama-quantize) and each GGUF
type, both engines load the same .gguf file (ours through `--model FILE.gguf`, converted once into
the cache) and measure, on --threads threads, as llama-bench does: decode (tg: --new-tokens tokens
one at a time from an empty cache), prefill (pp: a --prompt-tokens prompt in one forward), and one
forward of k new rows (k = 1, 2, 4, 8, 16) as a multiple of one row's time, which is what
speculation and the parallel points pay. Decode and prefill run in --runs rounds, each round ours
then one llama-bench run, and the ratios are the median of each round's: a shared VM's memory
bandwidth changes by half for seconds at a time (its 1 GiB read at 34 GB/s, then at 55), which an
engine timed minutes after the other took as a difference between them. Beside them: the bytes
our decode reads per token against the memory bandwidth measured in the same rounds, and our
process's resident memory against the file: all of it, and without the runtime's fixed cost
(python and torch imported, before any model) and the KV cache.

    benchmarks/setup_llamacpp.sh        # once: llama.cpp's programs, about 5 minutes
    python benchmarks/realsize.py [--shapes smollm2-360m,qwen2.5-0.5b,smollm2-1.7b] \\
        [--types Q4_K_M,Q4_0,Q8_0] [--threads 2] [--runs 3] [--llamacpp DIR]

The models are built once under $SPECSOT_HOME/bench-models (a few GB; `llama3.2-3b` adds 8 GB). Ends
with one JSON line: per shape and type both engines' figures and the ratios ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import cpu_name, run_script  # noqa: E402

from specsot_mq.errors import SpecSotError  # noqa: E402
from specsot_mq.pull import resolve_model, specsot_home  # noqa: E402

# Shapes of real models (config.json fields); the weights are random.
SHAPES = {
    "smollm2-360m": dict(arch="LlamaForCausalLM", model_type="llama", hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                         rope_theta=100000.0),
    "qwen2.5-0.5b": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         rope_theta=1000000.0),
    "smollm2-1.7b": dict(arch="LlamaForCausalLM", model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
                         rope_theta=130000.0),
    "llama3.2-3b": dict(arch="LlamaForCausalLM", model_type="llama", hidden_size=3072, intermediate_size=8192,
                        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8192}),
}  # fmt: skip
ROWS = (1, 2, 4, 8, 16)


def llamacpp_dir(given: str | None) -> Path:
    folder = Path(given).expanduser() if given else specsot_home() / "llamacpp"
    if not (folder / "bin" / "llama-bench").exists():
        raise SpecSotError(f"llama.cpp's programs are not in {folder}: run benchmarks/setup_llamacpp.sh "
                           f"{'' if given is None else folder} first (about 5 minutes), or pass --llamacpp DIR")  # fmt: skip
    return folder


def build_folder(name: str, dest: Path) -> None:
    """A Hugging Face folder of the shape with random weights (fp16, normal(0, 0.02); norms 1)
    and the default model's tokenizer (the vocabulary padded to the shape's size)."""
    import numpy as np
    from safetensors.numpy import save_file

    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    h, inter, n_layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    tokenizer_folder = resolve_model(None)
    config = {"architectures": [arch], **shape, "head_dim": d, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 8192, "hidden_act": "silu", "torch_dtype": "float16",
              "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_folder / f).exists():
            shutil.copy(tokenizer_folder / f, dest / f)
    rng = np.random.default_rng(0)

    def rand(*size):
        return (rng.standard_normal(size, dtype=np.float32) * 0.02).astype(np.float16)

    shards, index = [], {}
    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], h), "model.norm.weight": np.ones(h, np.float16)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": np.ones(h, np.float16),
            p + "post_attention_layernorm.weight": np.ones(h, np.float16),
        })  # fmt: skip
        if shape["model_type"] == "qwen2":
            for n, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
                tensors[p + f"self_attn.{n}_proj.bias"] = rand(rows)
        if sum(t.nbytes for t in tensors.values()) > 2 << 30 or i == n_layers - 1:  # shards of about 2 GB
            shard = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(tensors, str(dest / shard), metadata={"format": "pt"})
            shards.append(shard)
            index.update({k: shard for k in tensors})
            tensors = {}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (dest / "config.json").write_text(json.dumps(config, indent=1))


# llama.cpp's converter, told that the tokenizer (the default model's, as transformers saved it: a
# hash the converter does not list) pre-tokenizes as GPT-2 does; the speed figures do not read text.
_CONVERT = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src + "/gguf-py", src]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_file(name: str, kind: str, llamacpp: Path, log) -> Path:
    """The shape's GGUF of `kind`, made once: folder -> F16 GGUF (convert_hf_to_gguf.py) -> llama-quantize."""
    root = specsot_home() / "bench-models" / name
    out = root / f"{name}-{kind}.gguf"
    if out.exists():
        return out
    f16 = root / f"{name}-F16.gguf"
    if not f16.exists():
        if not (root / "hf" / "config.json").exists():
            log(f"writing a random-weight {name} folder")
            build_folder(name, root / "hf")
        log(f"converting {name} with convert_hf_to_gguf.py")
        subprocess.run([sys.executable, "-c", _CONVERT, str(llamacpp / "src"), str(root / "hf"), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, capture_output=True)  # fmt: skip
    log(f"quantizing {name} to {kind} with llama-quantize")
    subprocess.run([str(llamacpp / "bin" / "llama-quantize"), str(f16), str(out), kind, str(os.cpu_count())],
                   check=True, capture_output=True)  # fmt: skip
    return out


def llama_bench(llamacpp: Path, path: Path, threads: int, runs: int, *flags) -> list[dict]:
    """llama-bench's entries (its mean over `runs`) for `flags` (-p, -n)."""
    out = subprocess.run([str(llamacpp / "bin" / "llama-bench"), "-m", str(path), "-t", str(threads), "-r", str(runs),
                          "-o", "json", *flags], check=True, capture_output=True, text=True)  # fmt: skip
    return json.loads(out.stdout)


def llama_rates(llamacpp: Path, path: Path, args) -> dict:
    """One llama-bench run of decode (tg) and prefill (pp) as ours measures them: tokens/s."""
    result = {}
    for entry in llama_bench(llamacpp, path, args.threads, 1, "-p", str(args.prompt_tokens), "-n", str(args.new_tokens)):
        result["decode_tok_s" if entry["n_gen"] else "prefill_tok_s"] = entry["avg_ts"]
    return result


def llama_rows(llamacpp: Path, path: Path, args) -> dict:
    """llama-bench's time of a k-row forward, ms (its -p k prompts)."""
    entries = llama_bench(llamacpp, path, args.threads, args.runs, "-p", ",".join(map(str, ROWS)), "-n", "0")
    rows = {e["n_prompt"]: e["n_prompt"] / e["avg_ts"] * 1e3 for e in entries}
    return {k: rows[k] for k in ROWS}


def ours(path: Path, args) -> dict:
    """Our figures, measured in a fresh process (its resident memory is the model's). The one-time
    conversion into the cache runs here first: in the measuring process it left its own buffers
    behind in the memory figure."""
    resolve_model(str(path), auto_pull=False)
    out = subprocess.run([sys.executable, __file__, "--measure", str(path), "--threads", str(args.threads),
                          "--runs", str(args.runs), "--new-tokens", str(args.new_tokens),
                          "--prompt-tokens", str(args.prompt_tokens), "--llamacpp", str(args.llamacpp)],
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"measuring {path.name} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["row_ms"] = {int(k): v for k, v in result["row_ms"].items()}  # JSON's keys are strings
    return result


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (this one's by default)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(path: Path, args) -> dict:
    """In this process: load the GGUF as a device stage does (converted once, cached), then decode,
    prefill and k-row forwards as llama-bench times them; decode and prefill in rounds, each
    followed by one llama-bench run of the same (`rounds`: both engines' rates and the memory
    bandwidth, round by round)."""
    import torch

    from decode import measure_bandwidth, weight_bytes
    from specsot_mq.loader import load_generator

    from specsot_mq.model import Step

    torch.set_num_threads(args.threads)
    runtime = rss_bytes()  # python, torch and the project imported: what any stage pays before a model
    gen = load_generator(str(path), draft="none", max_len=1024)
    model = gen.model
    cache = model.new_cache(1, 1024)
    loaded = rss_bytes()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, max(args.prompt_tokens, max(ROWS))))

    def forward(k: int, start: int):  # k new tokens at positions start.., the last one's logits
        return model(prompt[:, :k], cache, Step([0], [start], torch.arange(start, start + k)[None], logit_rows=[k - 1]))

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def decode():
        for i in range(args.new_tokens):
            forward(1, i)

    rounds = []
    with torch.no_grad():
        for k in ROWS:  # warm-up
            timed(lambda: forward(k, 0))
        for _ in range(args.runs):
            mine = {"decode_tok_s": args.new_tokens / timed(decode),
                    "prefill_tok_s": args.prompt_tokens / timed(lambda: forward(args.prompt_tokens, 0))}  # fmt: skip
            rounds.append({"ours": mine, "llamacpp": llama_rates(Path(args.llamacpp), path, args),
                           "bandwidth_gb_s": measure_bandwidth(repeats=3) / 1e9})  # fmt: skip
        rows = {k: statistics.median(timed(lambda: forward(k, 0)) for _ in range(max(5, 3 * args.runs))) * 1e3
                for k in ROWS}  # fmt: skip
    _, nbytes = weight_bytes(model, torch.float32)
    decode_tok_s = statistics.median(r["ours"]["decode_tok_s"] for r in rounds)
    return {
        "decode_tok_s": decode_tok_s,
        "prefill_tok_s": statistics.median(r["ours"]["prefill_tok_s"] for r in rounds),
        "rounds": rounds,
        "row_ms": rows,
        "bytes_per_token": nbytes,
        "read_gb_s": nbytes * decode_tok_s / 1e9,
        "bandwidth_gb_s": statistics.median(r["bandwidth_gb_s"] for r in rounds),
        "rss_runtime": runtime,
        "rss_loaded": loaded,
        "rss_after": rss_bytes(),
        # the KV cache's bytes per position (keys and values of every layer), times the positions used
        "kv_bytes": 2 * cache.k.element_size() * cache.k.shape[0] * cache.k.shape[2] * cache.k.shape[4]
        * max(args.prompt_tokens, args.new_tokens),
        "formats": sorted({f for m in model.modules() for f in getattr(m, "formats", [])}),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="smollm2-360m,qwen2.5-0.5b,smollm2-1.7b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0", help="llama-quantize types")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--llamacpp", default=None, help="the folder setup_llamacpp.sh made (default $SPECSOT_HOME/llamacpp)")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child process's own run
    return p.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args)))
        return None
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SpecSotError(f"unknown shape {unknown[0]!r}: use {', '.join(SHAPES)}")
    llamacpp = llamacpp_dir(args.llamacpp)
    args.llamacpp = str(llamacpp)  # the measuring process runs llama-bench between its own rounds
    results = []
    for name in shapes:
        for kind in [t.strip() for t in args.types.split(",") if t.strip()]:
            path = gguf_file(name, kind, llamacpp, lambda m: console.print(f"[dim]{m}"))
            console.print(f"[bold]{name} {kind}[/] ({path.stat().st_size / 2**20:.0f} MB): {args.runs} rounds of "
                          f"ours then llama-bench, then k-row forwards")  # fmt: skip
            mine = ours(path, args)
            rounds = mine.pop("rounds")
            theirs = {key: statistics.median(r["llamacpp"][key] for r in rounds) for key in ("decode_tok_s", "prefill_tok_s")}
            theirs["row_ms"] = llama_rows(llamacpp, path, args)

            decode, prefill = ([r["ours"][key] / r["llamacpp"][key] for r in rounds]  # ours / llama.cpp, round by round
                               for key in ("decode_tok_s", "prefill_tok_s"))

            results.append({"shape": name, "type": kind, "file_bytes": path.stat().st_size, "llamacpp": theirs,
                            "ours": mine, "rounds": rounds,
                            "decode_vs_llamacpp": statistics.median(decode),
                            "decode_vs_llamacpp_range": [min(decode), max(decode)],
                            "prefill_vs_llamacpp": statistics.median(prefill),
                            "rss_over_file": mine["rss_after"] / path.stat().st_size,
                            # the model's own memory, the runtime's fixed cost and the KV cache taken out
                            "model_over_file": (mine["rss_after"] - mine["rss_runtime"] - mine["kv_bytes"])
                            / path.stat().st_size})  # fmt: skip
    table = Table(title=f"Real sizes, random weights: llama-bench and ours on the same file ({args.threads} threads, "
                        f"{cpu_name()})")  # fmt: skip
    for col in ("shape", "type", "MB", "decode tok/s llama.cpp / ours", "x (rounds' range)", "prefill tok/s", "x",
                "k rows = x one row, k = 2 4 8 16: llama.cpp / ours", "read GB/s / bandwidth", "RSS / file", "runtime MB", "model / file"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("shape", "type") else "right")
    for r in results:
        t, o = r["llamacpp"], r["ours"]

        def multiples(ms: dict) -> str:
            return " ".join(f"{ms[k] / ms[1]:.2f}" for k in ROWS[1:])

        table.add_row(r["shape"], r["type"], f"{r['file_bytes'] / 2**20:.0f}",
                      f"{t['decode_tok_s']:.1f} / {o['decode_tok_s']:.1f}",
                      f"{r['decode_vs_llamacpp']:.2f} ({'-'.join(f'{x:.2f}' for x in r['decode_vs_llamacpp_range'])})",
                      f"{t['prefill_tok_s']:.0f} / {o['prefill_tok_s']:.0f}", f"{r['prefill_vs_llamacpp']:.2f}",
                      f"{multiples(t['row_ms'])} / {multiples(o['row_ms'])}",
                      f"{o['read_gb_s']:.1f} / {o['bandwidth_gb_s']:.1f}", f"{r['rss_over_file']:.2f}",
                      f"{o['rss_runtime'] / 2**20:.0f}", f"{r['model_over_file']:.2f}")  # fmt: skip
    Console(width=200).print(table)
    summary = {"cpu": cpu_name(), "avx512_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text(),
               "kernel_isa": os.environ.get("SPECSOT_KERNEL_ISA", "native"), "threads": args.threads, "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run_script(main)
