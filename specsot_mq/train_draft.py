"""`specsot train-draft`: build an EAGLE head for a base model from the base model's own outputs.

1. data: the base model writes its own user questions (Magpie-style: the chat template up to the
   user turn, sampled), or takes templated ones (`--prompts templates`: 23k questions from
   templates over topics written for this project, prompts/train_questions.json; `--prompts
   families`: 8k of code, maths, writing and other kinds; `--prompts mixed`: both; `--prompts all`:
   every third chunk of questions templated as mixed, the others self-written), answers them
   greedily, and also writes Skeleton-of-Thought skeletons and point expansions for them, since
   those are what the head will draft. Saved as JSONL, resumable.
2. features: one base forward per sequence captures the hidden states the head reads (by default
   low, middle, high and final, fused by the head as EAGLE-3 does); kept on disk next to the data.
3. training: EAGLE-1 objective (regress the next feature + cross-entropy on the next token over the
   draft vocabulary), unrolled over several draft depths fed with the head's own predicted
   features and attending as a tree node does at inference (EAGLE-3's training-time test), so
   deeper draft steps are trained on what they will see. Checkpoint per epoch, resumable.
4. evaluation: draft accuracy per depth on held-out sequences (teacher-forced, unrolled).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import random
import string
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specsot_mq.draft import DraftConfig, DraftHead
from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Generator, Job
from specsot_mq.model import LlamaModel, Step
from specsot_mq.openmp import release_freed_memory
from specsot_mq.prompts import load_format
from specsot_mq.quant import QEmbedding, QLinear
from specsot_mq.sampling import SamplingParams
from specsot_mq.speculative import TreeParams
from specsot_mq.sot.flow import SoTConfig, finished_lines, point_params, point_prompts, skeleton_params
from specsot_mq.tokenizer import chat_prompt_ids

console = Console(stderr=True)


@dataclass(slots=True)
class TrainConfig:
    questions: int = 640  # self-written questions; 5% are held out for evaluation
    batch: int = 64  # sequences decoded together while writing the data (--batch)
    answer_tokens: int = 192
    skeleton_tokens: int = 96
    point_tokens: int = 64
    points: int = 2  # point expansions written per skeleton
    draft_vocab: int = 8192
    epochs: int = 5
    lr: float = 1e-3
    tokens_per_batch: int = 1024  # training batch size in tokens (small: many steps on little data)
    depths: int = 3  # draft depths unrolled in training (the first reads true features)
    depth_decay: float = 0.7  # loss weight of depth d is depth_decay ** (d - 1)
    ce_weight: float = 1.0  # cross-entropy next to feature regression (0.1 in EAGLE-1 learnt slower here)
    train_context: int = 64  # prompt tokens kept before each generated part when training
    # Base hidden states the head reads (transformers counting; the last must be the final one,
    # the regression target). None: low, middle, high and final (2, L/2, L-3, L), as EAGLE-3
    # picks them, on bases of 8 layers or more; the final one alone (EAGLE-1) below that.
    feature_layers: tuple[int, ...] | None = None
    # Uniform noise added to the features the head reads (not to its regression target) while
    # training, U(-a, a) times each layer's RMS at that position: EAGLE-1's augmentation against
    # the head learning exact training features (and a head's own, inexact, deeper predictions).
    feature_noise: float = 0.0
    seed: int = 0  # the self-written questions and the training order; another seed, other questions
    # Where the questions come from: "self" (the base writes them, Magpie-style), or
    # prompts/train_questions.json's "templates", "families" or both ("mixed"), shuffled by the
    # seed (template_questions), or "all": every third chunk the next of mixed's questions, the
    # others self-written (the base's own questions range over far more topics than templates do)
    prompts: str = "self"
    # A saved head to start from (fine-tuning: its draft vocabulary and feature layers are kept)
    # instead of the base's last layer.
    init: str | None = None
    # Processes writing the data, each with its own copy of the base on the same device (a GPU
    # step of 128 rows is short next to the host's per-token work, so several writers keep it
    # busy); chunk c of `batch` questions is written by writer c mod workers. Not part of the
    # recipe: the same chunks are written whatever the count, and a resumed run may change it.
    workers: int = 1
    # Stop starting new chunks after this many seconds of writing and train on what is written
    # (None: write all `questions`); a later run with the same settings writes the rest.
    data_seconds: float | None = None


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console,
    )  # fmt: skip


# -- 1. data ---------------------------------------------------------------------------------


def _magpie_prefix(tokenizer) -> list[int]:
    """The chat template up to where the user's words begin."""
    marker = "\x00QUESTION"
    text = tokenizer.decode(chat_prompt_ids(tokenizer, marker))
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


PROMPT_SOURCES = ("self", "templates", "families", "mixed", "all")


def _filled(templates: list[str], fills: dict[str, list]) -> list[str]:
    """Every template with every combination of the fills it names (the first fill named in
    `fills` varying slowest)."""
    out = []
    for template in templates:
        used = {name for _, name, _, _ in string.Formatter().parse(template) if name}
        names = [name for name in fills if name in used]
        out += [template.format(**dict(zip(names, values))) for values in itertools.product(*(fills[n] for n in names))]
    return out


