"""The documented arithmetic of specrt's CPU kernels (kernels/cpu) in numpy: what tests/test_cpu_kernels.py holds the
library's results to, operation for operation where the kernels promise bits, and the plain float math where they
promise a bound.

A GGUF weight format is one entry of `FORMATS`: its block's bytes, and how a block's bytes give its scale d, its
offset m and its 32 integer codes c, so that the block's weights are d·c + m and a row's product with activation
blocks quantized to int8 (scale d_a, codes q) is Σ_blocks d·d_a·Σ(c·q) + m·d_a·Σq (the packed dot).
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


@dataclass(frozen=True, slots=True)
class Format:
    block_bytes: int
    scale: Callable[[np.ndarray], np.ndarray]  # blocks [..., block_bytes] -> d
    offset: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (blocks, d) -> m
    codes: Callable[[np.ndarray], np.ndarray]  # blocks -> [..., 32] int32


FORMATS = {
    "Q4_0": Format(18, _half, lambda b, d: -8 * d, lambda b: _nibbles(b[..., 2:])),
    "Q4_1": Format(20, _half, lambda b, d: _half(b[..., 2:4]), lambda b: _nibbles(b[..., 4:])),
    "Q8_0": Format(34, _half, lambda b, d: np.zeros_like(d), lambda b: b[..., 2:].view(np.int8).astype(np.int32)),
}


def dequantize(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Weights [n, k] from their GGUF blocks [n, k / 32 * block bytes]."""
    f = FORMATS[fmt]
    blocks = raw.reshape(raw.shape[0], -1, f.block_bytes)
    d = f.scale(blocks)
    return (d[..., None] * f.codes(blocks) + f.offset(blocks, d)[..., None]).reshape(raw.shape[0], -1)


def quantize_activations(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activation blocks as the kernels quantize them: d = max|x| / 127, q = round-half-even(x / d)."""
    blocks = a.reshape(a.shape[0], -1, BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int32)
    return q, d


def matmul_gguf(a: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
    """specrt::MatMulGGUF's product [m, n] of activations a [m, k] and weights in GGUF blocks, per block
    d_w d_a Σ(c q) + m_w d_a Σq, in float32."""
    f = FORMATS[fmt]
    blocks = raw.reshape(raw.shape[0], a.shape[1] // BLOCK, f.block_bytes)
    dw = f.scale(blocks)
    mw, codes = f.offset(blocks, dw), f.codes(blocks)
    q, da = quantize_activations(a)
    dots = np.einsum("mbk,nbk->mnb", q, codes).astype(np.float32)
    sums = q.sum(axis=-1).astype(np.float32)  # [m, b]
    return ((dw[None] * da[:, None]) * dots + mw[None] * da[:, None] * sums[:, None]).sum(axis=-1)


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
