"""Quantized weights: GGUF blocks kept at the precision they ship, packed for the native kernels.

A quantized matrix [N, K] is held as `Blocks`: integer values per element and, per row and block
of 32 inputs, a scale d and (4-bit only) an offset m, both fp16:
- `q4`: q in 0..15, w = d * q + m. GGUF's Q4_1 is exactly this; Q4_0 (w = d * (q - 8)) is m = -8d.
- `q8`: q in -127..127, w = d * q. GGUF's Q8_0 is exactly this.
Other GGUF types (the K-quants, Q5_x, ...) are dequantized by `gguf` and re-quantized to q8 per
block of 32 (an error of at most half a step of 1/127 of the block's largest value, far below
their own 4-6 bit steps). A float model is quantized at load with `quantize()`.

`QLinear` runs the native kernels (`specsot_mq/kernels/`, built once per machine with torch's
extension builder); where they cannot be built it says so once and runs the dequantized weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 32
LANES = 8  # output columns interleaved in one vector of the kernels (a half of a group)
GROUP = 16  # output columns per packed group: two halves of LANES, side by side in each block
HALF_BYTES = {"q4": 160, "q8": 272}  # per half group and block of 32 inputs
BLOCK_BYTES = {kind: 2 * n for kind, n in HALF_BYTES.items()}  # per group and block of 32 inputs
KINDS = {"int4": "q4", "int8": "q8"}  # --quantize names


@dataclass(slots=True)
class Blocks:
    """A quantized [N, K] matrix: values q [N, K] (uint8 0..15 for q4, int8 for q8), scales d and
    offsets m (q4 only) [N, K / 32] in fp16."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these blocks stand for."""
        n, k = self.shape
        w = self.q.float().view(n, k // BLOCK, BLOCK) * self.d.float()[..., None]
        if self.m is not None:
            w += self.m.float()[..., None]
        return w.view(n, k)

    def scaled(self, s: float) -> "Blocks":
        """w * s (exact for a power of two, as the attention scale 1/sqrt(head_dim) usually is)."""
        return Blocks(self.kind, self.q, self.d * s, None if self.m is None else self.m * s)

    @staticmethod
    def cat(parts: list["Blocks"]) -> "Blocks":
        """Rows of several matrices of one kind stacked (a fused q/k/v or gate/up projection)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:  # a file mixing types within one fused projection: go to the widest
            parts = [p if p.kind == "q8" else quantize(p.dequantize(), "q8") for p in parts]
        def cat(xs):
            return torch.from_numpy(np.concatenate([x.numpy() for x in xs]))

        m = None if parts[0].m is None else cat([p.m for p in parts])
        return Blocks(parts[0].kind, cat([p.q for p in parts]), cat([p.d for p in parts]), m)


def quantize(w: torch.Tensor, kind: str) -> Blocks:
    """Quantize a float [N, K] matrix per block of 32: q4 by each block's min and max (Q4_1's rule),
    q8 by its largest magnitude (Q8_0's). Values are rounded against the fp16 scales they keep."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"cannot quantize a matrix with {k} inputs: a multiple of {BLOCK} is needed")
    x = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    if kind == "q4":
        lo, hi = x.amin(-1), x.amax(-1)
        d = ((hi - lo) / 15).half()
        m = lo.half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
        q = ((x - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
        return Blocks("q4", q.view(n, k), d, m)
    if kind == "q8":
        d = (x.abs().amax(-1) / 127).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float))
        q = (x * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return Blocks("q8", q.view(n, k), d)
    raise ValueError(f"unknown quantized kind {kind!r}")


def from_ggml(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> Blocks:
    """Blocks of a GGUF tensor's raw bytes ([N, bytes per row], uint8) of type `ggml_type`
    ("Q4_0", "Q4_1", "Q8_0", or any type `gguf` can dequantize)."""
    n, k = shape
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1)
    nb = k // BLOCK
    if ggml_type in ("Q4_0", "Q4_1"):
        head = 2 if ggml_type == "Q4_0" else 4
        blocks = raw.reshape(n, nb, head + 16)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        qs = blocks[..., head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # byte j: inputs j, j + 16
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if ggml_type == "Q4_1" else -8 * d
        return Blocks("q4", torch.from_numpy(q), torch.from_numpy(d.copy()), torch.from_numpy(np.ascontiguousarray(m)))
    if ggml_type == "Q8_0":
        blocks = raw.reshape(n, nb, 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return Blocks("q8", torch.from_numpy(q), torch.from_numpy(d.copy()))
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(raw, GGMLQuantizationType[ggml_type]).reshape(n, k)
    return quantize(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), "q8")


def pack(blocks: Blocks) -> torch.Tensor:
    """The kernel layout (see kernels/qgemm_body.h): rows padded to a multiple of 16, then per group
    of 16 rows and block of 32 inputs two halves of 8 rows, each with its values interleaved 4
    inputs per row, then its d (and m). A group's blocks follow each other, so a tile of 16
    columns reads one sequential stream."""
    n, k = blocks.shape
    pad = -n % GROUP
    h, nb = (n + pad) // LANES, k // BLOCK  # halves
    arrays = [x.numpy() for x in (blocks.q, blocks.d, blocks.m) if x is not None]
    q, *scales = [np.pad(a, ((0, pad), (0, 0))) for a in arrays] if pad else arrays
    out = np.empty((h, nb, HALF_BYTES[blocks.kind]), dtype=np.uint8)
    if blocks.kind == "q4":
        # input 16h + 4v + j of row c -> byte (v, c, j), low nibble for h = 0, high for h = 1
        v = q.reshape(h, LANES, nb, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)
        np.bitwise_or(v[:, :, 0], v[:, :, 1] << 4, out=out[..., :128].reshape(h, nb, 4, LANES, 4))
    else:
        out[..., :256].reshape(h, nb, 8, LANES, 4)[:] = q.view(np.uint8).reshape(h, LANES, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    at = out.shape[-1] - 2 * LANES * len(scales)
    for x in scales:
        out[..., at : at + 2 * LANES].view(np.float16)[:] = x.reshape(h, LANES, nb).transpose(0, 2, 1)
        at += 2 * LANES
    # [half, block, bytes] -> [group, block, (its two halves) bytes]
    out = out.reshape(h // 2, 2, nb, -1).transpose(0, 2, 1, 3).reshape(h // 2, nb, -1)
    return torch.from_numpy(np.ascontiguousarray(out))


def unpack(packed: torch.Tensor, kind: str, index: torch.Tensor, k: int) -> Blocks:
    """Rows `index` [T] of a packed matrix with k inputs, as Blocks (exactly what was packed)."""
    nb = k // BLOCK
    halves = packed.view(packed.shape[0], nb, 2, HALF_BYTES[kind])
    rows = halves[index // GROUP, :, (index % GROUP) // LANES]  # [T, nb, bytes]: the halves holding the rows
    t, col = torch.arange(len(index), device=packed.device), index % LANES
    if kind == "q4":
        v = rows[..., :128].reshape(-1, nb, 4, LANES, 4)[t, :, :, col]  # [T, nb, 4(v), 4(j)]
        q = torch.stack([v & 0x0F, v >> 4], dim=2).reshape(-1, k)  # input 16h + 4v + j
        dm = rows[..., 128:].contiguous().view(torch.float16).view(-1, nb, 2, LANES)[t, :, :, col]
        return Blocks("q4", q, dm[..., 0], dm[..., 1])
    q = rows[..., :256].contiguous().view(torch.int8).view(-1, nb, 8, LANES, 4)[t, :, :, col]
    d = rows[..., 256:].contiguous().view(torch.float16).view(-1, nb, LANES)[t, :, col]
    return Blocks("q8", q.reshape(-1, k), d)


# -- the native kernels -----------------------------------------------------------------------

_KERNELS = Path(__file__).parent / "kernels"
_native = None  # the built extension, False where it cannot be built, None before the first try


def native():
    """The native kernel module, built on first use (about a minute, once per machine and
    source), or None where it cannot run here: then one line on stderr says why."""
    global _native
    if _native is None:
        try:
            _native = _build()
        except Exception as e:  # a failed build raises many types; every one means the same here
            reason = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
            print(f"specsot: the native quantized kernels are not available ({reason}); running "
                  "dequantized weights instead (slower): install a C++ compiler (g++) to fix", file=sys.stderr)  # fmt: skip
            _native = False
    return _native or None


def _build():
    if os.environ.get("SPECSOT_NO_NATIVE"):
        raise RuntimeError("SPECSOT_NO_NATIVE is set")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"no kernels for {platform.machine()} CPUs")
    module = build_kernels(_KERNELS, announce="specsot: building the native quantized kernels (once per machine)...")
    if module.isa() == "none":
        raise RuntimeError("this CPU lacks AVX2/FMA/F16C")
    return module


def build_kernels(folder: Path, name: str = "specsot_qgemm", announce: str | None = None):
    """The kernel sources in `folder` (its .cpp files, and the headers they include) built as a
    module named for them and torch's version, once, under the cache (`announce` goes to stderr
    when a build is needed). benchmarks/kernels.py builds another commit's sources with it."""
    from torch.utils import cpp_extension

    from specsot_mq.pull import specsot_home

    digest = hashlib.sha256(torch.__version__.encode())
    for f in sorted(folder.iterdir()):
        if f.is_file():
            digest.update(f.read_bytes())
    tag = digest.hexdigest()[:12]
    build = specsot_home() / "kernels" / tag
    build.mkdir(parents=True, exist_ok=True)
    try:  # the ninja wheel's binary, when ninja is not on PATH already
        import ninja

        if shutil.which("ninja") is None:
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    if announce and not (build / f"{name}_{tag}.so").exists():
        print(announce, file=sys.stderr)
    return cpp_extension.load(
        name=f"{name}_{tag}", sources=[str(s) for s in sorted(folder.glob("*.cpp"))], build_directory=str(build),
        extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
    )  # fmt: skip


class QLinear(nn.Module):
    """A linear layer over quantized weights: y = x W^T (+ bias), W given as Blocks.

    Runs the native kernel on float32 activations (other dtypes are converted on the way in and
    out); where the kernel is not available the weight is kept dequantized to `dtype`."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.kind = blocks.kind
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernel = native()
        if self.kernel is not None:
            self.register_buffer("packed", pack(blocks))
            self.weight = None
        else:
            self.packed = None
            self.weight = nn.Parameter(blocks.dequantize().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, glu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """As model.Linear.forward: norm(x), or silu * up of x's halves (glu), then the product,
        then + residual; with the kernel, all of it in one native call."""
        if self.packed is None:
            return linear_forward(self, x, norm, glu, residual)
        n = self.out_features
        rows = x.reshape(-1, x.shape[-1]).float()
        fused = residual if residual is not None and n % GROUP == 0 else None
        y = self.kernel.qlinear(rows, self.packed, int(self.kind[1]), n + (-n % GROUP),
                                None if norm is None else norm.weight, 0.0 if norm is None else norm.eps, glu,
                                None if fused is None else fused.reshape(-1, n).float())  # fmt: skip
        if n % GROUP:
            y = y[:, :n]
        if self.bias is not None:
            y = y + self.bias
        if residual is not None and fused is None:
            y = residual.reshape(-1, n).float() + y
        return y.view(*x.shape[:-1], n).to(x.dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + bias with the dequantized weight (no kernel here)."""
        return F.linear(x, self.weight, None if self.bias is None else self.bias.to(x.dtype))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 weight rows at `index` (an embedding lookup of a tied output layer)."""
        if self.packed is None:
            return self.weight[index].float()
        rows = self.kernel.dequantize_rows(self.packed, int(self.kind[1]), self.in_features, index.reshape(-1))
        return rows.view(*index.shape, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The whole weight as float32 [N, K]."""
        return self.rows(torch.arange(self.out_features, device=(self.packed if self.weight is None else self.weight).device))

    def select(self, index: torch.Tensor) -> "QLinear":
        """A QLinear of the rows at `index`, packed as they are (a draft head's reduced output
        layer); kernel path only."""
        return QLinear(unpack(self.packed, self.kind, index, self.in_features))


def linear_forward(layer, x, norm, glu, residual):
    """A layer's forward in torch ops (model.Linear, and QLinear without its kernel)."""
    if norm is not None:
        x = norm(x)
    if glu:
        half = x.shape[-1] // 2
        x = F.silu(x[..., :half]) * x[..., half:]
    y = layer.linear(x)
    return y if residual is None else residual + y


HUGE_PAGE = 2 << 20


def onto_huge_pages(module: nn.Module) -> None:
    """Move the packed weights of every native QLinear in `module` into one buffer that asks the
    OS for 2 MB pages (Linux's transparent huge pages, by madvise; elsewhere, or where they are
    off, the same buffer on ordinary pages). A one-token step streams every weight from memory
    once, and on 4 KB pages it crosses a page, with its TLB miss and a restart of the hardware's
    prefetch, every 4 KB (benchmarks/HISTORY.md has what it gained). The old tensors' memory goes
    back to the OS as they are copied, once nothing else holds them: the caller forgets the
    kernels' forms first (model.NativeForm.forget_all)."""
    layers = list({id(m): m for m in module.modules() if isinstance(m, QLinear) and m.packed is not None}.values())
    if not layers or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    offsets, total = [], 0
    for layer in layers:
        offsets.append(total)
        total += -(-layer.packed.numel() // 64) * 64  # each weight on a cache line of its own
    try:
        region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages, one buffer still
        pass
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -arena.data_ptr() % HUGE_PAGE  # huge pages map 2 MB-aligned addresses only
    freed = 0
    for layer, at in zip(layers, offsets):
        n = layer.packed.numel()
        moved = arena[start + at : start + at + n].view(layer.packed.shape)
        moved.copy_(layer.packed)
        layer.packed = moved
        freed += n
        if freed >= 16 << 20:  # the process's peak memory stays near its final size
            _release_freed_memory()
            freed = 0
    _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): the weights just moved
    were freed into the heap, where they would stay counted in the process's memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class QEmbedding(nn.Module):
    """An embedding lookup over quantized rows (the tied output layer's, or its own): float32."""

    def __init__(self, table: QLinear):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)