@functools.cache
def template_questions(seed: int, source: str = "templates") -> tuple[str, ...]:
    """The questions of prompts/train_questions.json, shuffled by `seed`, for `source`:
    "templates", every template with every topic ({n}: each count from 3 to 7), about 23,000
    asking for advice and explanations; "families", every family's templates with every
    combination of their fills, 8,000 of the kinds a router answers directly, where the head does
    all the speeding up (code, maths, writing, rewriting and translation, facts, concepts,
    estimates and counterfactuals, roleplay, comparisons); "mixed", both. Written for this project
    (no benchmark's); built once per seed (the data writer takes a batch of them at a time)."""
    data = json.loads((Path(__file__).parent / "prompts" / "train_questions.json").read_text())
    questions = []
    if source in ("templates", "mixed"):
        questions += _filled(data["templates"], {"topic": data["topics"], "n": range(3, 8)})
    if source in ("families", "mixed"):
        questions += [q for family in data["families"] for q in _filled(family["templates"], family["fills"])]
    random.Random(seed).shuffle(questions)
    return tuple(questions)


def _questions(gen: Generator, cfg: TrainConfig, done: int, n: int, prefix: list[int]) -> list[str]:
    """The next n questions after the first `done`, drawn from the position (a resumed run asks
    what an uninterrupted one would): the next templated ones, or ones the base writes itself."""
    source = cfg.prompts
    if source == "all":  # chunks 2, 5, 8, ... ask the next mixed questions, the others are self-written
        chunk = done // cfg.batch
        if chunk % 3 == 2:
            asked = chunk // 3 * cfg.batch  # templated questions asked by the chunks before
            return list(template_questions(cfg.seed, "mixed")[asked : asked + n])
        source = "self"
    if source != "self":
        return list(template_questions(cfg.seed, source)[done : done + n])
    seed = random.Random(f"{cfg.seed}/{done}").randrange(1 << 30)
    ask = SamplingParams(max_tokens=64, temperature=1.0, top_p=0.95, seed=seed)
    qs = [c.text.strip() for c in gen.generate_many([prefix] * n, ask)]
    return [q for q in qs if len(q) > 10] or ["Give me some advice for learning to cook."]


def _source(cfg: TrainConfig) -> str:
    """What the data bars say they write."""
    return {"self": "self-written data", "all": "self-written and templated questions"}.get(cfg.prompts, "templated questions")


def data_path(work: Path, writer: int) -> Path:
    """Writer 0's data is data.jsonl, writer w's data-<w>.jsonl."""
    return work / ("data.jsonl" if writer == 0 else f"data-{writer}.jsonl")


