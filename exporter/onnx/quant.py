"""Weight formats at export: float, ONNX Runtime block quantization (int4 / int8), or GGUF blocks as they are.

A quantized weight is stored as MatMulNBits blocks, in the layout specrt/blocks.py describes (`Blocks`), or for
specrt's kernels as a GGUF tensor's own bytes (`GGUFRows`, every type in KERNEL_TYPES); this module makes them:
quantizing float weights, taking a GGUF's blocks as they are (stacks of several types as a `Stack` of runs), and
packing a graph family's weights.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterable

import numpy as np

from specrt.blocks import (BLOCK, BLOCK_BYTES, GGUF_TAG, GGUF_TYPES, KERNEL_TYPES, PART, SUFFIXES,  # noqa: F401
                           Blocks, GGUFRows, from_gguf, gguf_key, gguf_parts, pack, unpack)

# ---- GGUF blocks, kept as they are ----------------------------------------------------------------

def to_gguf(b: "Blocks | GGUFRows") -> tuple[str, np.ndarray] | None:
    """(format, the GGUF bytes [N, K/32 * block bytes]) of blocks read from a GGUF (`from_gguf`, then rows
    selected, permuted or stacked), the inverse of `from_gguf`: the file's bytes again. None for blocks of
    another origin or of mixed formats."""
    if isinstance(b, GGUFRows):
        return b.kind, b.data
    if b.kind not in GGUF_TYPES:
        return None
    n, kb, _ = b.codes.shape
    out = np.empty((n, kb, BLOCK_BYTES[b.kind]), np.uint8)
    out[..., 0:2] = b.scales.astype(np.float16).view(np.uint8).reshape(n, kb, 2)
    if b.kind == "Q8_0":
        out[..., 2:] = b.codes ^ np.uint8(0x80)
        return b.kind, out.reshape(n, -1)
    head = 2
    if b.kind == "Q4_1":
        out[..., 2:4] = b.mins.astype(np.float16).view(np.uint8).reshape(n, kb, 2)
        head = 4
    codes = unpack(b.codes.reshape(n * kb, -1), 4).reshape(n, kb, BLOCK)  # element order 0..31
    out[..., head:] = codes[..., :16] | (codes[..., 16:] << 4)
    return b.kind, out.reshape(n, -1)


def quantize_gguf(w: np.ndarray, kind: str) -> np.ndarray:
    """A float [N, K] weight as GGUF `kind` (Q4_0, Q4_1, Q8_0) bytes (gguf's own quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    return np.ascontiguousarray(gguf_quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType[kind]))


def permute_rows(b: "Blocks | GGUFRows", permute) -> "Blocks | GGUFRows":
    """Apply a row permutation `permute(array)` (e.g. undoing llama.cpp's Q/K permute) to every block array."""
    if isinstance(b, GGUFRows):
        return b.rows(permute)
    fix = lambda a: None if a is None else np.ascontiguousarray(permute(a))  # noqa: E731
    return Blocks(fix(b.codes), fix(b.scales), b.bits, b.kind, fix(b.zeros), fix(b.mins))


def select_rows(w: "np.ndarray | Blocks | GGUFRows", rows: np.ndarray) -> "np.ndarray | Blocks | GGUFRows":
    """Rows `rows` of an [N, K] weight, float or blocks (each row's blocks are its own: exact)."""
    if isinstance(w, (Blocks, GGUFRows)):
        return permute_rows(w, lambda a: a[rows])
    return np.ascontiguousarray(w[rows])


def _dequantized(w) -> np.ndarray:
    return w.dequantize() if isinstance(w, (Blocks, GGUFRows, Stack)) else w


class Stack:
    """Weights stacked along N whose parts keep forms that do not concatenate (a Q4_K_M file's q and k in Q4_K, its
    v in Q6_K): the parts in order, adjacent parts of one GGUF type joined. Stored with specrt's kernels as one
    GGUF tensor per run (`W.part{i}.gguf.FORMAT`); otherwise as their concatenation (`merged`)."""

    def __init__(self, parts: list) -> None:
        runs: list = []
        for p in parts:
            if runs and _gguf_kind(runs[-1]) is not None and _gguf_kind(runs[-1]) == _gguf_kind(p):
                runs[-1] = concat_rows([runs[-1], p])
            else:
                runs.append(p)
        self.parts = runs

    def merged(self) -> "np.ndarray | Blocks":
        """One tensor: blocks of one bit width concatenated exactly (MatMulNBits), else float."""
        if all(isinstance(p, Blocks) for p in self.parts) and len({p.bits for p in self.parts}) == 1:
            return _concat_blocks(self.parts)
        return self.dequantize()

    def dequantize(self) -> np.ndarray:
        return np.concatenate([_dequantized(p) for p in self.parts])


def _gguf_kind(w) -> str | None:
    """The GGUF type of a weight kept as a file's blocks of one type, else None."""
    if isinstance(w, GGUFRows):
        return w.kind
    return w.kind if isinstance(w, Blocks) and w.kind in GGUF_TYPES else None


def _concat_blocks(parts: list[Blocks]) -> Blocks:
    if len({(p.zeros is None, p.mins is None) for p in parts}) > 1:
        parts = [p.with_defaults() for p in parts]
    cat = lambda arrays: None if arrays[0] is None else np.concatenate(arrays)  # noqa: E731
    kinds = "+".join(dict.fromkeys(p.kind for p in parts))
    return Blocks(cat([p.codes for p in parts]), cat([p.scales for p in parts]), parts[0].bits, kinds,
                  cat([p.zeros for p in parts]), cat([p.mins for p in parts]))


def concat_rows(parts: list) -> "np.ndarray | Blocks | GGUFRows | Stack":
    """Stack weights along N (q/k/v, gate/up): blocks run along K, so block rows concatenate as they are.

    Float parts concatenate as arrays; a GGUF's blocks of one type concatenate as they are; other blocks of one bit
    width concatenate exactly (zero points and mins made explicit when the parts differ); a GGUF's blocks of
    several types make a Stack (each run of one type kept as it is); any other mix dequantizes to float (the export
    then falls back).
    """
    kinds = {_gguf_kind(p) for p in parts}
    if len(kinds) == 1 and None not in kinds:
        if all(isinstance(p, GGUFRows) for p in parts):
            return GGUFRows(parts[0].kind, np.concatenate([p.data for p in parts]))
        return _concat_blocks(parts)
    if None not in kinds:
        return Stack(parts)
    if all(isinstance(p, Blocks) for p in parts) and len({p.bits for p in parts}) == 1:
        return _concat_blocks(parts)
    return np.concatenate([_dequantized(p) for p in parts])


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


def pack_weights(tensors: dict[str, "np.ndarray | Blocks | GGUFRows | Stack"], fmt: str, *, dtype: np.dtype,
                 gguf_names: Iterable[str] = (), kernels: str = "stock",
                 types: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """The store tensors of an export in weight format `fmt`.

    float: every tensor in `dtype`. int4 (asymmetric, uint8 zero points) / int8 (symmetric): matrices through
    ONNX Runtime's quantizer. gguf: Blocks as they are; matrices of the GGUF (`gguf_names`) without an exact
    block path fall back to int8 (one warning line); the others (draft heads' own layers) take int4.
    With `kernels` "specrt", the GGUF's blocks of every type the kernels read (KERNEL_TYPES) are stored as the
    file's bytes (`W.gguf.FORMAT`; a stack of several types as its runs, `W.part{i}.gguf.FORMAT`), its matrices
    without a kernel path fall back to Q8_0 instead, and the draft heads' own layers take Q4_1 (gguf's quantizer),
    so that every matrix of every graph runs on specrt's kernels (a DSpark draft call on MatMulNBits measured
    0.82-0.86 ms, on MatMulGGUF 0.67-0.70, docs/benchmarks.md). Vectors (norms, biases) and small matrices stay
    float. The warning names each fallback with its GGUF type where `types` (name -> type) knows it.
    """
    out: dict[str, np.ndarray] = {}
    gguf_names, fallback = set(gguf_names), []
    own = fmt == "gguf" and kernels == "specrt"
    for name, w in tensors.items():
        if isinstance(w, Stack):
            if own and all(_gguf_kind(p) is not None for p in w.parts):
                for i, part in enumerate(w.parts):
                    kind, raw = to_gguf(part)
                    out[f"{name}{PART}{i}{GGUF_TAG}{kind}"] = raw
                continue
            w = w.merged() if fmt == "gguf" else w.dequantize()
        if isinstance(w, GGUFRows) and not own:
            w = w.dequantize()  # no MatMulNBits form: the stated fallback below (gguf), or the format asked for
        if isinstance(w, Blocks) and fmt != "gguf":
            w = w.dequantize()
        raw = to_gguf(w) if own and isinstance(w, (Blocks, GGUFRows)) else None
        if raw is not None:
            out[name + GGUF_TAG + raw[0]] = raw[1]
        elif own and name in gguf_names and (isinstance(w, Blocks) or quantizable(w)):
            fallback.append(name)  # mixed or inexact blocks: Q8_0, which specrt's kernels read too
            out[name + GGUF_TAG + "Q8_0"] = quantize_gguf(w.dequantize() if isinstance(w, Blocks) else w, "Q8_0")
        elif isinstance(w, Blocks):
            out.update(w.tensors(name))
        elif fmt == "float" or not quantizable(w):
            out[name] = w.astype(dtype, copy=False)
        elif own:  # a draft head's own matrix: Q4_1 blocks (4 bits, a scale and a minimum), for specrt's kernels
            out[name + GGUF_TAG + "Q4_1"] = quantize_gguf(w, "Q4_1")
        elif fmt == "gguf" and name in gguf_names:  # no exact block path: the stated fallback
            fallback.append(name)
            out.update(quantize(w, 8, symmetric=True).tensors(name))
        elif fmt == "int8":
            out.update(quantize(w, 8, symmetric=True).tensors(name))
        else:  # int4, and under gguf the draft heads' own layers
            out.update(quantize(w, 4, symmetric=False).tensors(name))
    if fallback:
        kept = "/".join(KERNEL_TYPES if own else GGUF_TYPES)
        print(f"specrt: warning: {len(fallback)} GGUF matrices (a stacked q/k/v or gate/up counts once) are not "
              f"{kept} blocks, stored as {'Q8_0' if own else 'int8'} instead: {_by_type(fallback, types or {})}",
              file=sys.stderr)
    return out


def _by_type(names: list[str], types: dict[str, str]) -> str:
    """Every name, grouped by its GGUF type and, across layers, by its place in a layer: "Q3_K:
    model.layers.*.mlp.down_proj.weight (x32), ...; F16: model.embed_tokens.weight"."""
    groups: dict[str, dict[str, list[str]]] = {}
    for n in names:
        role = re.sub(r"\.layers\.\d+\.", ".layers.*.", n)
        groups.setdefault(types.get(n, "float"), {}).setdefault(role, []).append(n)
    return "; ".join(f"{t}: " + ", ".join(f"{r} (x{len(ns)})" if len(ns) > 1 else ns[0] for r, ns in roles.items())
                     for t, roles in groups.items())


def is_quantized(store, name: str) -> bool:
    """Whether weight `name` is stored as MatMulNBits blocks (`name.qcodes`) rather than as a float tensor."""
    return name + ".qcodes" in store


def is_stored(store, name: str) -> bool:
    """Whether weight `name` is in the store in any form: float, MatMulNBits blocks or GGUF bytes."""
    return name in store or is_quantized(store, name) or bool(gguf_parts(store, name))


def stored_bytes(store, name: str) -> int:
    """Bytes of weight `name` in the store: the float tensor, its GGUF bytes, or its block tensors."""
    if name in store:
        return store.nbytes(name)
    parts = gguf_parts(store, name)
    if parts:
        return sum(store.nbytes(key) for key, _ in parts)
    return sum(store.nbytes(name + s) for s in SUFFIXES if name + s in store)
