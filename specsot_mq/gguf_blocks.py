"""GGUF's quantized blocks rearranged for the native kernels, in numpy alone (the converter runs it
in processes that never import torch).

A packed matrix holds the GGUF file's own integers (weights, scales, mins) with no widening: rows
by groups of 16 output columns; a group holds its records (a block of 32 inputs, or a K-quant's
super-block of 256) one after another, and within a record every field holds the 16 columns side
by side (kernels/qgemm_body.h draws it). Bytes per weight are the file's, except that a K-quant's
6-bit sub-block scales and mins take a byte each (Q4_K 4.625 bits per weight against the file's
4.5, Q5_K 5.625 against 5.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

BLOCK = 32
GROUP = 16  # output columns per packed group


@dataclass(frozen=True)
class Format:
    """A packed format: the GGUF type it holds, the kernels' number for it, its weights' bits (4, 5
    or 6 unsigned, 8 signed), blocks of 32 inputs per record, and the fields of a record's header
    and of each block's scales, as (name, bytes per column)."""

    name: str
    code: int
    bits: int
    blocks: int = 1
    head: tuple[tuple[str, int], ...] = ()
    scales: tuple[tuple[str, int], ...] = (("d", 2),)

    @property
    def inputs(self) -> int:
        """Inputs per record (K must be a multiple)."""
        return BLOCK * self.blocks

    @cached_property
    def segments(self) -> tuple[int, ...]:
        """Bytes per column of each field of a record, in order: each field holds the 16 columns of
        a group side by side. A block's weights are vectors of 4 bytes per column: 4 of nibbles (8
        of signed bytes for 8 bits), then one (5 bits) or two (6 bits) of high bits."""
        weights = (4,) * (8 if self.bits == 8 else 4 + max(0, self.bits - 4))
        block = weights + tuple(e for _, e in self.scales)
        return tuple(e for _, e in self.head) + block * self.blocks

    @cached_property
    def fp16_fields(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) in a packed record of every fp16 scale field (d, m, dmin: what scaling the
        matrix scales; the byte fields are the file's integer multipliers)."""
        names = [n for n, _ in self.head] + ([None] * (8 if self.bits == 8 else 4 + max(0, self.bits - 4))
                                              + [n for n, _ in self.scales]) * self.blocks  # fmt: skip
        spans, at = [], 0
        for name, e in zip(names, self.segments):
            if name in ("d", "m", "dmin"):
                spans.append((at, at + GROUP * e))
            at += GROUP * e
        return tuple(spans)

    @cached_property
    def column_bytes(self) -> int:
        return sum(self.segments)

    @cached_property
    def _order(self) -> np.ndarray:
        """The packed record's bytes as indices into its 16 columns' bytes ([column, bytes] flat)."""
        order, at = [], 0
        for e in self.segments:
            order.append((np.arange(GROUP)[:, None] * self.column_bytes + at + np.arange(e)).reshape(-1))
            at += e
        return np.concatenate(order)

    @cached_property
    def _positions(self) -> np.ndarray:
        """_order's inverse: [16 columns, column bytes], where each column's bytes lie in a packed record."""
        where = np.empty_like(self._order)
        where[self._order] = np.arange(len(self._order))
        return where.reshape(GROUP, self.column_bytes)


FORMATS = {f.name: f for f in (
    Format("Q4_0", 1, 4),
    Format("Q4_1", 2, 4, scales=(("d", 2), ("m", 2))),
    Format("Q5_0", 3, 5),
    Format("Q5_1", 4, 5, scales=(("d", 2), ("m", 2))),
    Format("Q8_0", 5, 8),
    Format("Q4_K", 6, 4, 8, (("d", 2), ("dmin", 2)), (("sc", 1), ("min", 1))),
    Format("Q5_K", 7, 5, 8, (("d", 2), ("dmin", 2)), (("sc", 1), ("min", 1))),
    Format("Q6_K", 8, 6, 8, (("d", 2),), (("sc", 1), ("sc_hi", 1))),
)}  # fmt: skip



def pack_columns(fmt: Format, columns: np.ndarray) -> np.ndarray:
    """Per-row record bytes [n, records, column bytes] (each field's bytes of one row, in record
    order) in the grouped layout [groups of 16 rows (the last padded), records, record bytes]."""
    n, records, _ = columns.shape
    pad = -n % GROUP
    if pad:
        columns = np.concatenate([columns, np.zeros((pad, records, fmt.column_bytes), np.uint8)])
    grouped = columns.reshape(-1, GROUP, records, fmt.column_bytes).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(grouped.reshape(-1, records, GROUP * fmt.column_bytes)[..., fmt._order])


def unpack_columns(fmt: Format, packed: np.ndarray) -> np.ndarray:
    """pack_columns' inverse: [groups * 16, records, column bytes] (padding rows included)."""
    groups, records, _ = packed.shape
    flat = np.empty_like(packed)
    flat[..., fmt._order] = packed
    flat = flat.reshape(groups, records, GROUP, fmt.column_bytes).transpose(0, 2, 1, 3)
    return flat.reshape(groups * GROUP, records, fmt.column_bytes)


def gather_columns(fmt: Format, packed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """unpack_columns(fmt, packed)[rows], reading only those rows' bytes."""
    records = packed.shape[1]
    return packed[(rows // GROUP)[:, None, None], np.arange(records)[None, :, None], fmt._positions[rows % GROUP][:, None, :]]


def pack_ggml(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> np.ndarray:
    """A GGUF tensor's raw bytes ([N, bytes per row], uint8) of one of FORMATS' types, packed."""
    fmt = FORMATS[ggml_type]
    n, k = shape
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // fmt.inputs, -1)
    return pack_columns(fmt, assemble(fmt, GGUF_READERS[ggml_type](raw)))


# -- GGUF blocks <-> per-row fields ------------------------------------------------------------
# A record's fields as arrays over [rows, records, ...]: "q" the weights' unsigned values (Q8_0: its
# signed bytes) in input order [.., blocks * 32], the header's fp16 fields as 2 bytes each
# [.., 2], a block's scale fields [.., blocks, bytes].


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at : at + 2]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Values of 32 weights from 16 bytes: low nibbles first, then high ones (GGUF's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(bits: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian bit string [.., bytes], for i < count, as uint8 [.., count]."""
    return np.unpackbits(bits, axis=-1, bitorder="little")[..., :count]


def _read_q4_0(raw):
    return {"q": _nibbles(raw[..., 2:18]), "d": _half(raw, 0)[..., None, :]}


def _read_q4_1(raw):
    return {"q": _nibbles(raw[..., 4:20]), "d": _half(raw, 0)[..., None, :], "m": _half(raw, 2)[..., None, :]}


def _read_q5_0(raw):
    return {"q": _nibbles(raw[..., 6:22]) | (_high_bits(raw[..., 2:6], 32) << 4), "d": _half(raw, 0)[..., None, :]}


def _read_q5_1(raw):
    q = _nibbles(raw[..., 8:24]) | (_high_bits(raw[..., 4:8], 32) << 4)
    return {"q": q, "d": _half(raw, 0)[..., None, :], "m": _half(raw, 2)[..., None, :]}


def _read_q8_0(raw):
    return {"q": raw[..., 2:34], "d": _half(raw, 0)[..., None, :]}


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 8 six-bit scales and mins from their 12 bytes: bytes 0-3 hold scales 0-3 (and
    the top bits of scales 4-7), 4-7 mins 0-3 (and those of mins 4-7), 8-11 the low nibbles of 4-7."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_weights(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's low nibbles: each 32 bytes hold 64 weights, low nibbles first."""
    return _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 256)


def _read_q4_k(raw):
    sc, mn = _k_scales(raw[..., 4:16])
    return {"q": _k_weights(raw[..., 16:144]), "d": _half(raw, 0), "dmin": _half(raw, 2),
            "sc": sc[..., None], "min": mn[..., None]}  # fmt: skip


def _read_q5_k(raw):
    sc, mn = _k_scales(raw[..., 4:16])
    return {"q": _k_weights(raw[..., 48:176]) | (_q5k_high(raw[..., 16:48]) << 4), "d": _half(raw, 0), "dmin": _half(raw, 2),
            "sc": sc[..., None], "min": mn[..., None]}  # fmt: skip


def _q5k_high(qh: np.ndarray) -> np.ndarray:
    """Q5_K's fifth bits: bit i of byte l belongs to weight 32 i + l."""
    bits = np.unpackbits(qh[..., None], axis=-1, bitorder="little")  # [.., 32 (l), 8 (i)]
    return bits.swapaxes(-1, -2).reshape(*qh.shape[:-1], 256)


def _read_q6_k(raw):
    lead = raw.shape[:-1]
    ql, qh = raw[..., 0:128].reshape(*lead, 2, 64), raw[..., 128:192].reshape(*lead, 2, 32)
    # per half of 128 weights: ql's low nibbles are weights 0-63, its high ones 64-127; qh's 2-bit
    # pairs, from the lowest, add the top bits of weights l, l + 32, l + 64, l + 96
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    sc = raw[..., 192:208].reshape(*lead, 8, 2)
    return {"q": (low | (high << 4)).reshape(*lead, 256), "d": _half(raw, 208), "sc": sc[..., :1],
            "sc_hi": sc[..., 1:]}  # fmt: skip


GGUF_READERS = {"Q4_0": _read_q4_0, "Q4_1": _read_q4_1, "Q5_0": _read_q5_0, "Q5_1": _read_q5_1,
                 "Q8_0": _read_q8_0, "Q4_K": _read_q4_k, "Q5_K": _read_q5_k, "Q6_K": _read_q6_k}  # fmt: skip


def assemble(fmt: Format, fields: dict[str, np.ndarray]) -> np.ndarray:
    """Per-row record bytes [n, records, column bytes] from a record's fields."""
    q = fields["q"].view(np.uint8)
    lead = q.shape[:-1]
    q = q.reshape(*lead, fmt.blocks, 2, 4, 4)  # [.., block, half (inputs 0-15, 16-31), v, j]
    if fmt.bits == 8:
        weights = [q.reshape(*lead, fmt.blocks, 32)]
    else:
        lo, hi = q[..., 0, :, :], q[..., 1, :, :]
        weights = [((lo & 0x0F) | ((hi & 0x0F) << 4)).reshape(*lead, fmt.blocks, 16)]
        shift = np.arange(4, dtype=np.uint8)[:, None]  # by v
        if fmt.bits == 5:
            plane = (((lo >> 4) & 1) << shift) | (((hi >> 4) & 1) << (shift + 4))
            weights.append(np.bitwise_or.reduce(plane, axis=-2))
        elif fmt.bits == 6:
            for half in (lo, hi):
                weights.append(np.bitwise_or.reduce(((half >> 4) & 3) << (2 * shift), axis=-2))
    block = np.concatenate(weights + [fields[name].reshape(*lead, fmt.blocks, -1) for name, _ in fmt.scales], axis=-1)
    head = [fields[name].reshape(*lead, -1) for name, _ in fmt.head]
    return np.ascontiguousarray(np.concatenate(head + [block.reshape(*lead, -1)], axis=-1))


def fields_of(fmt: Format, columns: np.ndarray) -> dict[str, np.ndarray]:
    """A record's fields from per-row record bytes (assemble's inverse)."""
    lead = columns.shape[:-1]
    fields, at = {}, 0
    for name, e in fmt.head:
        fields[name] = columns[..., at : at + e]
        at += e
    weight_bytes = 32 if fmt.bits == 8 else 16 + 4 * max(0, fmt.bits - 4)
    block = columns[..., at:].reshape(*lead, fmt.blocks, -1)
    w, field_at = block[..., :weight_bytes], weight_bytes
    for name, e in fmt.scales:
        fields[name] = block[..., field_at : field_at + e]
        field_at += e
    if fmt.bits == 8:
        fields["q"] = w.reshape(*lead, fmt.inputs)
        return fields
    nib = w[..., :16].reshape(*lead, fmt.blocks, 4, 4)
    lo, hi = nib & 0x0F, nib >> 4
    shift = np.arange(4, dtype=np.uint8)[:, None]
    if fmt.bits == 5:
        plane = w[..., 16:20].reshape(*lead, fmt.blocks, 1, 4)
        lo, hi = lo | (((plane >> shift) & 1) << 4), hi | (((plane >> (shift + 4)) & 1) << 4)
    elif fmt.bits == 6:
        pl, ph = (w[..., i : i + 4].reshape(*lead, fmt.blocks, 1, 4) for i in (16, 20))
        lo, hi = lo | (((pl >> (2 * shift)) & 3) << 4), hi | (((ph >> (2 * shift)) & 3) << 4)
    fields["q"] = np.stack([lo, hi], axis=-3).reshape(*lead, fmt.inputs)
    return fields


def dequantize_columns(fmt: Format, columns: np.ndarray, k: int) -> np.ndarray:
    """The float32 matrix [n, k] of per-row record bytes, by the GGUF type's own formula."""
    f = fields_of(fmt, columns)
    n = columns.shape[0]

    def half(name):
        return np.ascontiguousarray(f[name]).view(np.float16).astype(np.float32)

    # block fields are [rows, records, block, 1], header ones [rows, records, 1]; q is
    # [rows, records, block, half, 16]
    q = f["q"].reshape(n, -1, fmt.blocks, 2, 16)
    if fmt.name == "Q8_0":
        w = half("d")[..., None] * q.view(np.int8).astype(np.float32)
    elif fmt.name in ("Q4_0", "Q5_0"):
        w = half("d")[..., None] * (q.astype(np.float32) - (8 if fmt.name == "Q4_0" else 16))
    elif fmt.name in ("Q4_1", "Q5_1"):
        w = half("d")[..., None] * q.astype(np.float32) + half("m")[..., None]
    elif fmt.name == "Q6_K":
        sc = np.concatenate([f["sc"], f["sc_hi"]], axis=-1).view(np.int8).astype(np.float32)  # [.., block, half]
        w = (half("d")[..., None] * sc)[..., None] * (q.astype(np.float32) - 32)
    else:  # Q4_K, Q5_K
        s = half("d")[..., None] * f["sc"].astype(np.float32)
        m = half("dmin")[..., None] * f["min"].astype(np.float32)
        w = s[..., None] * q.astype(np.float32) - m[..., None]
    return np.ascontiguousarray(w.reshape(n, k), dtype=np.float32)