def read_rows(path: Path, batch: int) -> list[dict]:
    """A data file's rows, each with its chunk (rows written before chunks were recorded get the
    one their answer's place gives: a single writer wrote them in order)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    chunk_of, answers = {}, 0
    for r in rows:
        if r["kind"] == "answer":
            if "chunk" not in r:
                r.update(chunk=answers // batch, asked=batch)
            answers += 1
            chunk_of.setdefault(r["question"], r["chunk"])
    for r in rows:
        r.setdefault("chunk", chunk_of.get(r["question"], 0))
    return rows


def written_chunks(work: Path, batch: int) -> set[tuple[int, int]]:
    """(chunk, questions asked) of every chunk whose answers some writer saved."""
    return {(r["chunk"], r["asked"]) for f in sorted(work.glob("data*.jsonl")) for r in read_rows(f, batch) if r["kind"] == "answer"}


def all_rows(work: Path, batch: int) -> list[dict]:
    """Every writer's rows in chunk order (within a chunk, as its writer wrote them): the rows one
    writer would have written, whatever the number of writers."""
    rows = [r for f in sorted(work.glob("data*.jsonl")) for r in read_rows(f, batch)]
    return sorted(rows, key=lambda r: r["chunk"])


def generate_data(gen: Generator, cfg: TrainConfig, path: Path, writer: int = 0, done: set | None = None,
                  deadline: float | None = None, counter=None) -> list[dict]:
    """Rows {kind, question, prompt, output (token ids), chunk} for the chunks of `cfg.batch`
    questions that are this writer's (chunk c is writer c mod cfg.workers') and not yet in
    `done` (every writer's saved chunks; this file's when not given).
    Appends to `path`; resumes where it stopped. SoT rows carry the prompt format's stamp: rows
    written with another format (the prompts changed since) are written again from their
    questions, keeping the answers. `deadline` (time.time()): no chunk is started after it.
    `counter` (a shared multiprocessing Value): questions asked are added to it instead of shown on
    a bar here (a writer process; write_data shows them all)."""
    rows = read_rows(path, cfg.batch)
    tok = gen.tokenizer
    fmt = load_format("sot")
    stamp = format_stamp(fmt)
    current = [r for r in rows if r["kind"] == "answer" or r.get("format") == stamp]
    if len(current) < len(rows):
        console.print(f"{len(rows) - len(current)} SoT rows were written with another prompt format: writing them again")
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in current))
        tmp.rename(path)
        rows = current
    for head in fmt.skeleton_heads(tok):  # the instructions and worked examples, once
        gen.keep_prefix(head)
    done = {(r["chunk"], r["asked"]) for r in rows if r["kind"] == "answer"} if done is None else done
    answered = {r["question"]: r["chunk"] for r in rows if r["kind"] == "answer"}

    def size(c: int) -> int:  # the questions chunk c asks (the last one may ask fewer)
        return min(cfg.batch, cfg.questions - c * cfg.batch)

    chunks = [c for c in range(math.ceil(cfg.questions / cfg.batch)) if c % cfg.workers == writer and (c, size(c)) not in done]
    bar = counter is None and bool(chunks)
    if counter is None and not chunks:
        console.print(f"every question's answers are written in {path.parent}: no new ones to write")
    tokens = sum(len(r["output"]) for r in rows)
    with _progress() if bar else contextlib.nullcontext() as progress, path.open("a") as out:

        def save(new: list[dict]) -> None:
            nonlocal tokens
            for r in new:
                out.write(json.dumps(r) + "\n")
            out.flush()
            rows.extend(new)
            tokens += sum(len(r["output"]) for r in new)

        planned = {r["question"] for r in rows if r["kind"] == "skeleton"}
        missing = [q for q in answered if q not in planned]
        for i in range(0, len(missing), 4 * cfg.batch):
            chunk = missing[i : i + 4 * cfg.batch]
            save(_sot_rows(chunk, [answered[q] for q in chunk], fmt, stamp, gen, cfg))
        task = progress.add_task(_source(cfg), total=sum(map(size, chunks)), info="") if bar else None
        prefix = _magpie_prefix(tok)
        for c in chunks:
            if deadline is not None and time.time() >= deadline:
                break
            asked = size(c)
            qs = _questions(gen, cfg, c * cfg.batch, asked, prefix)
            if not qs:  # every templated question is asked
                break
            answers = _decode(gen, [Job(i, chat_prompt_ids(tok, q), SamplingParams(max_tokens=cfg.answer_tokens))
                                    for i, q in enumerate(qs)])  # fmt: skip
            save([{"kind": "answer", "question": q, "prompt": chat_prompt_ids(tok, q), "output": answers[i],
                   "chunk": c, "asked": asked} for i, q in enumerate(qs)])  # fmt: skip
            save(_sot_rows(qs, [c] * len(qs), fmt, stamp, gen, cfg))
            if bar:
                progress.update(task, advance=asked, info=f"{tokens} tokens")
            else:
                with counter.get_lock():
                    counter.value += asked
    return rows


def load_base(folder: Path, dtype: torch.dtype, device) -> tuple[LlamaModel, object]:
    """The base and its tokenizer, as a data writer process loads them (with functools.partial,
    the `loader` of write_data)."""
    from specsot_mq.loader import load_model
    from specsot_mq.tokenizer import load_tokenizer

    return load_model(folder, dtype=dtype, device=device), load_tokenizer(folder)


def _write_chunks(loader, cfg: TrainConfig, work: Path, writer: int, done: set, deadline: float | None, counter) -> None:
    """A data writer process: its own copy of the base, its share of the chunks."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.workers))
    base, tokenizer = loader()
    gen = Generator(base, tokenizer, max_len=1024, num_slots=cfg.batch)
    generate_data(gen, cfg, data_path(work, writer), writer, done, deadline, counter)


def _same_source(work: Path, cfg: TrainConfig) -> None:
    """A work folder holds the questions of one source and seed (resuming draws the next ones by
    position): a run asking for others is stopped before it writes anything."""
    path, source = work / "source.json", {"prompts": cfg.prompts, "seed": cfg.seed}
    if not path.exists():
        path.write_text(json.dumps(source) + "\n")
        return
    was = json.loads(path.read_text())
    if was != source:
        raise SpecSotError(f"{work} holds data for --prompts {was['prompts']} --seed {was['seed']}: pass those to resume "
                           f"it, or another --work-dir for --prompts {cfg.prompts} --seed {cfg.seed}")


