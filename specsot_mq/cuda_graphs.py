"""Captured decode and verify steps on a CUDA GPU.

A step of the default model reads 270 MB of weights in bf16, about 0.1 ms of an H100's bandwidth,
while launching its several hundred small kernels one by one from Python takes milliseconds. So
on CUDA a step whose shape fits a bucket replays a CUDA graph captured once for that bucket:
batch rows and cache entries attended, each rounded up to a power of two, and new tokens per row,
to a power of four.

Everything that changes between steps is a tensor at a fixed address, copied in before the
replay in one copy from the host (and one more for a draft tree's mask): token ids, rope
positions, each row's slot and start, and the mask over the new tokens.
The KV cache is read and written in place, through tensor indices (kv_cache.py); rope with the
cache write, and the feed-forward's gate, are one Triton kernel each where Triton runs
(cuda_kernels.py; torch ops otherwise, or if they fail to build). Padding never
reaches a real row: padding rows write to the cache's spare slot, a row's padding tokens write
past its own (the spare positions, never owned by a sequence), and every query sees at least
itself. The logits and hidden states come back as copies, since the next replay overwrites the
graph's own.

A bucket's graph is captured on its first use, into its cache's memory pool, and the cache holds
it (KVCache.graphs), so graphs go when their cache goes; `capture_report` says how many
were captured and what they cost. `--no-cuda-graphs` (SPECSOT_CUDA_GRAPHS=0) runs every step
eagerly. Prefills longer than a bucket, an early-stopping forward (a router's) and a layer range
run eagerly too.

On a CPU nothing is captured; the same bucketed, tensor-indexed forward then runs as it is, which
is how the tests check the bucketing and padding without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass

import torch

from specsot_mq import cuda_kernels
from specsot_mq.kv_cache import KVCache

MAX_TOKENS = 64  # new tokens per row (a draft tree with its lookup; a short prefill)
MAX_BATCH = 128  # rows (a serving stage's batch, or train-draft writing its data)
MAX_CELLS = 1024  # rows x tokens: larger steps (a batch of prefills) run eagerly
MIN_KEYS = 256  # the smallest bucket of cache entries attended
SPARE = (1, MAX_TOKENS)  # (slots, positions) a cache for captured steps has beyond its own


def wanted(device: torch.device | str) -> bool:
    """Whether caches on `device` get captured steps: on CUDA, unless SPECSOT_CUDA_GRAPHS=0."""
    return torch.device(device).type == "cuda" and os.environ.get("SPECSOT_CUDA_GRAPHS", "1") != "0"


def bucket(n: int, floor: int = 1, base: int = 2) -> int:
    """n rounded up to a power of `base`, at least `floor`."""
    size = floor
    while size < n:
        size *= base
    return size


@dataclass(slots=True)
class Captured:
    """One bucket's static buffers and its graph (None on a CPU: run as it is)."""

    inputs: torch.Tensor  # [B, 2T + 2] on the device: token ids, rope positions, slot, start
    mask: torch.Tensor  # [B, T, T] on the device
    host: torch.Tensor  # inputs' staging copy on the host (pinned on a GPU): one copy a step
    host_mask: torch.Tensor  # mask's
    run: object = None  # the forward over these buffers
    graph: torch.cuda.CUDAGraph | None = None
    out: object = None  # the graph's ForwardOutput (static)
    seconds: float = 0.0  # what capturing it cost
    replays: int = 0
    copied: object = None  # on a GPU, the event after the last step's copies from `host`
    features: torch.Tensor | None = None  # [B, T, width] a draft head's input features (replay_head)

    @property
    def tokens(self) -> int:
        return self.mask.shape[1]


def shape_key(model, cache, input_ids: torch.Tensor, step) -> tuple | None:
    """The bucket a step runs in, or None where it runs eagerly (a cache with graphs has the spare
    slot and positions: model.new_cache makes both)."""
    if input_ids.dim() != 2 or model.first_layer != 0 or model.last_layer != model.cfg.num_layers:
        return None
    if step.logit_rows == [] or (sizes := _sizes(cache, input_ids, step)) is None:
        return None
    window = model.cfg.sliding_window
    if window is not None and sizes[2] > window:
        return None
    return *sizes, tuple(step.hidden_layers)


