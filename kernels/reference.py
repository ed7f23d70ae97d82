"""The documented arithmetic of specrt's CPU kernels (kernels/cpu) in numpy: what tests/test_cpu_kernels.py holds the
library's results to, operation for operation where the kernels promise bits, and the plain float math where they
promise a bound.

A GGUF weight format is one entry of `FORMATS`: its block's elements and bytes, and how a block's bytes give, per 32
weights, the scales D of its two halves, its minimum M and its 32 integer codes c, with the format's code offset o,
so that weight i is D[i // 16]·(c_i + o) + M (the K-quants' D = d·sc and M = -dmin·mn, exact in float32), and a
row's product with activation blocks quantized to int8 (scale d_a, codes q) is
Σ_blocks Σ_halves D_h·d_a·(Σ_h c·q + o·Σ_h q) + M·d_a·Σq (the packed dot).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per block, every format


def _half(b: np.ndarray) -> np.ndarray:
    """float16 at the front of each block's bytes [..., 2+] as float32."""
    return b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """32 codes from 16 bytes: the low nibbles, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int32)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of the little-endian bytes qh [..., count / 8], i < count, as [..., count] (0 or 1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count].astype(np.int32)


def _per_block(d: np.ndarray) -> np.ndarray:
    """One scale per 32 weights as the two halves' [..., 2]."""
    return np.repeat(d[..., None], 2, axis=-1)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums of Q4_K / Q5_K blocks from their 12 bytes [..., 12] (ggml's
    get_scale_min_k4)."""
    s = s.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _k_codes(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K low nibbles [..., 128] -> [..., 256]: chunk c of 64 takes qs[32c:32c+32]'s low nibbles, then
    their high ones."""
    q = qs.reshape(*qs.shape[:-1], 4, 32).astype(np.int32)
    return np.concatenate([q & 0x0F, q >> 4], axis=-1).reshape(*qs.shape[:-1], 256)


def _q4_k(b: np.ndarray, high: np.ndarray | None = None):
    sc, mn = _scale_min_k4(b[..., 4:16])
    d, dmin = _half(b), _half(b[..., 2:4])
    codes = _k_codes(b[..., 16:144] if high is None else b[..., 48:176])
    if high is not None:  # Q5_K: bit 4 of chunk c's first 32 in bit 2c of qh[l], of its last 32 in bit 2c + 1
        bits = _bits(b[..., 16:48, None], 8)  # [..., 32 (l), 8 (bit)]
        codes = codes + (np.moveaxis(bits, -1, -2).reshape(*b.shape[:-1], 256) << 4)
    D = d[..., None] * sc.astype(np.float32)
    M = -(dmin[..., None] * mn.astype(np.float32))
    return _per_block(D), M, codes.reshape(*b.shape[:-1], 8, 32)