def write_data(base: LlamaModel, tokenizer, cfg: TrainConfig, work: Path, loader=None) -> list[dict]:
    """Every chunk's rows, written here (one writer) or by cfg.workers processes each loading the
    base with `loader` (a progress bar here counts the questions they ask)."""
    work.mkdir(parents=True, exist_ok=True)
    _same_source(work, cfg)
    deadline = time.time() + cfg.data_seconds if cfg.data_seconds else None
    done = written_chunks(work, cfg.batch)
    if cfg.workers == 1:
        gen = Generator(base, tokenizer, max_len=1024, num_slots=cfg.batch)
        generate_data(gen, cfg, data_path(work, 0), done=done, deadline=deadline)
        return all_rows(work, cfg.batch)
    if loader is None:
        raise SpecSotError(f"workers={cfg.workers}: writing data in several processes needs a loader of the base")
    spawn = torch.multiprocessing.get_context("spawn")
    asked = spawn.Value("q", sum(n for _, n in done))  # questions asked so far, every writer adding its own
    procs = [spawn.Process(target=_write_chunks, args=(loader, cfg, work, w, done, deadline, asked), daemon=True)
             for w in range(cfg.workers)]  # fmt: skip
    for p in procs:
        p.start()
    with _progress() as progress:
        task = progress.add_task(f"{_source(cfg)}, {cfg.workers} writers", total=cfg.questions, info="")
        while any(p.is_alive() for p in procs):
            progress.update(task, completed=asked.value)
            time.sleep(2)
        progress.update(task, completed=asked.value)
    failed = [w for w, p in enumerate(procs) if p.exitcode]
    if failed:
        raise SpecSotError(f"data writer(s) {failed} failed (exit codes {[procs[w].exitcode for w in failed]}): "
                           "their message is above; the chunks written are kept, so the same command resumes")  # fmt: skip
    return all_rows(work, cfg.batch)


def format_stamp(fmt) -> str:
    """A short fingerprint of a prompt format's templates."""
    return hashlib.sha1(repr(fmt).encode()).hexdigest()[:12]


def _sot_rows(qs: list[str], chunks: list[int], fmt, stamp: str, gen: Generator, cfg: TrainConfig) -> list[dict]:
    """Skeletons of the questions (of the given chunks) and up to `cfg.points` of each one's point
    expansions, decoded as the SoT engine decodes them (its prompts, stops and length caps, each
    question's points sharing their prefix): the text the head will draft in those phases."""
    tok = gen.tokenizer
    sot = SoTConfig()
    sk_params = skeleton_params(sot, SamplingParams(max_tokens=cfg.skeleton_tokens))
    sk_prompts = [fmt.skeleton_ids(tok, q) for q in qs]
    finish: dict = {}
    skeletons = _decode(gen, [Job(i, p, sk_params) for i, p in enumerate(sk_prompts)], finish)
    rows, jobs = [], []
    for i, q in enumerate(qs):
        rows.append({"kind": "skeleton", "format": stamp, "question": q, "prompt": sk_prompts[i], "output": skeletons[i],
                     "chunk": chunks[i]})  # fmt: skip
        skeleton = fmt.skeleton_prefix + tok.decode(skeletons[i], skip_special_tokens=True)
        plan = fmt.plan(finished_lines(skeleton, finish[i]), sot.max_points)  # as the engine parses it
        if plan.kind != "plan":
            continue
        prefix, suffixes = point_prompts(tok, fmt, q, plan)
        params = point_params(sot, SamplingParams(max_tokens=cfg.point_tokens), plan)
        jobs += [Job((i, p.index), prefix + suffixes[p.index], params, len(prefix), group=i) for p in plan.points[: cfg.points]]
    outputs = _decode(gen, jobs)
    rows += [{"kind": "point", "format": stamp, "question": qs[job.key[0]], "prompt": job.ids, "output": outputs[job.key],
              "chunk": chunks[job.key[0]]} for job in jobs]  # fmt: skip
    return rows


def _decode(gen: Generator, jobs: list[Job], finish: dict | None = None) -> dict:
    """Greedy outputs of the jobs by key, decoded as many at a time as the generator has slots;
    `finish` gets each job's finish reason."""
    out = {job.key: [] for job in jobs}
    waiting = list(jobs)

    def admit(room: int) -> list[Job]:
        taken = waiting[:room]
        del waiting[:room]
        return taken

    for key, delta in gen.run(admit, gen.new_decoder(SamplingParams())):
        out[key] += delta.token_ids
        if finish is not None and delta.finish_reason:
            finish[key] = delta.finish_reason
    return out


# -- 2. features -----------------------------------------------------------------------------


def cached_features(base: LlamaModel, rows: list[dict], layers: tuple[int, ...], context: int, work: Path):
    """capture_features, kept in `work` next to the data, one file per chunk of questions (about
    1 KB per token per layer in bf16): a run stopped in the base pass keeps the chunks it finished,
    and a resumed, repeated or larger (--questions) run computes only the chunks it has not. A
    file's name covers its rows, the layers and the context, so other data or settings compute
    their own. On a GPU they stay in its memory, never written: the pass takes seconds there, and
    20,000 questions' features are tens of GB."""
    if base.device.type != "cpu":
        return capture_features(base, rows, layers, context, batch=64)
    chunks: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        chunks.setdefault(r["chunk"], []).append(i)
    paths = {c: work / f"features-{hashlib.sha1(json.dumps([[rows[i] for i in idx], layers, context]).encode()).hexdigest()[:12]}.pt"
             for c, idx in chunks.items()}  # fmt: skip
    todo = {c for c in chunks if not paths[c].exists()}
    if len(todo) < len(chunks):
        console.print(f"base features of {len(chunks) - len(todo)} of {len(chunks)} chunks from {work}")
    out = [None] * len(rows)
    with _progress() if todo else contextlib.nullcontext() as bar:
        task = bar.add_task("base features", total=sum(len(chunks[c]) for c in todo), info="") if todo else None
        for c, idx in chunks.items():
            if c in todo:
                samples = capture_features(base, [rows[i] for i in idx], layers, context, advance=lambda n: bar.advance(task, n))
                torch.save(samples, paths[c].with_suffix(".tmp"))
                paths[c].with_suffix(".tmp").rename(paths[c])
            else:
                samples = torch.load(paths[c], weights_only=True)
            for i, sample in zip(idx, samples):
                out[i] = sample
    return out