def _sizes(cache, input_ids: torch.Tensor, step) -> tuple[int, int, int] | None:
    """A step's bucket of (rows, new tokens, cache entries attended), or None past every bucket
    or where its mask covers more than its new tokens (a [B, T, K] mask has no captured form)."""
    b, t = input_ids.shape[:2]
    if step.mask is not None and tuple(step.mask.shape) != (b, t, t):
        return None
    rows, tokens = bucket(b), bucket(t, base=4)  # (a padding row or token costs a GPU next to nothing)
    if rows > MAX_BATCH or tokens > MAX_TOKENS or rows * tokens > MAX_CELLS:
        return None
    return rows, tokens, min(bucket(max(step.starts) + tokens, MIN_KEYS), cache.k.shape[3])


def new_cache(layers: int, num_slots: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
              graphs: bool | None) -> KVCache:  # fmt: skip
    """A KV cache whose steps replay captured graphs (`graphs`; None: `wanted` on its device),
    with the spare slot and positions their padding writes to, or run eagerly."""
    graphs = wanted(device) if graphs is None else graphs
    cache = KVCache(layers, num_slots, kv_heads, capacity, head_dim, dtype, device, SPARE if graphs else (0, 0))
    cache.graphs = {} if graphs else None
    return cache


def replay(model, cache, input_ids: torch.Tensor, step):
    """The step's ForwardOutput from its bucket's graph (captured now if new), or None where the
    step runs eagerly (shape_key). Its inputs are best on the host (layout.py makes them there):
    they go over in one copy."""
    key = shape_key(model, cache, input_ids, step)
    if key is None:
        return None
    rows, tokens, keys, hidden_layers = key
    entry = cache.graphs.get(key) or _capture(cache, key, rows, tokens, lambda e: functools.partial(
        model.forward_static, *_static_inputs(e), e.mask, keys, cache, hidden_layers))  # fmt: skip
    b, t = input_ids.shape
    out = _play(entry, cache, input_ids, step)
    return type(out)(_rows(out.logits[:b, :t], step.logit_rows), [h[:b, :t].clone() for h in out.hidden])


def head_key(head, cache, tokens: torch.Tensor, features: torch.Tensor, step) -> tuple | None:
    """The bucket of a draft head's step (its own buckets, over its own cache), or None where it
    runs eagerly: a mask over cache entries (a tree level's, which sees only its ancestors among
    the levels before) has no captured form."""
    sizes = _sizes(cache, tokens, step)
    return None if sizes is None else (*sizes, features.shape[-1])


def replay_head(head, cache, tokens: torch.Tensor, features: torch.Tensor, step):
    """A draft head's (hidden, logits) from its bucket's graph (DraftHead.forward's), or None
    where the step runs eagerly (head_key). The features, already on the device, are copied into
    the graph's own buffer; padding rows read whatever finite features were left there."""
    key = head_key(head, cache, tokens, features, step)
    if key is None:
        return None
    rows, width, keys, feature_width = key

    def run(e: Captured):
        e.features = torch.zeros(rows, width, feature_width, dtype=head.dtype, device=cache.k.device)
        return functools.partial(head.forward_static, *_static_inputs(e), e.mask, keys, cache, e.features)

    entry = cache.graphs.get(key) or _capture(cache, key, rows, width, run)
    b, t = tokens.shape
    entry.features[:b, :t].copy_(features)
    hidden, logits = _play(entry, cache, tokens, step)
    return hidden[:b, :t].clone(), _rows(logits[:b, :t], step.logit_rows)


