"""Weight formats at export: float, ONNX Runtime block quantization (int4 / int8), or GGUF blocks as they are.

A quantized weight is stored as MatMulNBits blocks, in the layout specrt/blocks.py describes (`Blocks`); this module
makes them: quantizing float weights, taking a GGUF's Q4_0 / Q4_1 / Q8_0 blocks as they are, and packing a graph
family's weights.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable

import numpy as np

from specrt.blocks import BLOCK, SUFFIXES, Blocks, pack

# ---- GGUF blocks, kept as they are ----------------------------------------------------------------

GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def from_gguf(data: np.ndarray, qtype: str) -> Blocks | None:
    """A GGUF tensor's raw bytes [N, K/32 * block bytes] as Blocks, or None for a type without an exact path.

    Q4_0: w = d*(q - 8) -> default zero point 8. Q4_1: w = d*q + m -> zero point 0 and mins m. Q8_0: w = d*q,
    q int8 -> codes q + 128, default zero point 128. d and m are fp16 in the file; fp32 holds them exactly.
    GGUF packs element j of a 4-bit block in the low nibble and j + 16 in the high nibble of byte j;
    MatMulNBits wants elements 2i, 2i+1 in byte i, so the nibbles are reordered (the codes are unchanged).
    """
    if qtype not in GGUF_TYPES:
        return None
    n = data.shape[0]
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[qtype]
    blocks = np.asarray(data, np.uint8).reshape(n, -1, head + (BLOCK if qtype == "Q8_0" else BLOCK // 2))
    kb = blocks.shape[1]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, kb).astype(np.float32)
    qs = blocks[..., head:]
    if qtype == "Q8_0":
        return Blocks(np.ascontiguousarray(qs ^ np.uint8(0x80)), d, 8, qtype)  # int8 q -> q + 128
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, kb, 32]: element order 0..31
    codes = pack(codes.reshape(n * kb, BLOCK), 4).reshape(n, kb, BLOCK // 2)
    if qtype == "Q4_0":
        return Blocks(codes, d, 4, qtype)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(n, kb).astype(np.float32)
    return Blocks(codes, d, 4, qtype, zeros=np.zeros((n, (kb + 1) // 2), np.uint8), mins=m)


def permute_rows(b: Blocks, permute) -> Blocks:
    """Apply a row permutation `permute(array)` (e.g. undoing llama.cpp's Q/K permute) to every block array."""
    fix = lambda a: None if a is None else np.ascontiguousarray(permute(a))  # noqa: E731
    return Blocks(fix(b.codes), fix(b.scales), b.bits, b.kind, fix(b.zeros), fix(b.mins))


def select_rows(w: "np.ndarray | Blocks", rows: np.ndarray) -> "np.ndarray | Blocks":
    """Rows `rows` of an [N, K] weight, float or blocks (each row's blocks are its own: exact)."""
    return permute_rows(w, lambda a: a[rows]) if isinstance(w, Blocks) else np.ascontiguousarray(w[rows])


def concat_rows(parts: list) -> "np.ndarray | Blocks":
    """Stack weights along N (q/k/v, gate/up): blocks run along K, so block rows concatenate as they are.

    Float parts concatenate as arrays; blocks of one bit width concatenate exactly (zero points and mins made
    explicit when the parts differ); any other mix dequantizes to float (the export then falls back).
    """
    if all(isinstance(p, Blocks) for p in parts) and len({p.bits for p in parts}) == 1:
        if len({(p.zeros is None, p.mins is None) for p in parts}) > 1:
            parts = [p.with_defaults() for p in parts]
        cat = lambda arrays: None if arrays[0] is None else np.concatenate(arrays)  # noqa: E731
        kinds = "+".join(dict.fromkeys(p.kind for p in parts))
        return Blocks(cat([p.codes for p in parts]), cat([p.scales for p in parts]), parts[0].bits, kinds,
                      cat([p.zeros for p in parts]), cat([p.mins for p in parts]))
    return np.concatenate([p.dequantize() if isinstance(p, Blocks) else p for p in parts])


# ---- ONNX Runtime's block quantizer ---------------------------------------------------------------

def quantize(w: np.ndarray, bits: int, *, symmetric: bool) -> Blocks:
    """Quantize a float [N, K] weight with ONNX Runtime's own MatMulNBits quantizer kernels (block 32).

    The same C++ routines `onnxruntime.quantization.matmul_nbits_quantizer.DefaultWeightOnlyQuantizer`
    calls (that module configures root logging on import, so its kernels are called directly).
    """
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    n, k = w.shape
    kb = k // BLOCK
    kernel = {4: quantize_matmul_4bits, 8: quantize_matmul_8bits}[bits]
    codes = np.zeros((n, kb, BLOCK * bits // 8), np.uint8)
    zeros = np.zeros((n, (kb * bits + 7) // 8), np.uint8)
    scales = np.zeros((n, kb), np.float32)
    kernel(codes, np.ascontiguousarray(w.T, dtype=np.float32), scales, zeros, BLOCK, n, k, symmetric)
    return Blocks(codes, scales, bits, f"int{bits}", None if symmetric else zeros)


# ---- the weights of an export ---------------------------------------------------------------------

def quantizable(w: np.ndarray) -> bool:
    """A matrix that block-quantizes: 2-D, K a multiple of the block, at least a block of rows (so DSpark's
    one-row confidence head and a Markov head of rank < 32 stay float: tiny, nothing to save)."""
    return w.ndim == 2 and w.shape[1] % BLOCK == 0 and w.shape[0] >= BLOCK


def pack_weights(tensors: dict[str, "np.ndarray | Blocks"], fmt: str, *, dtype: np.dtype,
                 gguf_names: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """The store tensors of an export in weight format `fmt`.

    float: every tensor in `dtype`. int4 (asymmetric, uint8 zero points) / int8 (symmetric): matrices through
    ONNX Runtime's quantizer. gguf: Blocks as they are; matrices of the GGUF (`gguf_names`) without an exact
    block path fall back to int8 (one warning line); the others (draft heads' own layers) take int4.
    Vectors (norms, biases) and small matrices stay float.
    """
    out: dict[str, np.ndarray] = {}
    gguf_names, fallback = set(gguf_names), []
    for name, w in tensors.items():
        if isinstance(w, Blocks) and fmt != "gguf":
            w = w.dequantize()
        if isinstance(w, Blocks):
            out.update(w.tensors(name))
        elif fmt == "float" or not quantizable(w):
            out[name] = w.astype(dtype, copy=False)
        elif fmt == "gguf" and name in gguf_names:  # no exact block path: the stated fallback
            fallback.append(name)
            out.update(quantize(w, 8, symmetric=True).tensors(name))
        elif fmt == "int8":
            out.update(quantize(w, 8, symmetric=True).tensors(name))
        else:  # int4, and under gguf the draft heads' own layers
            out.update(quantize(w, 4, symmetric=False).tensors(name))
    if fallback:
        print(f"specrt: warning: {len(fallback)} GGUF matrices (a stacked q/k/v or gate/up counts once) are not "
              f"{'/'.join(GGUF_TYPES)} blocks of one width, stored as int8 instead: {', '.join(fallback[:3])}"
              f"{', ...' if len(fallback) > 3 else ''}", file=sys.stderr)
    return out


def is_quantized(store, name: str) -> bool:
    """Whether weight `name` is stored as blocks (`name.qcodes`) rather than as a float tensor."""
    return name + ".qcodes" in store


def stored_bytes(store, name: str) -> int:
    """Bytes of weight `name` in the store: the float tensor, or its block tensors."""
    if name in store:
        return store.nbytes(name)
    return sum(store.nbytes(name + s) for s in SUFFIXES if name + s in store)
