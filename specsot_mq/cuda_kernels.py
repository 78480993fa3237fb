"""Two fused kernels (Triton) for the steps a GPU replays as CUDA graphs (cuda_graphs.py).

A captured step of a small model costs what its kernels' launches cost, a few microseconds each,
so every kernel a layer saves counts. In torch ops, rope is three kernels (a product, the halves
swapped, a multiply-add), writing the new keys and values into the cache two more, and the
feed-forward's silu(gate) * up two. Here:

- `rope_store`: one kernel rotates q and k of every new token, writes q out for attention and k
  and v straight into the cache at each row's slot and position;
- `silu_mul`: one kernel for the feed-forward's gate.

Each computes in float32 and rounds once, row by row, so a row gets the same bits whatever the
batch (speculative decoding stays lossless). They run where Triton runs them (a CUDA device, or
TRITON_INTERPRET=1 on a CPU, as the tests do); `available()` says whether, and
SPECSOT_FUSED_KERNELS=0 turns them off.
"""

from __future__ import annotations

import functools
import os
import sys

import torch


@functools.cache
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rope_store(qkv, cos, sin, q_out, cache, slots, s_slots, pos, tokens, nh, nkv, s_row, s_which, s_slot, s_head, s_pos,
                   D: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)  # the new token: row b * tokens + t
        h = tl.program_id(1)  # the head: q heads, then k heads, then v heads
        i = tl.arange(0, D)
        x = tl.load(qkv + r * s_row + h * D + i).to(tl.float32)
        if h < nh + nkv:  # q or k: x * cos + (its halves swapped) * sin, sin's first half negated
            partner = tl.load(qkv + r * s_row + h * D + (i + HALF) % D).to(tl.float32)
            c = tl.load(cos + r * D + i).to(tl.float32)
            s = tl.load(sin + r * D + i).to(tl.float32)
            x = x * c + partner * s
        if h < nh:
            tl.store(q_out + (r * nh + h) * D + i, x.to(q_out.dtype.element_ty))
        else:
            which = (h - nh) // nkv  # 0: a key, 1: a value
            head = h - nh - which * nkv
            slot = tl.load(slots + (r // tokens) * s_slots)
            at = tl.load(pos + r)
            where = cache + which * s_which + slot * s_slot + head * s_head + at * s_pos + i
            tl.store(where, x.to(cache.dtype.element_ty))

    @triton.jit
    def silu_mul(x, out, n, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = c < n
        gate = tl.load(x + r * 2 * n + c, mask=keep).to(tl.float32)
        up = tl.load(x + r * 2 * n + n + c, mask=keep).to(tl.float32)
        tl.store(out + r * n + c, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=keep)

    return rope_store, silu_mul


_FAILED: list[str] = []  # why the kernels failed here, once they have


def disable(reason: str) -> None:
    """Stop using the kernels in this process (they failed to build or run), saying so once."""
    if not _FAILED:
        print(f"specsot: the fused GPU kernels failed ({reason[:200]}); captured steps use torch ops", file=sys.stderr)
    _FAILED.append(reason)


def available(device: torch.device) -> bool:
    """Whether the fused kernels run on `device` here."""
    if _FAILED or os.environ.get("SPECSOT_FUSED_KERNELS", "1") == "0":
        return False
    runs = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return runs and _triton() is not None


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor, nh: int, nkv: int) -> torch.Tensor:  # fmt: skip
    """q rotated, [B, T, nh, D], from qkv [B, T, (nh + 2 nkv) D] (contiguous rows); k rotated and v
    written into one layer's cache `kv` [2, slots, nkv, capacity, D] at slots[b] and positions[b, t].
    cos and sin: [B, T, 1, D] (sin's first half negated, as model._rope takes them)."""
    b, t, width = qkv.shape
    d = width // (nh + 2 * nkv)
    rows = qkv.reshape(b * t, width)
    q = torch.empty(b, t, nh, d, dtype=qkv.dtype, device=qkv.device)
    kernel, _ = _triton()
    kernel[(b * t, nh + 2 * nkv)](
        rows, cos.reshape(b * t, d).contiguous(), sin.reshape(b * t, d).contiguous(), q, kv, slots, slots.stride(0),
        positions.reshape(-1).contiguous(), t, nh, nkv, rows.stride(0), kv.stride(0), kv.stride(1), kv.stride(2),
        kv.stride(3), D=d, HALF=d // 2,
    )  # fmt: skip
    return q


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of x [..., 2N] (contiguous), as [..., N]."""
    n = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block = 1024
    _, kernel = _triton()
    kernel[(rows.shape[0], (n + block - 1) // block)](rows, out, n, BLOCK=block)
    return out
