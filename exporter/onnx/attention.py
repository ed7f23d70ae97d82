"""GQA attention as ONNX, shared by the target (and MTP) layers and the DSpark draft layers.

    x[N,d] ─Gemm(stacked proj)─ Reshape [B,T,n,D] ─ Split ─ q/k norm (Qwen3) ─ rope(q, k) ─► q [B,T,H,D]
                                                                                           k, v [B,Hkv,T,D]
    (the caller scatters new k/v into its cache: `write_cache`)

    q·D^-½ ─ [B,Hkv,G*T,D] ─┬─ MatMul kᵀ of key block 1 (e.g. the cache, S keys) ─┐
                            └─ MatMul kᵀ of key block 2 (e.g. DSpark's own block) ─┴─ Concat [B,Hkv,G*T,L]
       ─ Reshape [B,Hkv,G,T,L] ─ Add bias [B,1,1,T|1,L] ─ Softmax (f32) ─ Split per block ─ MatMul v ─ Add
       ─ [B,T,H*D] ─ o_proj

The G query heads of a KV head become extra query rows (Hugging Face's repeat_kv order), so each cached K/V
is read once instead of being repeated G times. The bias is built by the caller from its own visibility rule.

Lowerings (`LOWERINGS`, chosen at export): `standard` attends over all S cache positions (ops the TensorRT
ONNX parser accepts); `cpu` (ONNX Runtime on CPU) Slices the cache to its first L positions, L = the
largest position any query of the call may see (a [1] i64 tensor, the caller's "window"), so the cost of
attention follows the valid length, not S. Exact: the keys past L are the ones the bias masks anyway.

With `--kernels specrt` a single key block is attended by one specrt::CacheAttention (libspecrt_ops): scores,
bias, softmax and values per query row, each row computed alone, so a verify's rows get the bits decoding gives;
a packed call passes its token rows, and only those cells attend (the grid's other cells are zeros, never read).
The target's layers go further: one specrt::PackedAttention does the rope, the cache writes and the attention of
the packed rows (`target.fuses_attention`), and none of this module's nodes are emitted for them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.exporter.onnx.builder import PLUGIN_DOMAIN, GraphBuilder, onnx_dtype
from specrt.exporter.onnx.layers import apply_rope, linear, rms_norm

Rope = tuple[str, str, str]  # (cos, sin, rotate_half matrix) for `apply_rope`
LOWERINGS = ("standard", "cpu")  # see the module docstring; ExportSettings.attention


def check_lowering(attention: str) -> None:
    if attention not in LOWERINGS:
        raise SpecrtError(f"attention lowering must be one of {', '.join(LOWERINGS)}, got {attention!r}")


@dataclass(frozen=True, slots=True)
class KeyBlock:
    """Keys and values [B,Hkv,L,D] that every query attends over (masked by the bias), named in node names."""

    name: str
    k: str
    v: str
    length: int | str  # L: fixed at export, or a [1] i64 tensor (the cpu lowering's cache window)


@dataclass(frozen=True, slots=True)
class Packing:
    """The P tokens a call computes among the cells of its [B, T] grid (the target's `token_rows`).

    Projections run on the packed [P, w] rows; attention runs on the grid: `unpack` scatters packed rows into
    a zero [B*T, w] grid, `pack` gathers the computed cells back."""

    rows: str  # [P] i64 flat grid indices b*T+t
    grid: str  # [1] i64: B*T

    def unpack(self, g: GraphBuilder, x: str, width: int, dtype: str) -> str:
        with g.scope("unpack"):
            zeros = g.op("Expand", g.const(np.zeros((1, 1), dtype), "zero"),
                         g.op("Concat", self.grid, g.const([width], "width", "int64"), axis=0), name="grid")
            index = g.op("Unsqueeze", self.rows, g.const([1], "axis1", "int64"), name="cells")
            return g.op("ScatterND", zeros, index, x, name="scatter")

    def pack(self, g: GraphBuilder, x: str) -> str:
        return g.op("Gather", x, self.rows, axis=0, name="pack")


def cache_block(g: GraphBuilder, present_k: str, present_v: str, window: int | str) -> KeyBlock:
    """The cache as a key block: all S positions (`window` = S, no node), or its first `window` positions.

    The cpu lowering's Slice copies only the L valid positions, and everything after it (scores, softmax,
    probs·v) is sized by L instead of S.
    """
    if isinstance(window, int):
        return KeyBlock("cache", present_k, present_v, window)
    # Not com.microsoft GroupQueryAttention, which reads a shared past/present buffer without this copy: on
    # ORT 1.32's CPU it refuses T > 1 after a past at B > 1 (verify) and writes past S (prefill padding),
    # and one graph serves every bucket.
    with g.scope("cache_window"):
        zero, axis = g.const([0], "start", "int64"), g.const([2], "axis", "int64")
        return KeyBlock("cache", g.op("Slice", present_k, zero, window, axis, name="keys"),
                        g.op("Slice", present_v, zero, window, axis, name="values"), window)


def project_heads(g: GraphBuilder, x: str, p: str, parts: str, shape: str, cfg: ModelConfig, rope: Rope,
                  dtype: str, *, lowering: str = "standard", packing: Packing | None = None) -> list[str]:
    """Project x [N,d] with the stacked weight `{p}.{parts}_proj` (`parts`: "qkv", "q" or "kv") into heads.

    `shape` is the [B,T,n,D] reshape target (with `packing`, x holds the P packed rows, unpacked to the grid
    after the projection). Returns q as [B,T,H,D] (unscaled) and k, v as [B,Hkv,T,D]; q and k get the
    family's q/k norm (`{p}.q_norm`, `{p}.k_norm`), then rope.
    """
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}
    w = g.weight
    bias = w(f"{p}.{parts}_proj.bias") if cfg.attention_bias else None
    y = linear(g, x, w(f"{p}.{parts}_proj.weight"), bias, name=f"{parts}_proj")
    if packing is not None:
        y = packing.unpack(g, y, sum(heads[c] for c in parts) * cfg.head_dim, dtype)
    y = g.op("Reshape", y, shape, name=f"{parts}_heads")
    roped = parts.replace("v", "")  # q and k rotate, v does not
    if cfg.qk_norm:  # Qwen3: per-head RMSNorm on q and k before rope
        out = _split(g, y, [heads[c] for c in parts], f"{parts}_sizes")
        for i, c in enumerate(roped):
            normed = rms_norm(g, out[i], w(f"{p}.{c}_norm.weight"), cfg.rms_norm_eps, dtype, name=f"{c}_norm",
                              lowering=lowering)
            out[i] = apply_rope(g, normed, *rope, name=f"{c}_rope")
    else:  # q and k share one rope pass; v is split off first
        rot, *rest = _split(g, y, [sum(heads[c] for c in roped), *(heads[c] for c in parts[len(roped):])],
                            f"{roped}_v_sizes")
        out = [*_split(g, apply_rope(g, rot, *rope, name=f"{roped}_rope"), [heads[c] for c in roped],
                       f"{roped}_sizes"), *rest]
    return [out[i] if c == "q" else g.op("Transpose", out[i], perm=[0, 2, 1, 3], name=f"{c}_bhtd")
            for i, c in enumerate(parts)]  # k, v: [B,Hkv,T,D], the cache layout


def _split(g: GraphBuilder, y: str, sizes: list[int], name: str) -> list[str]:
    """Split [B,T,n,D] along the heads axis (no node for a single part)."""
    if len(sizes) == 1:
        return [y]
    return g.op("Split", y, g.const(sizes, name, "int64"), axis=2, outputs=len(sizes))


def write_cache(g: GraphBuilder, cache: tuple[str, str], scatter_idx: str, k: str, v: str, *,
                rows: bool = False) -> tuple[str, str]:
    """present = past with new k/v [B,Hkv,T,D] scattered at `scatter_idx` (in place when the buffers are bound):
    ScatterElements over [B,Hkv,T,D] element indices, or with `rows` ScatterND over [B,Hkv,T,3] row indices."""
    if rows:
        return (g.op("ScatterND", cache[0], scatter_idx, k, name="write_k"),
                g.op("ScatterND", cache[1], scatter_idx, v, name="write_v"))
    return (g.op("ScatterElements", cache[0], scatter_idx, k, axis=2, name="write_k"),
            g.op("ScatterElements", cache[1], scatter_idx, v, axis=2, name="write_v"))


def attend(g: GraphBuilder, q: str, blocks: Sequence[KeyBlock], bias: str, o_proj: str, cfg: ModelConfig,
           dtype: str, *, packing: Packing | None = None) -> str:
    """o_proj(softmax(q·kᵀ/√D + bias)·v) over the key blocks side by side, as [N, d] (with `packing`: the
    P computed cells, packed before o_proj).

    q [B,T,H,D]; `bias` [B,1,1,T or 1,L] (0 or a large negative, f32) with L the blocks' total length.
    """
    H, Hkv, D, G = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.kv_groups
    if g.kernels == "specrt" and len(blocks) == 1 and dtype == "float32":  # one fused op over the first L keys
        # packed: only the P computed cells attend (`cells`), so a verify's attention costs its tokens, not B x T
        cells = [packing.rows] if packing is not None else []
        out = g.op("CacheAttention", q, blocks[0].k, blocks[0].v, bias, *cells, name="attention",
                   domain=PLUGIN_DOMAIN, scale=float(D ** -0.5))
        out = g.op("Reshape", out, g.const([-1, H * D], "flat", "int64"))
        if packing is not None:
            out = packing.pack(g, out)
        return linear(g, out, g.weight(f"{o_proj}.weight"),
                      g.weight(f"{o_proj}.bias") if cfg.o_proj_bias else None, name="o_proj")
    static = all(isinstance(b.length, int) for b in blocks)
    if static:
        L = sum(b.length for b in blocks)
    else:  # the cpu lowering's cache window: L known at run time, as a [1] i64 tensor
        lengths = [b.length if isinstance(b.length, str) else g.const([b.length], f"{b.name}_length", "int64")
                   for b in blocks]
        L = lengths[0]
        for n in lengths[1:]:  # Add, not Sum: Sum takes no int64
            L = g.op("Add", L, n, name="total_length")
    q = g.op("Mul", q, g.const(np.asarray(D ** -0.5, dtype=dtype), "scale"))
    q = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 1, 3]), g.const([0, Hkv, -1, D], "grouped", "int64"))
    # Scores against each block side by side: no block (the cache above all) is ever concatenated.
    scores = [g.op("MatMul", q, g.op("Transpose", b.k, perm=[0, 1, 3, 2]), name=f"qk_{b.name}") for b in blocks]
    scores = g.op("Concat", *scores, axis=-1, name="scores") if len(blocks) > 1 else scores[0]  # [B,Hkv,G*T,L]
    # [B,Hkv,G,T,L] so a per-query bias [B,1,1,T,L] broadcasts over the groups
    scores = g.op("Reshape", scores, g.const([0, Hkv, G, -1, L], "per_group", "int64") if static else
                  g.op("Concat", g.const([0, Hkv, G, -1], "per_group", "int64"), L, axis=0, name="per_group_shape"))
    if dtype != "float32":
        scores = g.op("Cast", scores, to=onnx_dtype("float32"))
    probs = g.op("Softmax", g.op("Add", scores, bias, name="mask"), axis=-1)
    if dtype != "float32":
        probs = g.op("Cast", probs, to=onnx_dtype(dtype))
    probs = g.op("Reshape", probs, g.const([0, Hkv, -1, L], "rows", "int64") if static else
                 g.op("Concat", g.const([0, Hkv, -1], "rows", "int64"), L, axis=0, name="rows_shape"))
    if len(blocks) > 1:
        sizes = g.const([b.length for b in blocks], "block_sizes", "int64") if static else \
            g.op("Concat", *lengths, axis=0, name="block_sizes")
        probs = g.op("Split", probs, sizes, axis=-1, outputs=len(blocks))
    else:
        probs = [probs]
    out = None
    for p, b in zip(probs, blocks):
        pv = g.op("MatMul", p, b.v, name=f"pv_{b.name}")
        out = pv if out is None else g.op("Add", out, pv, name="pv_sum")  # [B,Hkv,G*T,D]
    out = g.op("Transpose", g.op("Reshape", out, g.const([0, H, -1, D], "heads", "int64")), perm=[0, 2, 1, 3])
    out = g.op("Reshape", out, g.const([-1, H * D], "flat", "int64"))
    if packing is not None:
        out = packing.pack(g, out)
    return linear(g, out, g.weight(f"{o_proj}.weight"), g.weight(f"{o_proj}.bias") if cfg.o_proj_bias else None,
                  name="o_proj")