@torch.inference_mode()
def capture_features(base: LlamaModel, rows: list[dict], layers: tuple[int, ...], context: int, batch: int = 8, advance=None):
    """(token ids, features [L, F*H] in bf16, prompt length) per sequence, keeping only the last
    `context` prompt tokens (features are computed on the whole sequence first, so they are exact;
    the head trains on the part around what the base wrote). Features stay on a GPU, else on the
    host. Sequences are taken in token order, so that a batch's prompts share their beginning (a
    skeleton prompt's instructions and worked examples, a question's points' question and plan):
    that is computed once, in one row, and copied to the others' cache slots. `advance(n)`: told
    of each batch's n sequences instead of a bar here."""
    out = [None] * len(rows)
    seqs = [r["prompt"] + r["output"] for r in rows]
    order = sorted(range(len(rows)), key=lambda i: seqs[i])
    cache = base.new_cache(batch, max(map(len, seqs)))
    with _progress() if advance is None else contextlib.nullcontext() as bar:
        if advance is None:
            task = bar.add_task("base features", total=len(rows), info="")
            advance = lambda n: bar.advance(task, n)  # noqa: E731
        for k in range(0, len(order), batch):
            idx = order[k : k + batch]
            group = [seqs[i] for i in idx]
            shared = max(_common_length(group) - 1, 0)  # every row computes at least its last token
            n = max(len(s) for s in group) - shared
            parts = []
            if shared:
                step = Step.fresh(torch.arange(shared)[None], logit_rows=[], hidden_layers=layers)
                parts.append(torch.cat(base(torch.tensor([group[0][:shared]]), cache, step).hidden, dim=-1).expand(len(idx), -1, -1))
                cache.copy(0, range(1, len(idx)), shared)
            ids = torch.tensor([s[shared:] + [0] * (n + shared - len(s)) for s in group])  # right padding is never attended
            step = Step(list(range(len(idx))), [shared] * len(idx), torch.arange(shared, shared + n).expand(len(idx), n),
                        logit_rows=[], hidden_layers=layers)  # fmt: skip
            parts.append(torch.cat(base(ids, cache, step).hidden, dim=-1))
            feats = torch.cat(parts, 1).to(torch.bfloat16)
            for row, i in enumerate(idx):
                cut = max(0, len(rows[i]["prompt"]) - context)
                out[i] = (torch.tensor(seqs[i][cut:]), feats[row, cut : len(seqs[i])].clone(), len(rows[i]["prompt"]) - cut)
            # Batches differ in length; without handing freed pages back, the heap kept their
            # transients: 3,000 questions' 6.3 GB of features had the process past 22 GB.
            release_freed_memory()
            advance(len(idx))
    return out


def _common_length(seqs: list[list[int]]) -> int:
    """How many first tokens all of them share."""
    first, n = seqs[0], min(map(len, seqs))
    for s in seqs[1:]:
        n = next((j for j in range(n) if s[j] != first[j]), n)
    return n


def draft_vocabulary(samples, size: int, eos_ids) -> torch.Tensor:
    """The `size` most frequent generated tokens (EOS always in), as base ids."""
    counts = Counter()
    for ids, _, plen in samples:
        counts.update(ids[plen:].tolist())
    for e in eos_ids:
        counts[e] += 1 << 30
    return torch.tensor([t for t, _ in counts.most_common(size)])


# -- 3. training -----------------------------------------------------------------------------


def _batches(samples, tokens_per_batch: int, rng: random.Random):
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    batches, cur, longest = [], [], 0
    for i in order:
        longest = max(longest, len(samples[i][0]))
        if cur and longest * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, longest = [], len(samples[i][0])
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _pad(samples, idx, t2d):
    """Padded tensors for a batch: tokens, features, draft-id targets, and which tokens the base
    generated (only those are prediction targets)."""
    length = max(len(samples[i][0]) for i in idx)
    b = len(idx)
    hdim = samples[idx[0]][1].shape[-1]
    tokens = torch.zeros(b, length, dtype=torch.long)
    feats = torch.zeros(b, length, hdim, device=samples[idx[0]][1].device)  # where the features are kept
    generated = torch.zeros(b, length, dtype=torch.bool)
    for row, i in enumerate(idx):
        ids, f, plen = samples[i]
        tokens[row, : len(ids)], feats[row, : len(ids)] = ids, f.float()
        generated[row, plen : len(ids)] = True
    return tokens, feats, t2d[tokens], generated


