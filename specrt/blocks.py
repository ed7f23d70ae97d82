"""How an artifact stores a block-quantized weight (written by exporter/onnx/quant.py, read back by the torch backend).

A quantized [N, K] weight `W` (Hugging Face [out, in] layout) is stored as com.microsoft MatMulNBits inputs
under derived names, blocks of 32 along K:

    W.qcodes   uint8 [N, K/32, 32*bits/8]   codes; 4 bits: element 2i in the low nibble of byte i
    W.qscales  f32   [N, K/32]
    W.qzeros   uint8 [N, ceil(K/32*bits/8)] zero points packed like the codes (absent: 2^(bits-1))
    W.qmins    f32   [N, K/32]              GGUF Q4_1 only (w = d*q + m): added as blocksum(x) @ minsᵀ

so that  w[n, k] = (code - zero) * scale + min  of k's block. Zero points are uint8 only: float zero points
take a slow path in ONNX Runtime.

With specrt's own kernels (`specrt export --kernels specrt`, libspecrt_ops) a GGUF weight is instead stored as the
file's bytes, unchanged, under `W.gguf.FORMAT` (uint8 [N, K / block weights * block bytes]; FORMAT one of
KERNEL_TYPES), read by specrt::MatMulGGUF and specrt::GatherGGUF. A stacked weight whose parts have different formats
(a Q4_K_M file's q and k in Q4_K, its v in Q6_K) is stored as its runs of one format, `W.part0.gguf.Q4_K`,
`W.part1.gguf.Q6_K`, ..., multiplied one node each and concatenated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
SUFFIXES = (".qcodes", ".qscales", ".qzeros", ".qmins")
GATHER_ROWS = ".qrows"  # an alias of .qcodes as [N, K*bits/8], the layout GatherBlockQuantized reads
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF block formats kept exactly
GGUF_TAG = ".gguf."  # W.gguf.FORMAT: a GGUF tensor's own bytes (specrt's kernels)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # d (fp16)[, m (fp16)], 32 codes
# The GGUF block types specrt's kernels read (kernels/cpu/gguf_kernels.h, kFormats): (weights, bytes) a block.
KERNEL_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24),
                "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
PART = ".part"  # W.part{i}.gguf.FORMAT: run i of a stacked weight's parts


def row_weights(kind: str, row_bytes: int) -> int:
    """K of a GGUF row of `row_bytes` bytes of blocks `kind`."""
    elems, size = KERNEL_TYPES[kind]
    return row_bytes // size * elems


def gguf_key(store, name: str) -> tuple[str, str] | None:
    """(store key, format) of weight `name` kept as one GGUF tensor's bytes, or None."""
    for fmt in KERNEL_TYPES:
        if name + GGUF_TAG + fmt in store:
            return name + GGUF_TAG + fmt, fmt
    return None


def gguf_parts(store, name: str) -> list[tuple[str, str]]:
    """[(store key, format)] of weight `name` kept as GGUF bytes: one entry, or its parts in order (PART); [] if
    it is kept otherwise."""
    one = gguf_key(store, name)
    if one is not None:
        return [one]
    parts = []
    while (part := gguf_key(store, f"{name}{PART}{len(parts)}")) is not None:
        parts.append(part)
    return parts


