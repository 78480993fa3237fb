"""A reference quantizer for the GGUF K-quant types gguf cannot quantize (Q4_K, Q5_K, Q6_K), written
from the block layout alone: plain rounding, no search for the best scales (llama.cpp's quantizer
errs less; the layout and the meaning of every field are what the tests need). Other types use
gguf's own quantizer."""

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _fp16_value(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16, at least fp16's smallest positive value (an all-zero block's scale)."""
    return np.maximum(x.astype(np.float16), np.float16(6e-8)).astype(np.float32)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes of 8 six-bit scales and mins: bytes 0-3 scales 0-3 (top bits: those
    of scales 4-7), 4-7 mins 0-3 (top bits: mins 4-7), 8-11 the low nibbles of scale and min 4-7."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return out


def _quantize_q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """x [blocks, 256] -> Q4_K (144 bytes) or Q5_K (176 bytes) blocks: w = d sc q - dmin m."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / top
    d = np.maximum(scale.max(-1), 1e-12) / 63
    dmin = np.maximum(-low.min(-1), 1e-12) / 63
    d16, dmin16 = _fp16_value(d), _fp16_value(dmin)
    sc = np.clip(np.round(scale / d16[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin16[:, None]), 0, 63).astype(np.uint8)
    step = d16[:, None] * sc
    q = np.round((sub + (dmin16[:, None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8).reshape(-1, 4, 2, 32)  # [block, 64-weight chunk, half, 32]
    qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    head = [_fp16(d16), _fp16(dmin16), _pack_k_scales(sc, mn)]
    if bits == 4:
        return np.concatenate(head + [qs], axis=-1)
    high = (q.reshape(-1, 8, 32) >> 4) & 1  # bit i of byte l: weight 32 i + l
    qh = np.zeros((len(x), 32), np.uint8)
    for i in range(8):
        qh |= high[:, i] << i
    return np.concatenate(head + [qh, qs], axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x [blocks, 256] -> Q6_K (210 bytes) blocks: w = d sc (q - 32), 16 sub-blocks of 16."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = np.maximum(scale.max(-1), 1e-12) / 127
    d16 = _fp16_value(d)
    sc = np.clip(np.round(scale / d16[:, None]), -128, 127).astype(np.int8)
    step = d16[:, None] * sc
    q = np.round(sub / np.where(step != 0, step, 1)[..., None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half of 128, quarter, 32]
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _fp16(d16)], axis=-1)


def quantize(w: np.ndarray, ggml_type: str) -> np.ndarray:
    """A float32 matrix [N, K] as GGUF raw bytes [N, bytes per row] of `ggml_type`."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if ggml_type in ("Q4_K", "Q5_K"):
        return _quantize_q45_k(w.reshape(-1, 256), 4 if ggml_type == "Q4_K" else 5).reshape(n, -1)
    if ggml_type == "Q6_K":
        return _quantize_q6_k(w.reshape(-1, 256)).reshape(n, -1)
    return gguf_quantize(w, GGMLQuantizationType[ggml_type]).reshape(n, -1)