class _StepCache:
    """A training stand-in for the head's KVCache: entries are concatenated, never written in
    place, so autograd can run through every depth of the unrolled draft."""

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def write(self, layer, slots, starts, k, v) -> None:
        self.k.append(k)
        self.v.append(v)

    def view(self, layer, slots, length):
        return torch.cat(self.k, 2), torch.cat(self.v, 2)


def _step_mask(t: int, depth: int, device, start: int = 0) -> torch.Tensor:
    """[T', T + (depth-1)*T'] visibility for the depth-`depth` pass over anchors start..t-1 (T' of
    them; all T at depth 1): the query of anchor i sees the depth-1 entries of anchors <= i
    (drafted from true features) and, at each deeper level, only its own chain's entry, as a tree
    node sees its real context and its ancestors at inference."""
    q, keys = torch.arange(start, t, device=device), torch.arange(t, device=device)
    blocks = [q[:, None] >= keys[None, :]] + [q[:, None] == q[None, :]] * (depth - 1)
    return torch.cat(blocks, 1)


@dataclass(slots=True)
class Level:
    """One depth of the unrolled draft: anchors start..T-1 (see unroll)."""

    pred: torch.Tensor  # [B, T', H] predicted last-layer features
    logits: torch.Tensor  # [B, T', V] draft logits, or [R, V] of the rows asked for
    start: int  # the first anchor computed


def unroll(head: DraftHead, tokens, feats, depths: int, start: int = 0, rows=None) -> list[Level]:
    """The draft unrolled as at inference (EAGLE-3's training-time test): per depth, the predicted
    features and draft logits at the anchors i < T = n - depths - 1.

    Depth d at anchor i is the entry at position i+d-1, reading token x[i+d] and, for d = 1, the
    base feature F[i], deeper the head's own prediction from depth d-1; it predicts F[i+d] and
    x[i+d+1]. All depths share one attention context laid out as at inference (see _step_mask).
    Depth 1 runs every anchor (later ones attend to its entries); deeper ones only anchors from
    `start` on (earlier chains have nothing to predict: a prompt's tokens). `rows(depth, start,
    T')`: the flattened rows (b * T' + j) whose logits to compute at a depth (None: all).
    """
    b, n = tokens.shape
    t = n - depths - 1
    if t <= 0:
        return []
    start = min(start, t - 1)
    cache, out, inp = _StepCache(), [], feats[:, :t]
    for depth in range(1, depths + 1):
        s = 0 if depth == 1 else start
        width = t - s
        positions = torch.arange(depth - 1 + s, depth - 1 + t, device=tokens.device).expand(b, width)
        mask = _step_mask(t, depth, tokens.device, s).expand(b, width, -1)
        written = 0 if depth == 1 else t + (depth - 2) * width
        step = Step(list(range(b)), [written] * b, positions, mask, logit_rows=None if rows is None else rows(depth, s, width))
        pred, logits = head(tokens[:, depth + s : depth + t], inp, cache, step)
        out.append(Level(pred, logits, s))
        inp = pred[:, start - s :]  # the next depth reads the head's own predictions
    return out


def head_losses(head: DraftHead, tokens, feats, targets, generated, depths: int, noise: float = 0.0):
    """Per depth of `unroll`: (feature regression, cross-entropy, correct top-1 count, target
    count), over the targets the base generated. noise: TrainConfig.feature_noise. Only what
    scores is computed: deeper chains from the first anchor with a generated target, and draft
    logits at the rows with a target."""
    n = tokens.shape[1]
    first = int(generated.int().argmax(1).min()) if generated.any() else n  # the earliest generated token
    start = max(0, first - depths - 1)  # an anchor before this predicts only prompt tokens at every depth

    def scored(depth: int, s: int, width: int) -> torch.Tensor:  # valid rows of a depth's anchors s..s+width-1
        lo = depth + 1 + s
        return ((generated & (targets >= 0))[:, lo : lo + width]).flatten().nonzero().flatten()

    results = []
    for depth, level in enumerate(unroll(head, tokens, noisy(feats, head, noise), depths, start, scored), start=1):
        s, width = level.start, level.pred.shape[1]
        lo = depth + 1 + s
        valid = generated[:, lo : lo + width]
        target = feats[:, depth + s : depth + s + width, -level.pred.shape[-1] :]  # the last layer's feature
        reg = (F.smooth_l1_loss(level.pred, target, reduction="none").mean(-1) * valid).sum()
        reg = reg / valid.sum().clamp(min=1)
        tgt = targets[:, lo : lo + width]
        ok = valid & (tgt >= 0)
        logits = level.logits  # the rows of `ok`, in order
        ce = F.cross_entropy(logits, tgt[ok]) if ok.any() else level.pred.sum() * 0
        correct = (logits.argmax(-1) == tgt[ok]).sum()
        results.append((reg, ce, correct, ok.sum()))
    return results


def noisy(feats: torch.Tensor, head: DraftHead, noise: float) -> torch.Tensor:
    """feats [B, T, F*H] plus U(-noise, noise) times each layer's RMS at each position."""
    if not noise:
        return feats
    parts = feats.unflatten(-1, (len(head.cfg.feature_layers), -1))
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()
    return (parts + (torch.rand_like(parts) * 2 - 1) * noise * rms).flatten(-2)