@dataclass(frozen=True, slots=True)
class GGUFRows:
    """One [N, K] weight as a GGUF tensor's bytes, a row of blocks per output: the types specrt's kernels read
    that MatMulNBits cannot hold exactly (Q5_0, Q5_1 and the K-quants: 5-6 bit codes, scales per 16 weights)."""

    kind: str
    data: np.ndarray  # uint8 [N, K / block weights * block bytes]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], row_weights(self.kind, self.data.shape[1])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, select) -> "GGUFRows":
        """The weight with `select(array)` applied to its rows (a permutation, a subset)."""
        return GGUFRows(self.kind, np.ascontiguousarray(select(self.data)))

    def dequantize(self) -> np.ndarray:
        """The float32 [N, K] weight (gguf's own arithmetic)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return np.asarray(dequantize(self.data, GGMLQuantizationType[self.kind]), np.float32).reshape(self.shape)


@dataclass(frozen=True, slots=True)
class Blocks:
    """One [N, K] weight as MatMulNBits blocks (see the module docstring)."""

    codes: np.ndarray  # uint8 [N, K/32, 32*bits/8]
    scales: np.ndarray  # f32 [N, K/32]
    bits: int  # 4 | 8
    kind: str  # where the blocks come from: "Q4_0", "Q4_1", "Q8_0" (GGUF) or "int4", "int8" (ONNX Runtime)
    zeros: np.ndarray | None = None  # uint8 [N, ceil(K/32*bits/8)], or None: 2^(bits-1)
    mins: np.ndarray | None = None  # f32 [N, K/32], or None

    @property
    def shape(self) -> tuple[int, int]:
        n, kb, _ = self.codes.shape
        return n, kb * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scales, self.zeros, self.mins) if a is not None)

    def tensors(self, name: str) -> dict[str, np.ndarray]:
        """The store tensors of weight `name`."""
        out = {name + ".qcodes": self.codes, name + ".qscales": self.scales}
        if self.zeros is not None:
            out[name + ".qzeros"] = self.zeros
        if self.mins is not None:
            out[name + ".qmins"] = self.mins
        return out

    def dequantize(self) -> np.ndarray:
        """The float32 [N, K] weight the blocks stand for (what the graph multiplies by at accuracy level 0)."""
        n, kb, _ = self.codes.shape
        codes = unpack(self.codes.reshape(n, -1), self.bits).reshape(n, kb, BLOCK).astype(np.float32)
        zeros = (unpack(self.zeros, self.bits)[:, :kb] if self.zeros is not None
                 else np.full((n, kb), 1 << (self.bits - 1), np.uint8)).astype(np.float32)
        w = (codes - zeros[..., None]) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(n, kb * BLOCK)

    def with_defaults(self) -> "Blocks":
        """The same weight with explicit zero points and mins (so blocks of different kinds concatenate)."""
        n, kb, _ = self.codes.shape
        zeros = self.zeros if self.zeros is not None else pack(np.full((n, kb), 1 << (self.bits - 1), np.uint8),
                                                                 self.bits)
        mins = self.mins if self.mins is not None else np.zeros((n, kb), np.float32)
        return Blocks(self.codes, self.scales, self.bits, self.kind, zeros, mins)


def from_gguf(data: np.ndarray, qtype: str) -> "Blocks | None":
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
    blocks = np.asarray(data, np.uint8).reshape(n, -1, BLOCK_BYTES[qtype])
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


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [N, M] values < 2^bits -> [N, ceil(M*bits/8)] bytes, 4 bits: element 2i in the low nibble."""
    if bits == 8:
        return np.ascontiguousarray(values, dtype=np.uint8)
    if values.shape[1] % 2:
        values = np.pad(values, ((0, 0), (0, 1)))
    return (values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack` (an odd count comes back with one padding column)."""
    if bits == 8:
        return packed
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    out[:, 0::2], out[:, 1::2] = packed & 0x0F, packed >> 4
    return out


def dequantize_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Replace every `W.q*` group, and every `W.gguf.FORMAT` tensor, of a graph's initializers by the float32
    weight `W` it stands for (the torch backend reads quantized artifacts this way; aliases for
    GatherBlockQuantized are dropped)."""
    out = {k: v for k, v in tensors.items() if not k.endswith((*SUFFIXES, GATHER_ROWS)) and GGUF_TAG not in k}
    parts: dict[str, dict[int, np.ndarray]] = {}
    for key, raw in tensors.items():
        if GGUF_TAG in key:
            name, fmt = key.rsplit(GGUF_TAG, 1)
            w = from_gguf(raw, fmt).dequantize() if fmt in GGUF_TYPES else GGUFRows(fmt, raw).dequantize()
            whole, _, index = name.rpartition(PART)
            if whole and index.isdigit():
                parts.setdefault(whole, {})[int(index)] = w
            else:
                out[name] = w
    for name, runs in parts.items():
        out[name] = np.concatenate([runs[i] for i in sorted(runs)])
    for key in tensors:
        if key.endswith(".qscales"):
            name, (n, kb) = key.removesuffix(".qscales"), tensors[key].shape
            codes = tensors.get(name + ".qcodes")  # a table only Gathered from has just its .qrows alias
            codes = tensors[name + GATHER_ROWS].reshape(n, kb, -1) if codes is None else codes
            out[name] = Blocks(codes, tensors[key], codes.shape[2] * 8 // BLOCK, "", tensors.get(name + ".qzeros"),
                               tensors.get(name + ".qmins")).dequantize()
    return out