def _rows(logits: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """A step's logits [B, T, V] as it asked for them: all (a copy: the next replay overwrites
    the graph's), or the rows `rows` of the flattened [B * T, V]."""
    return logits.clone() if rows is None else logits.reshape(-1, logits.shape[-1])[rows]


def _static_inputs(entry: Captured) -> tuple[torch.Tensor, ...]:
    """The views of entry.inputs a static forward reads: ids, positions, slots, starts."""
    tokens = entry.tokens
    inputs = entry.inputs
    return inputs[:, :tokens], inputs[:, tokens : 2 * tokens], inputs[:, 2 * tokens], inputs[:, 2 * tokens + 1]


def _play(entry: Captured, cache, input_ids: torch.Tensor, step):
    """The step's inputs staged on the host and copied over in one go (padding rows in the spare
    slot, padding tokens seeing themselves alone), then the graph replayed (on a CPU: the static
    forward run as it is); returns the static outputs."""
    b, t = input_ids.shape
    tokens = entry.tokens
    host = entry.host
    if entry.copied is not None:  # the last step's copy from the pinned buffer must be done before it changes
        entry.copied.synchronize()
    host.zero_()  # padding: token 0 at position 0...
    host[:, 2 * tokens] = cache.num_slots  # ...in the spare slot, from its start
    host[:b, :t] = input_ids
    host[:b, tokens : tokens + t] = step.positions
    host[:b, 2 * tokens] = torch.tensor(step.slots)
    host[:b, 2 * tokens + 1] = torch.tensor(step.starts)
    entry.inputs.copy_(host, non_blocking=True)
    if tokens > 1:  # (over one token, every mask is the token seeing itself)
        entry.host_mask.copy_(_eye(tokens))  # a padding token sees itself alone
        entry.host_mask[:b, :t, :t] = step.mask if step.mask is not None else _causal(t)
        entry.mask.copy_(entry.host_mask, non_blocking=True)
    if entry.copied is not None:
        entry.copied.record()
    entry.replays += 1
    if entry.graph is not None:
        entry.graph.replay()
        return entry.out
    return entry.run()


def capture_report(cache) -> str:
    """One line on the graphs captured over a cache: how many, their cost, their replays."""
    graphs = [e for e in cache.graphs.values() if e.graph is not None]
    seconds = sum(e.seconds for e in graphs)
    replays = sum(e.replays for e in graphs)
    return f"{len(graphs)} CUDA graphs captured in {seconds:.2f} s, replayed {replays} times"


@functools.cache
def _causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()


@functools.cache
def _eye(t: int) -> torch.Tensor:
    return torch.eye(t, dtype=torch.bool)


def _capture(cache, key: tuple, rows: int, tokens: int, make_run) -> Captured:
    """A new bucket's buffers and graph: make_run(entry) gives the static forward over them."""
    dev = cache.k.device
    pinned = dev.type == "cuda"
    entry = Captured(
        inputs=torch.zeros(rows, 2 * tokens + 2, dtype=torch.long, device=dev),
        mask=_eye(tokens).to(dev).repeat(rows, 1, 1),
        host=torch.zeros(rows, 2 * tokens + 2, dtype=torch.long, pin_memory=pinned),
        host_mask=torch.zeros(rows, tokens, tokens, dtype=torch.bool, pin_memory=pinned),
    )
    entry.inputs[:, 2 * tokens] = cache.num_slots  # warm-up and capture write to the spare slot
    entry.run = make_run(entry)
    if dev.type == "cuda":
        with _capture_mode():
            _record(entry, cache, dev)
    cache.graphs[key] = entry
    return entry


_CAPTURING = [False]


def capturing() -> bool:
    """Whether a step is being captured (or warmed up for it) now: attention then keeps torch's
    default kernels (model.attention)."""
    return _CAPTURING[0]


@contextlib.contextmanager
def _capture_mode():
    _CAPTURING[0] = True
    try:
        yield
    finally:
        _CAPTURING[0] = False


def _record(entry: Captured, cache, dev) -> None:
    """Warm the step up on a side stream, then capture it into the cache's memory pool."""
    start = time.perf_counter()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up: lazy initialisations (and Triton's builds) happen outside the capture
        try:
            entry.run()
        except Exception as e:  # a fused kernel that cannot build or run here: torch ops instead
            if not cuda_kernels.available(dev):
                raise
            cuda_kernels.disable(f"{type(e).__name__}: {e}")
            entry.run()
    torch.cuda.current_stream(dev).wait_stream(side)
    if cache.graph_pool is None:  # one pool per cache: its graphs share their working memory
        cache.graph_pool = torch.cuda.graph_pool_handle()
    entry.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(entry.graph, pool=cache.graph_pool):
        entry.out = entry.run()
    torch.cuda.synchronize(dev)
    entry.copied = torch.cuda.Event()
    entry.seconds = time.perf_counter() - start