def _q6_k(b: np.ndarray):
    ql, qh = b[..., 0:128].astype(np.int32), b[..., 128:192].astype(np.int32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _half(b[..., 208:210])
    codes = []
    for h in range(2):  # elements l, l+32, l+64, l+96 of each 128
        a, q = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        codes += [(a[..., :32] & 0x0F) | ((q & 3) << 4), (a[..., 32:] & 0x0F) | (((q >> 2) & 3) << 4),
                  (a[..., :32] >> 4) | (((q >> 4) & 3) << 4), (a[..., 32:] >> 4) | (((q >> 6) & 3) << 4)]
    D = (d[..., None] * sc).reshape(*b.shape[:-1], 8, 2)
    return D, np.zeros(D.shape[:-1], np.float32), np.concatenate(codes, axis=-1).reshape(*b.shape[:-1], 8, 32)


def _block32(scale, minimum, codes):
    """A 32-weight format's decoder: [..., bytes] -> (D [..., 1, 2], M [..., 1], codes [..., 1, 32])."""
    def decode(b):
        d = scale(b)
        return _per_block(d)[..., None, :], minimum(b)[..., None], codes(b)[..., None, :]
    return decode


@dataclass(frozen=True, slots=True)
class Format:
    block_elems: int
    block_bytes: int
    offset: int  # o: added to every code
    decode: Callable[[np.ndarray], tuple]  # blocks [..., bytes] -> D [..., j, 2], M [..., j], codes [..., j, 32]


_zero = lambda b: np.zeros(b.shape[:-1], np.float32)  # noqa: E731
FORMATS = {
    "Q4_0": Format(32, 18, -8, _block32(_half, _zero, lambda b: _nibbles(b[..., 2:]))),
    "Q4_1": Format(32, 20, 0, _block32(_half, lambda b: _half(b[..., 2:4]), lambda b: _nibbles(b[..., 4:]))),
    "Q8_0": Format(32, 34, 0, _block32(_half, _zero, lambda b: b[..., 2:].view(np.int8).astype(np.int32))),
    "Q5_0": Format(32, 22, -16, _block32(_half, _zero,
                                         lambda b: _nibbles(b[..., 6:]) + (_bits(b[..., 2:6], 32) << 4))),
    "Q5_1": Format(32, 24, 0, _block32(_half, lambda b: _half(b[..., 2:4]),
                                       lambda b: _nibbles(b[..., 8:]) + (_bits(b[..., 4:8], 32) << 4))),
    "Q4_K": Format(256, 144, 0, _q4_k),
    "Q5_K": Format(256, 176, 0, lambda b: _q4_k(b, high=b)),
    "Q6_K": Format(256, 210, -32, _q6_k),
}


def _decode(raw: np.ndarray, fmt: str, k: int):
    """(D [n, k/32, 2], M [n, k/32], codes [n, k/32, 32]) of weights [n, k] in GGUF blocks."""
    f = FORMATS[fmt]
    D, M, codes = f.decode(raw.reshape(raw.shape[0], k // f.block_elems, f.block_bytes))
    n = raw.shape[0]
    return D.reshape(n, -1, 2), M.reshape(n, -1), codes.reshape(n, -1, 32)


def dequantize(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Weights [n, k] from their GGUF blocks [n, k / block elements * block bytes], as gguf dequantizes them."""
    f = FORMATS[fmt]
    k = raw.shape[1] // f.block_bytes * f.block_elems
    D, M, codes = _decode(raw, fmt, k)
    w = np.repeat(D, 16, axis=-1) * (codes + f.offset).astype(np.float32)
    if fmt in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # D (c + o) + M where the format has a minimum
        w = w + M[..., None]
    return w.reshape(raw.shape[0], -1)


def quantize_activations(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activation blocks as the kernels quantize them: d = max|x| / 127, q = round-half-even(x / d)."""
    blocks = a.reshape(a.shape[0], -1, BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int32)
    return q, d


def matmul_gguf(a: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
    """specrt::MatMulGGUF's product [m, n] of activations a [m, k] and weights in GGUF blocks, per block and half
    D_h d_a (Σ_h c q + o Σ_h q) + M d_a Σq, in float32."""
    D, M, codes = _decode(raw, fmt, a.shape[1])
    q, da = quantize_activations(a)
    halves = codes.reshape(*codes.shape[:2], 2, 16)
    qh = q.reshape(*q.shape[:2], 2, 16)
    dots = np.einsum("mbhk,nbhk->mnbh", qh, halves) + FORMATS[fmt].offset * qh.sum(-1)[:, None]
    out = ((D[None] * da[:, None, :, None]) * dots.astype(np.float32)).sum(axis=-1)
    sums = q.sum(axis=-1).astype(np.float32)  # [m, b]
    return (out + M[None] * (da * sums)[:, None]).sum(axis=-1)


def exp(t: np.ndarray) -> np.ndarray:
    """elementwise.inc's exp in numpy float32, operation for operation (|t| <= 86): n = round(t log2 e) by adding and
    subtracting 1.5 * 2^23, r = t - n ln2 (two parts), Cephes' polynomial, 2^n added to the exponent bits."""
    f = np.float32
    z = t * f(1.44269504088896341) + f(12582912.0)
    n = z - f(12582912.0)
    scale = ((z.view(np.int32) - np.int32(0x4B400000)).astype(np.uint32) << np.uint32(23)).astype(np.uint32)
    r = t - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    p = np.full_like(t, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = p * r * r + r + f(1.0)
    return (p.view(np.uint32) + scale).astype(np.uint32).view(np.float32)


def swiglu(y: np.ndarray) -> np.ndarray:
    """silu(gate) * up on a [M, 2 half] product as the kernels compute it, in numpy float32: |-gate| clamped to 86 on
    its bits, gate / (1 + exp(-gate)) * up."""
    half = y.shape[1] // 2
    g, u = y[:, :half], y[:, half:]
    bits = (-g).view(np.uint32)
    t = ((bits & np.uint32(0x80000000)) | np.minimum(bits & np.uint32(0x7FFFFFFF), np.uint32(0x42AC0000)))
    return g / (np.float32(1) + exp(t.astype(np.uint32).view(np.float32))) * u


def rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """elementwise.inc's norm in numpy float32: x^2 summed in 16 lanes (element j in lane j % 16), lanes added
    pairwise (+8, +4, +2, +1), 1 / sqrt(sum / d + eps), then x * inv * w."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    acc = np.zeros((rows.shape[0], 16), np.float32)
    for j in range(0, d, 16):
        chunk = rows[:, j:j + 16]
        acc[:, :chunk.shape[1]] += chunk * chunk
    for half in (8, 4, 2, 1):
        acc[:, :half] += acc[:, half:2 * half]
    inv = np.float32(1) / np.sqrt(acc[:, :1] / np.float32(d) + np.float32(1e-5))
    return (rows * inv * w).reshape(x.shape)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray, scale: float) -> np.ndarray:
    """softmax(q·scale·kᵀ + bias)·v in float64 over the first L keys, query head h reading KV head h // (H/Hkv):
    q [B, T, H, D], k and v [B, Hkv, S, D], bias [B, 1, T|1, L]."""
    B, T, H, D = q.shape
    Hkv, L = k.shape[1], bias.shape[-1]
    kk = np.repeat(k[:, :, :L].astype(np.float64), H // Hkv, axis=1)  # [B, H, L, D]
    vv = np.repeat(v[:, :, :L].astype(np.float64), H // Hkv, axis=1)
    s = np.einsum("bthd,bhld->bhtl", q.astype(np.float64) * scale, kk) + bias[:, 0]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhtl,bhld->bthd", p, vv)
