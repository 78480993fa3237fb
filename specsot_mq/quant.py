"""Quantized weights: GGUF blocks kept at the precision they ship, packed for the native kernels.

A quantized matrix [N, K] is a `QWeight`: the GGUF file's own integers (weights, scales, mins)
rearranged for the kernels with no widening (gguf_blocks.py). The formats are GGUF's Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K (what Q4_K_M and Q5_K_M files mix); other GGUF
types (Q2_K, Q3_K, IQ*) become Q8_0 when a file is converted, with one line saying so. A float
model is quantized at load with `quantize()`.

`QLinear` runs the native kernels (`specsot_mq/kernels/`, built once per machine with torch's
extension builder); where they cannot be built it says so once and runs the dequantized weights.
"""

from __future__ import annotations

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

from specsot_mq.gguf_blocks import (BLOCK, FORMATS, GROUP, Format, dequantize_columns,
                                    gather_columns, pack_columns, pack_ggml, unpack_columns)  # fmt: skip
from specsot_mq.openmp import release_freed_memory

KINDS = {"int4": "Q4_1", "int8": "Q8_0"}  # --quantize names


@dataclass(slots=True)
class QWeight:
    """A quantized [n, k] matrix in a packed format (gguf_blocks): data [groups of 16 rows,
    records, record bytes] (rows padded to a multiple of 16)."""

    format: Format
    n: int
    k: int
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def columns(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The per-row record bytes [n (or len(rows)), records, column bytes]."""
        if rows is not None:
            return gather_columns(self.format, self.data.numpy(), rows)
        return unpack_columns(self.format, self.data.numpy())[: self.n]

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix, by the GGUF type's own formula (as gguf's dequantize computes it)."""
        return torch.from_numpy(dequantize_columns(self.format, self.columns(), self.k))

    def select(self, rows: torch.Tensor) -> "QWeight":
        """The rows at `rows`, exactly as they are (a draft head's reduced output layer)."""
        picked = np.ascontiguousarray(self.columns(rows.cpu().numpy()))
        return QWeight(self.format, len(picked), self.k, torch.from_numpy(pack_columns(self.format, picked)))

    def scaled(self, s: float) -> "QWeight":
        """w * s, by scaling the fp16 scale fields where they lie in the packed records (exact for a
        power of two, as the attention scale 1/sqrt(head_dim) usually is)."""
        data = self.data.numpy().copy()
        for start, stop in self.format.fp16_fields:
            field = data[..., start:stop].view(np.float16)
            field *= np.float16(s)
        return QWeight(self.format, self.n, self.k, torch.from_numpy(data))

    @staticmethod
    def cat(parts: list["QWeight"]) -> "QWeight":
        """Rows of several matrices of one format stacked: their groups one after another where
        every part but the last fills whole groups, else repacked."""
        fmt, k = parts[0].format, parts[0].k
        assert all(p.format == fmt and p.k == k for p in parts)
        n = sum(p.n for p in parts)
        if all(p.n % GROUP == 0 for p in parts[:-1]):
            return QWeight(fmt, n, k, torch.cat([p.data for p in parts]))
        columns = np.concatenate([p.columns() for p in parts])
        return QWeight(fmt, n, k, torch.from_numpy(pack_columns(fmt, columns)))


def fuse(parts: list[QWeight]) -> list[QWeight]:
    """Matrices stacked by rows (a fused q/k/v or gate/up projection) as the parts of one QLinear:
    neighbours of one format merged. Where a GGUF file quantized them in different formats (Q4_K_M
    gives v and down Q6_K in some layers) each keeps its own, which needs whole groups of 16 rows in
    every part but the last; else all become Q8_0."""
    merged: list[list[QWeight]] = []
    for p in parts:
        if merged and merged[-1][0].format == p.format:
            merged[-1].append(p)
        else:
            merged.append([p])
    out = [m[0] if len(m) == 1 else QWeight.cat(m) for m in merged]
    if any(p.n % GROUP for p in out[:-1]):
        return [quantize(torch.cat([p.dequantize() for p in out]), "Q8_0")]
    return out


def quantize(w: torch.Tensor, kind: str) -> QWeight:
    """Quantize a float [N, K] matrix to GGUF type `kind` (Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0, with
    gguf's own quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as ggml_quantize

    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"cannot quantize a matrix with {k} inputs: a multiple of {BLOCK} is needed")
    raw = ggml_quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType[kind])
    return from_ggml(raw, kind, (n, k))


def from_ggml(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> QWeight:
    """A GGUF tensor's raw bytes ([N, bytes per row], uint8) of one of FORMATS' types."""
    return QWeight(FORMATS[ggml_type], shape[0], shape[1], torch.from_numpy(pack_ggml(raw, ggml_type, shape)))


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
    """A linear layer over quantized weights: y = x W^T (+ bias), W given as QWeight parts stacked by
    rows (see fuse).

    Runs the native kernel on float32 activations (other dtypes are converted on the way in and
    out); where the kernel is not available the weight is kept dequantized to `dtype`."""

    def __init__(self, weights: QWeight | list[QWeight], bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        super().__init__()
        parts = weights if isinstance(weights, list) else [weights]
        self.out_features, self.in_features = sum(p.n for p in parts), parts[0].k
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernel = native()
        if self.kernel is not None:
            self.parts = parts
            self.weight = None
        else:
            self.parts = None
            self.weight = nn.Parameter(torch.cat([p.dequantize() for p in parts]).to(dtype), requires_grad=False)

    def native_weights(self):
        """The kernels' `Weights` over the parts (worked out once; onto_huge_pages and
        NativeForm.forget_all forget it), or None without the kernels."""
        if self.parts is None:
            return None
        if "_native" not in self.__dict__:
            self.__dict__["_native"] = self.kernel.Weights([p.data for p in self.parts],
                                                           [p.format.code for p in self.parts], self.in_features)
        return self.__dict__["_native"]

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, glu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """As model.Linear.forward: norm(x), or silu * up of x's halves (glu), then the product,
        then + residual; with the kernel, all of it in one native call."""
        if self.parts is None:
            return linear_forward(self, x, norm, glu, residual)
        n = self.out_features
        rows = x.reshape(-1, x.shape[-1]).float()
        fused = residual if residual is not None and n % GROUP == 0 else None
        y = self.kernel.qlinear(rows, self.native_weights(), None if norm is None else norm.weight,
                                0.0 if norm is None else norm.eps, glu,
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
        if self.parts is None:
            return self.weight[index].float()
        rows = self.kernel.dequantize_rows(self.native_weights(), index.reshape(-1))
        return rows.view(*index.shape, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The whole weight as float32 [N, K]."""
        if self.parts is None:
            return self.weight.float()
        return torch.cat([p.dequantize() for p in self.parts])

    def select(self, index: torch.Tensor) -> "QLinear":
        """A QLinear of the rows at `index`, exactly as they are (a draft head's reduced output
        layer); kernel path, one part only."""
        (part,) = self.parts
        return QLinear(part.select(index))