def train_head(base: LlamaModel, train, evals, cfg: TrainConfig, work: Path) -> tuple[DraftHead, dict]:
    """Train on `train` samples (resuming from this recipe's checkpoint in `work`); score on `evals`."""
    torch.manual_seed(cfg.seed)
    layers = feature_layers(base, cfg)
    if cfg.init:
        saved = DraftHead.load(cfg.init, base)
        head = DraftHead(replace(saved.cfg, training=None))
        head.load_state_dict(saved.state_dict(), strict=False)
        d2t = head.d2t
    else:
        d2t = draft_vocabulary(train, cfg.draft_vocab, base.cfg.eos_token_ids)
        head = DraftHead(DraftConfig.for_base(base.cfg, len(d2t), layers))
        head.d2t.copy_(d2t)
        # Start the layer from the base's last layer: same shapes, a better start than noise.
        head.layer.load_state_dict(_float_state(base.layers[-1]))
        if head.fuse is not None:  # start from the last layer alone, as an EAGLE-1 head reads it
            h = base.cfg.hidden_size
            torch.nn.init.zeros_(head.fuse.weight)
            head.fuse.weight.data[:, -h:] = torch.eye(h)
    t2d = target_to_draft(d2t, base.cfg.vocab_size)
    generated = sum(len(s[0]) - s[2] for s in train)
    covered = sum((t2d[s[0][s[2] :]] >= 0).sum().item() for s in train)
    head = head.float().to(base.device).attach(_float_view(base))  # trained where the base runs (a GPU: --device cuda)
    if head.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training on tensor cores (TF32 products, fp32 sums)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    # One checkpoint per recipe (all settings but the epochs: more epochs resume a finished run).
    recipe = {k: getattr(cfg, k) for k in TrainConfig.__slots__ if k not in ("epochs", "workers", "data_seconds")}
    recipe |= {"feature_layers": layers, "sequences": len(train)}  # a data_seconds run trains on what it wrote
    ckpt = work / f"checkpoint-{hashlib.sha1(json.dumps(recipe).encode()).hexdigest()[:12]}.pt"
    start_epoch = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        start_epoch = state["epoch"]
        console.print(f"resuming from {ckpt} after epoch {start_epoch}")
    steps_per_epoch = len(_batches(train, cfg.tokens_per_batch, random.Random(0)))
    total = max(1, steps_per_epoch * cfg.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    for _ in range(start_epoch * steps_per_epoch):
        sched.step()
    history = []
    with _progress() as bar:
        task = bar.add_task("training", total=total, info="")
        bar.update(task, completed=start_epoch * steps_per_epoch)
        for epoch in range(start_epoch, cfg.epochs):
            head.train()
            sums = torch.zeros(4)
            for idx in _batches(train, cfg.tokens_per_batch, rng):
                tokens, feats, targets, mask = (x.to(head.device) for x in _pad(train, idx, t2d))
                res = head_losses(head, tokens, feats, targets, mask, cfg.depths, cfg.feature_noise)
                if not res:
                    continue
                loss = sum(cfg.depth_decay**d * (reg + cfg.ce_weight * ce) for d, (reg, ce, _, _) in enumerate(res))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                sched.step()
                release_freed_memory()  # batches of every shape: see capture_features
                sums += torch.tensor([res[0][0].item(), res[0][1].item(), res[0][2].item(), res[0][3].item()])
                bar.update(task, advance=1, info=f"epoch {epoch + 1} loss {loss.item():.3f} acc1 {sums[2] / max(sums[3], 1):.3f}")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1}, ckpt)
            history.append({"epoch": epoch + 1, "train_acc1": round((sums[2] / max(sums[3], 1)).item(), 4)})
    head.eval()
    accuracy = evaluate_head(head, evals, t2d, cfg.depths, cfg.tokens_per_batch)
    info = {"draft_vocab_coverage": round(covered / max(generated, 1), 4), "history": history, **accuracy}
    return head, info


@torch.no_grad()
def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each base token's index in the draft vocabulary `d2t`, -1 where it has none."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d


def evaluate_head(head: DraftHead, samples, t2d, depths: int, tokens_per_batch: int = 1024) -> dict:
    """Teacher-forced top-1 accuracy per unrolled depth on held-out sequences."""
    sums = torch.zeros(depths, 2)
    for idx in _batches(samples, tokens_per_batch, random.Random(0)):  # right padding is never attended
        tokens, feats, targets, mask = (x.to(head.device) for x in _pad(samples, idx, t2d))
        for d, (_, _, acc, n) in enumerate(head_losses(head, tokens, feats, targets, mask, depths)):
            sums[d] += torch.tensor([acc.item(), n.item()])
    return {f"heldout_acc_depth{d + 1}": round((sums[d, 0] / sums[d, 1].clamp(min=1)).item(), 4) for d in range(depths)}


