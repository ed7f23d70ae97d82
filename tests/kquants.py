"""GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K) written from float weights in numpy, for tiny test models: gguf-py reads
them (`gguf.quants.dequantize`) but has no quantizer. A plain one, not llama.cpp's search for the best scales: per
sub-block the range (Q4_K, Q5_K: minimum and maximum; Q6_K: largest magnitude) over the code levels, the sub-block
scales then quantized to 6 bits (8 for Q6_K) against the block's fp16 scale; the layouts are ggml's (block_q4_K,
block_q5_K, block_q6_K), checked by tests/test_gguf_types.py against gguf's dequantization."""
from __future__ import annotations

import numpy as np


def _round(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _k_scales(x: np.ndarray, levels: int):
    """(d, dmin, sc, mn, codes) of super-blocks x [B, 8, 32]: w = d sc q - dmin mn."""
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, low = (hi - lo) / levels, -lo  # per sub-block, both >= 0
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (low.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(_round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63)
    mn = np.clip(_round(np.divide(low, dminf, out=np.zeros_like(low), where=dminf > 0)), 0, 63)
    step = (df * sc)[..., None]
    codes = np.clip(_round(np.divide(x + (dminf * mn)[..., None], step, out=np.zeros_like(x), where=step > 0)),
                    0, levels)
    return d, dmin, sc, mn, codes


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """ggml's 12 bytes of 6-bit scales and minimums (the inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _nibbles_k(codes: np.ndarray) -> np.ndarray:
    """[B, 256] codes -> qs [B, 128]: chunk c of 64: its first 32 in the low nibbles, its last 32 in the high."""
    c = codes.reshape(-1, 4, 2, 32) & 0x0F
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """Float [N, K] (K a multiple of 256) as GGUF blocks of `kind` (Q4_K, Q5_K or Q6_K): uint8 [N, K/256 * bytes]."""
    n, k = w.shape
    x = np.asarray(w, np.float32).reshape(-1, 256)
    half = lambda v: np.asarray(v, np.float16).reshape(-1, 1).view(np.uint8)  # noqa: E731
    if kind == "Q6_K":
        amax = np.abs(x.reshape(-1, 16, 16)).max(-1)  # [B, 16]
        scale = amax / 32
        d = (scale.max(-1) / 127).astype(np.float16)
        df = d.astype(np.float32)[:, None]
        sc = np.clip(_round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127)
        step = np.repeat(df * sc, 16, axis=-1)
        codes = np.clip(_round(np.divide(x, step, out=np.zeros_like(x), where=step > 0)) + 32, 0, 63)
        ql, qh = np.zeros((x.shape[0], 128), np.uint8), np.zeros((x.shape[0], 64), np.uint8)
        for h in range(2):
            c = codes[:, 128 * h:128 * h + 128]
            ql[:, 64 * h:64 * h + 32] = (c[:, 0:32] & 0x0F) | ((c[:, 64:96] & 0x0F) << 4)
            ql[:, 64 * h + 32:64 * h + 64] = (c[:, 32:64] & 0x0F) | ((c[:, 96:128] & 0x0F) << 4)
            qh[:, 32 * h:32 * h + 32] = ((c[:, 0:32] >> 4) | ((c[:, 32:64] >> 4) << 2) | ((c[:, 64:96] >> 4) << 4)
                                         | ((c[:, 96:128] >> 4) << 6))
        blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), half(d)], axis=-1)
        return blocks.reshape(n, -1)
    levels = {"Q4_K": 15, "Q5_K": 31}[kind]
    d, dmin, sc, mn, codes = _k_scales(x.reshape(-1, 8, 32), levels)
    codes = codes.reshape(-1, 256)
    parts = [half(d), half(dmin), _pack_scales(sc, mn)]
    if kind == "Q5_K":  # bit 4 of chunk c's first 32 in bit 2c of qh[l], of its last 32 in bit 2c + 1
        high = (codes >> 4).reshape(-1, 8, 32)  # [B, 2c + half, l]
        parts.append((high << np.arange(8)[None, :, None]).sum(1).astype(np.uint8))
    parts.append(_nibbles_k(codes))
    return np.concatenate(parts, axis=-1).astype(np.uint8).reshape(n, -1)