def linear_forward(layer, x, norm, glu, residual):
    """A layer's forward in torch ops (model.Linear, and QLinear without its kernel)."""
    if norm is not None:
        x = norm(x)
    if glu:
        half = x.shape[-1] // 2
        x = F.silu(x[..., :half]) * x[..., half:]
    if residual is not None and x.is_cuda and layer.bias is None:  # the residual added by the matmul itself
        weight = layer.weight
        return torch.addmm(residual.reshape(-1, weight.shape[0]), x.reshape(-1, x.shape[-1]), weight.t()).view(residual.shape)
    y = layer.linear(x)
    return y if residual is None else residual + y


HUGE_PAGE = 2 << 20


def native_layers(module: nn.Module) -> list[QLinear]:
    """`module`'s quantized layers that run on the kernels, each once (a tied one is listed twice)."""
    return list({id(m): m for m in module.modules() if isinstance(m, QLinear) and m.parts is not None}.values())


def last_level_cache_bytes() -> int:
    """The CPU's largest cache, as Linux lists cpu0's (0 where it lists none)."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes)


def set_prefetch(module: nn.Module) -> int | None:
    """Whether a product of one to three rows prefetches the next column group's weights, for the
    kernels of `module`'s quantized layers: where their packed weights fit half the CPU's
    last-level cache (the other half left to what else runs: the KV cache, another stage's
    layers). The default model's 97 MB on the Intel Xeon VM's 480 MB L3 ran one to three tokens
    faster with it (docs/speed.md); SmolLM2-1.7B's 1 GB, read from memory, ran a token slower in a
    probe, the hardware's own prefetch streaming memory better, and on AVX-512 Zen 4 (32 MB L3)
    the default model gained nothing. Sets the kernels' prefetch_min_rows (1 where they fit,
    else 4) and returns it; None without the kernels."""
    layers = native_layers(module)
    kernel = layers[0].kernel if layers else None
    if kernel is None or not hasattr(kernel, "set_prefetch_min_rows"):
        return None
    weights = sum(p.data.numel() for layer in layers for p in layer.parts)
    rows = 1 if 2 * weights <= last_level_cache_bytes() else 4
    kernel.set_prefetch_min_rows(rows)
    return rows


def onto_huge_pages(module: nn.Module) -> None:
    """Move the packed weights of every native QLinear in `module` into one buffer that asks the
    OS for 2 MB pages (Linux's transparent huge pages, by madvise; elsewhere, or where they are
    off, the same buffer on ordinary pages). A one-token step streams every weight from memory
    once, and on 4 KB pages it crosses a page, with its TLB miss and a restart of the hardware's
    prefetch, every 4 KB (benchmarks/HISTORY.md has what it gained). The old tensors' memory goes
    back to the OS as they are copied, once nothing else holds them: the caller forgets the
    kernels' forms first (model.NativeForm.forget_all)."""
    layers = native_layers(module)
    parts = [p for layer in layers for p in layer.parts]
    if not parts or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        total += -(-p.data.numel() // 64) * 64  # each weight on a cache line of its own
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
    for layer in layers:
        layer.__dict__.pop("_native", None)
    freed = 0
    for p, at in zip(parts, offsets):
        n = p.data.numel()
        moved = arena[start + at : start + at + n].view(p.data.shape)
        moved.copy_(p.data)
        p.data = moved
        freed += n
        if freed >= 16 << 20:  # the process's peak memory stays near its final size
            release_freed_memory()
            freed = 0
    release_freed_memory()


class QEmbedding(nn.Module):
    """An embedding lookup over quantized rows (the tied output layer's, or its own): float32."""

    def __init__(self, table: QLinear):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)