def feature_layers(base: LlamaModel, cfg: TrainConfig) -> tuple[int, ...]:
    n = base.cfg.num_layers
    if cfg.init:  # a head to fine-tune reads what it was trained on
        kept = DraftConfig.read(cfg.init).feature_layers
        if cfg.feature_layers and tuple(cfg.feature_layers) != kept:
            raise SpecSotError(
                f"--feature-layers {','.join(map(str, cfg.feature_layers))}: the head to start from ({cfg.init}) "
                f"reads {','.join(map(str, kept))}; leave the option out or start from no head"
            )
        return kept
    layers = tuple(cfg.feature_layers or ((2, n // 2, n - 3, n) if n >= 8 else (n,)))
    if layers[-1] != n or any(not 0 <= i <= n for i in layers) or len(set(layers)) != len(layers):
        raise SpecSotError(
            f"--feature-layers {','.join(map(str, layers))}: name distinct hidden states between 0 and {n}, "
            f"the last being {n} (the final one, which the head learns to predict), e.g. 2,{n // 2},{n - 3},{n}"
        )
    return layers


def _float_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's state with quantized layers as float weights (a QLinear's packed parts become
    its dequantized `weight`), as a float copy of the module loads it."""
    state = dict(module.state_dict())
    for name, m in module.named_modules():
        if isinstance(m, QLinear) and m.parts is not None:
            state[f"{name}.weight"] = m.dequantized()
    return state


def _float_view(base: LlamaModel) -> LlamaModel:
    """The base's embedding and output layer as fp32 tensors for training (the base may run in
    bf16, or keep them quantized)."""
    if base.dtype == torch.float32 and isinstance(base.lm_head, torch.nn.Linear):
        return base
    shim = torch.nn.Module()
    shim.cfg = base.cfg
    embed = base.embed.table.dequantized() if isinstance(base.embed, QEmbedding) else base.embed.weight.float()
    shim.embed = torch.nn.Embedding.from_pretrained(embed)
    shim.lm_head = torch.nn.Linear(base.cfg.hidden_size, base.cfg.vocab_size, bias=False)
    head = base.lm_head.dequantized() if isinstance(base.lm_head, QLinear) else base.lm_head.weight.float()
    shim.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    return shim


@torch.inference_mode()
def evaluate_tau(base: LlamaModel, tokenizer, head_path: Path, questions: list[str], max_tokens: int = 128) -> dict:
    """Mean acceptance length of the saved head, greedy, on questions it never saw in training:
    the default tree for every question at every step, batched (the verify budget is raised so
    that the trees do not shrink with the batch, as they do when serving), without prompt lookup
    or the speed chooser (the head's own guesses only)."""
    head = DraftHead.load(head_path, base).prepack()
    tree = TreeParams(lookup=0, adaptive=False)
    tree = replace(tree, max_batch_tokens=len(questions) * (tree.num_draft_tokens + 1))
    gen = Generator(base, tokenizer, max_len=1024, num_slots=len(questions), draft=head, tree=tree)
    gen.retire_head = False  # measured even where it does not pay
    decoder = gen.new_decoder(SamplingParams(max_tokens=max_tokens))
    gen.generate_many(questions, SamplingParams(max_tokens=max_tokens), decoder=decoder)
    st = decoder.stats
    return {"heldout_tau": round(st.tau, 3), "heldout_questions": len(questions),
            "heldout_accepted_per_depth": [round(a / st.steps, 3) for a in st.accepted_at_depth]}  # fmt: skip


def run(base: LlamaModel, tokenizer, out: Path, work: Path, cfg: TrainConfig, loader=None) -> dict:
    """The whole recipe; returns the record stored with the head. `loader`: () -> (base,
    tokenizer), picklable, for data writers in other processes (cfg.workers > 1)."""
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    written = write_data(base, tokenizer, cfg, work, loader)
    # Data written before resumes drew the same questions again (fixed since): drop repeated rows.
    rows = list({json.dumps(r, sort_keys=True): r for r in written}.values())
    data_s = time.time() - started
    # Hold out whole questions (all their rows, 5% and at most 256), so the evaluation never saw them.
    questions = list(dict.fromkeys(r["question"] for r in rows))
    held = set(questions[-max(2, min(256, len(questions) // 20)) :])
    samples = cached_features(base, rows, feature_layers(base, cfg), cfg.train_context, work)
    train = [s for s, r in zip(samples, rows) if r["question"] not in held]
    evals = [s for s, r in zip(samples, rows) if r["question"] in held]
    random.Random(cfg.seed).shuffle(train)
    head, info = train_head(base, train, evals, cfg, work)
    record = {
        "data": {"sequences": len(rows), "repeats_dropped": len(written) - len(rows), "questions": len(questions),
                 "generated_tokens": sum(len(r["output"]) for r in rows),
                 "kinds": dict(Counter(r["kind"] for r in rows)), "heldout_questions": len(held)},
        "config": {k: getattr(cfg, k) for k in TrainConfig.__slots__},
        **info,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    head.save(out)
    record.update(evaluate_tau(base, tokenizer, out, sorted(held)[:16]))
    record["seconds"] = {"data": round(data_s), "total": round(time.time() - started)}
    head.cfg.training = record
    head.save(out)
    return record
