"""The target graph: embedding, decoder layers over a fixed-size KV cache, final norm, head.

    input_ids[B,T] -> the P cells token_rows lists -> Gather(embed) -> x[P, d]       (packed tokens)
        for each layer:  x += o_proj(pack(attention(unpack(qkv(norm(x))), cache)))  ;  x += mlp(norm(x))
    norm(x) -> unpack -> features[B,T,F] (optional) ; rows picked by logit_rows[R] -> Gemm(head) -> logits[R,V]

Projections, MLPs and the head see only the P computed tokens (a short verify costs only its tokens);
attention works on the [B, T] grid, each slot against its own cache (`attention.Packing`).

Every Reshape takes its sizes from Shape(input_ids) or 0/-1, so one graph body serves every B/T/R: the
file declares them as named axes and the manifest lists the fixed shapes (buckets) the runtime uses.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt import artifact as io
from specrt.model_config import ModelConfig
from specrt.exporter.onnx.builder import PLUGIN_DOMAIN, GraphBuilder, onnx_dtype
from specrt.exporter.onnx.attention import (KeyBlock, Packing, Rope, attend, cache_block, check_lowering,
                                            project_heads, write_cache)
from specrt.exporter.onnx.layers import (Shapes, add_rms_norm, embedding, linear, mlp, rms_norm, rope_tables,
                                         rotate_half_matrix)
from specrt.exporter.onnx.quant import concat_rows

FINAL = "final"  # feature source: the final-normed hidden state (what MTP consumes)


def cache_io(g: GraphBuilder, shapes: Shapes, write_index: str, cfg: ModelConfig, max_seq: int,
             dtype: str, *, lowering: str = "standard", fused: bool = False) -> tuple[str, str, int | str]:
    """Scatter indices, attention bias and cache window (`slot_io`) for T new tokens at write_index[b] + t.

    In the cpu lowering the target's cache length is the axis S the runtime sizes (`GraphSpec.sized_cache`),
    and attention reads all of it: the window is Shape(past)[2], no copy of the valid positions is made.
    `fused`: specrt::PackedAttention writes the cache itself, and takes the slots [B,T] instead of indices."""
    with g.scope("cache_io"):
        t_range = g.op("Range", g.const(0, "zero", "int64"),
                       g.op("Squeeze", shapes.tokens, g.const([0], "axis0", "int64")),
                       g.const(1, "one", "int64"))  # [T]
        qpos = g.op("Add", g.op("Unsqueeze", write_index, g.const([1], "axis1", "int64")), t_range,
                    name="query_positions")  # [B,T]: cache slot of each new token
        sized = g.op("Shape", io.past_names(0)[0], start=2, end=3, name="cache_length") if lowering == "cpu" else None
        return slot_io(g, shapes, qpos, cfg, max_seq, lowering=lowering, sized=sized, fused=fused,
                       tree=(io.TREE_MASK, write_index))


def _tree_hidden(g: GraphBuilder, shapes: Shapes, keys: str, mask: str, first: str) -> str:
    """[B,T,L] bool: key k is grid cell j = k - first[b] of the call and `mask` [B,T,T] hides cell j from cell t."""
    with g.scope("tree"):
        cell = g.op("Sub", keys, g.op("Unsqueeze", first, g.const([1, 2], "axes12", "int64")), name="key_cell")
        in_grid = g.op("And", g.op("GreaterOrEqual", cell, g.const(np.int64(0), "zero", "int64")),
                       g.op("Less", cell, g.op("Squeeze", shapes.tokens, g.const([0], "axis0", "int64"))),
                       name="in_grid")  # [B,1,L]
        last = g.op("Sub", shapes.tokens, g.const([1], "one", "int64"), name="last_cell")
        index = g.op("Min", g.op("Max", cell, g.const(np.int64(0), "zero_cell", "int64")), last, name="cell_index")
        size = g.op("Concat", shapes.batch, shapes.tokens, g.op("Shape", keys, start=2, end=3), axis=0)
        hidden = g.op("GatherElements", mask, g.op("Expand", index, size), axis=2, name="gather")  # [B,T,L]
        return g.op("And", in_grid, g.op("Cast", hidden, to=9), name="hidden")  # 9: BOOL


def _row_indices(g: GraphBuilder, shapes: Shapes, slots: str, heads: int) -> str:
    """ScatterND indices [B,Hkv,T,3]: (b, h, slots[b, t]) for every cache row the call writes."""
    with g.scope("row_index"):
        shape = g.op("Concat", shapes.batch, g.const([heads], "hkv", "int64"), shapes.tokens, axis=0)  # [3]
        b = g.op("Range", g.const(np.int64(0), "zero", "int64"), g.op("Squeeze", shapes.batch),
                 g.const(np.int64(1), "one", "int64"))
        parts = [g.op("Unsqueeze", b, g.const([1, 2], "b_axes", "int64")),  # [B,1,1]
                 g.const(np.arange(heads, dtype=np.int64).reshape(1, heads, 1), "h"),  # [1,Hkv,1]
                 g.op("Unsqueeze", slots, g.const([1], "s_axes", "int64"))]  # [B,1,T]
        parts = [g.op("Unsqueeze", g.op("Expand", p, shape), g.const([3], "last", "int64")) for p in parts]
        return g.op("Concat", *parts, axis=3, name="scatter_rows")


def slot_io(g: GraphBuilder, shapes: Shapes, slots: str, cfg: ModelConfig, max_seq: int, *,
            lowering: str = "standard", sized: str | None = None, fused: bool = False,
            tree: tuple[str, str] | None = None) -> tuple[str, str, int | str]:
    """For new tokens at cache slots [B,T]: scatter indices, the bias [B,1,1,T,L] and the cache window L the
    keys are cut to: S, or in the cpu lowering a [1] i64 tensor, one past the largest slot written; with `sized`
    (the [1] length of a runtime-sized cache) L is all of it, and nothing is cut.

    The indices are ScatterElements' [B,Hkv,T,D] (`standard`), or ScatterND's [B,Hkv,T,3] (b, h, slot) in the
    cpu lowering, where ONNX Runtime copies whole D-rows (4x faster per layer at T=1): see `write_cache`; with
    `fused`, the slots themselves (specrt::PackedAttention writes its rows). `tree`: (the io.TREE_MASK input, the
    slots' first slot write_index [B]): a cell also does not see the grid cells the mask hides from it."""
    # Writes past the end go to the last slot, which the runtime never lets a valid token reach.
    last = g.op("Min", slots, g.const([max_seq - 1], "last_slot", "int64"))
    if fused:
        scatter_idx = last
    elif lowering == "cpu":
        scatter_idx = _row_indices(g, shapes, last, cfg.num_kv_heads)
    else:
        idx_shape = g.op("Concat", shapes.batch, g.const([cfg.num_kv_heads], "hkv", "int64"), shapes.tokens,
                         g.const([cfg.head_dim], "hd", "int64"), axis=0)
        scatter_idx = g.op("Expand", g.op("Unsqueeze", last, g.const([1, 3], "axes13", "int64")), idx_shape,
                           name="scatter_index")
    # Query t of slot b sees key s iff s <= its own slot. An explicit mask, never is_causal: a causal
    # flag against a cache aligns top-left in ORT.
    if sized is not None:  # the cache holds what the runtime allocated for these slots: read all of it
        window = sized
        keys = g.op("Unsqueeze", g.op("Range", g.const(np.int64(0), "first_key", "int64"),
                                      g.op("Squeeze", sized, g.const([0], "axis0", "int64")),
                                      g.const(np.int64(1), "key_step", "int64")),
                    g.const([0, 1], "axes01", "int64"), name="key_positions")  # [1,1,L]
    elif lowering == "cpu":  # no query sees past the largest slot written: keys [0, L) are all it needs
        end = g.op("Add", g.op("ReduceMax", last, keepdims=0, name="last_written"),
                   g.const(np.int64(1), "one_past", "int64"), name="window_end")  # scalar L
        window = g.op("Reshape", end, g.const([1], "vector", "int64"), name="cache_window")  # [1]
        keys = g.op("Unsqueeze", g.op("Range", g.const(np.int64(0), "first_key", "int64"), end,
                                      g.const(np.int64(1), "key_step", "int64")),
                    g.const([0, 1], "axes01", "int64"), name="key_positions")  # [1,1,L]
    else:
        keys = g.const(np.arange(max_seq, dtype=np.int64).reshape(1, 1, max_seq), "key_positions")
        window = max_seq
    visible = g.op("LessOrEqual", keys, g.op("Unsqueeze", slots, g.const([2], "axis2", "int64")))
    if tree is not None:
        visible = g.op("And", visible, g.op("Not", _tree_hidden(g, shapes, keys, *tree)), name="visible")
    neg = np.finfo(np.float32).min / 2  # finite: a fully masked (padding) row stays NaN-free
    bias = g.op("Where", visible, g.const(np.float32(0.0), "zero_f"), g.const(np.float32(neg), "neg_f"))
    return scatter_idx, g.op("Unsqueeze", bias, g.const([1, 2], "axes12", "int64"), name="attention_bias"), window


def _attention(g: GraphBuilder, x: str, p: str, cache: tuple[str, str], cfg: ModelConfig, shapes: Shapes,
               rope: Rope, scatter_idx: str, bias: str, dtype: str, window: int | str, lowering: str,
               sized_cache: bool, packing: Packing | None, kv_dtype: str) -> tuple[str, str, str]:
    """Self-attention of T new tokens over the cache they are first written into; returns (o, present_k, present_v).

    `fused` (see `fuses_attention`): one specrt::PackedAttention node between the qkv and o projections does the
    rope, the cache writes and the attention of the packed rows; `scatter_idx` is then the cells' slots [B,T]."""
    if fuses_attention(g, cfg, dtype, lowering, sized_cache, packing):
        with g.scope("attn"):
            w = g.weight
            qkv = linear(g, x, w(f"{p}.qkv_proj.weight"), w(f"{p}.qkv_proj.bias") if cfg.attention_bias else None,
                         name="qkv_proj")
            norms = (w(f"{p}.q_norm.weight"), w(f"{p}.k_norm.weight")) if cfg.qk_norm else ()
            extra = {"epsilon": float(cfg.rms_norm_eps)} if cfg.qk_norm else {}
            o, present_k, present_v = g.op(
                "PackedAttention", qkv, rope[0], rope[1], scatter_idx, bias, packing.rows, *cache, *norms,
                name="attention", outputs=3, domain=PLUGIN_DOMAIN, scale=float(cfg.head_dim ** -0.5),
                heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, **extra)
            o = linear(g, o, w(f"{p}.o_proj.weight"), w(f"{p}.o_proj.bias") if cfg.o_proj_bias else None,
                       name="o_proj")
        return o, present_k, present_v
    with g.scope("attn"):
        q, k, v = project_heads(g, x, p, "qkv", shapes.qkv, cfg, rope, dtype, lowering=lowering, packing=packing)
        if kv_dtype != dtype:  # the cache's storage (--kv-dtype): rounded once, when written
            k, v = (g.op("Cast", t, to=onnx_dtype(kv_dtype), name=f"{n}_to_cache") for t, n in ((k, "k"), (v, "v")))
        present_k, present_v = write_cache(g, cache, scatter_idx, k, v, rows=lowering == "cpu")
        keys = KeyBlock("cache", present_k, present_v, window) if sized_cache else \
            cache_block(g, present_k, present_v, window)
        o = attend(g, q, [keys], bias, f"{p}.o_proj", cfg, dtype, packing=packing)
    return o, present_k, present_v


def fuses_attention(g: GraphBuilder, cfg: ModelConfig, dtype: str, lowering: str, sized_cache: bool,
                    packing: Packing | None) -> bool:
    """Whether a target layer's attention is one specrt::PackedAttention (`--kernels specrt`, cpu lowering, float32
    activations, a packed call over the runtime-sized cache; Qwen3's q/k norms inside it)."""
    return (g.kernels == "specrt" and lowering == "cpu" and sized_cache and packing is not None
            and dtype == "float32")


def decoder_layer(g: GraphBuilder, x: str, prefix: str, cache: tuple[str, str], cfg: ModelConfig, shapes: Shapes,
                  rope: Rope, scatter_idx: str, bias: str, dtype: str, window: int | str, *,
                  lowering: str = "standard", sized_cache: bool = False,
                  packing: Packing | None = None, kv_dtype: str | None = None) -> tuple[str, str, str]:
    """One pre-norm decoder layer over its KV cache; returns (x, present_k, present_v).

    `prefix` names the layer's weights (`model.layers.3`), `cache` its past K/V graph inputs; `window` is the
    cache length attention reads (S, or the cpu lowering's window tensor from `slot_io`); `sized_cache`: the
    cache is as long as the window (the runtime sized it), so attention reads it whole; `packing`: x holds the
    call's packed tokens (`attention.Packing`), not the whole grid; `kv_dtype`: the cache's elements (`dtype`).
    """
    eps = cfg.rms_norm_eps
    a = rms_norm(g, x, g.weight(f"{prefix}.input_layernorm.weight"), eps, dtype, name="input_layernorm",
                 lowering=lowering)
    o, pk, pv = _attention(g, a, f"{prefix}.self_attn", cache, cfg, shapes, rope, scatter_idx, bias, dtype, window,
                           lowering, sized_cache, packing, kv_dtype or dtype)
    x, m = add_rms_norm(g, x, o, g.weight(f"{prefix}.post_attention_layernorm.weight"), eps, dtype,
                        name="post_attention_layernorm", residual="attn_residual", lowering=lowering)
    x = g.op("Add", x, mlp(g, m, f"{prefix}.mlp", cfg.intermediate_size), name="mlp_residual")
    return x, pk, pv


def input_shapes(g: GraphBuilder, ids: str, cfg: ModelConfig) -> Shapes:
    """Shape tensors of a [B, T] token input, computed once per graph."""
    bt = g.op("Shape", ids, name="input_shape")
    qkv_heads = g.const([cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim], "qkv_heads", "int64")
    return Shapes(batch=g.op("Slice", bt, g.const([0], "s0", "int64"), g.const([1], "s1", "int64")),
                  tokens=g.op("Slice", bt, g.const([1], "s1", "int64"), g.const([2], "s2", "int64")),
                  qkv=g.op("Concat", bt, qkv_heads, axis=0, name="qkv_shape"))


def rope_inputs(g: GraphBuilder, position_ids: str, cfg: ModelConfig, dtype: str, *, rotate: bool = True) -> Rope:
    """(cos, sin, rotate_half matrix) for `apply_rope`; without `rotate` (fused attention rotates itself), no
    matrix ("")."""
    cos, sin = rope_tables(g, position_ids, cfg.inv_freq(), dtype)
    return cos, sin, g.const(rotate_half_matrix(cfg.head_dim, dtype), "rotate_half") if rotate else ""


def stack_layer_weights(out: dict[str, np.ndarray], prefix: str, cfg: ModelConfig) -> None:
    """In place: q/k/v -> `{prefix}.self_attn.qkv_proj`, gate/up -> `{prefix}.mlp.gate_up_proj`.

    Rows concatenate; a GGUF's block-quantized weights (quant.Blocks) concatenate block rows as they are."""
    a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
    out[f"{a}.qkv_proj.weight"] = concat_rows([out.pop(f"{a}.{n}_proj.weight") for n in "qkv"])
    if cfg.attention_bias:
        out[f"{a}.qkv_proj.bias"] = np.concatenate([out.pop(f"{a}.{n}_proj.bias") for n in "qkv"])
    out[f"{m}.gate_up_proj.weight"] = concat_rows([out.pop(f"{m}.gate_proj.weight"), out.pop(f"{m}.up_proj.weight")])


def stacked_types(types: dict[str, str]) -> dict[str, str]:
    """Per-tensor labels (a GGUF's types) extended to the stacked tensors `stack_layer_weights` makes: "Q4_K+Q6_K"
    for a q/k/v stack whose parts differ."""
    out = dict(types)
    for name in types:
        for parts, stacked in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if f".{parts[0]}." in name:
                labels = [types.get(name.replace(parts[0], p), "?") for p in parts]
                out[name.replace(parts[0], stacked)] = "+".join(dict.fromkeys(labels))
    return out


def target_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors the target graph reads: HF tensors, with q/k/v and gate/up stacked into one Gemm each."""
    out = dict(weights)
    for i in range(cfg.num_layers):
        stack_layer_weights(out, f"model.layers.{i}", cfg)
    return out


def target_cache_len(attention: str, max_seq: int) -> int | str:
    """The target's cache length axis: S_MAX, or in the cpu lowering the axis S the runtime sizes."""
    return io.CACHE_LEN if attention == "cpu" else max_seq


def build_target_graph(g: GraphBuilder, cfg: ModelConfig, *, max_seq: int, dtype: str,
                       features: Sequence[int | str] = (), attention: str = "standard", kv_dtype: str | None = None
                       ) -> None:
    """Emit the whole target graph into `g` over named axes B/T/R (the caller turns it into a model).

    `attention` is the lowering (`attention.LOWERINGS`): `standard` for TensorRT, `cpu` for ONNX Runtime on CPU.
    `kv_dtype`: the cache's elements (default `dtype`); new keys and values are cast to it before they are written,
    so a token's cached key is the same bits whichever call wrote it."""
    check_lowering(attention)
    d = cfg.hidden_size
    inputs, outputs = io.target_signature(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                          head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, max_seq=max_seq,
                                          dtype=dtype, feature_dim=d * len(features),
                                          cache_len=target_cache_len(attention, max_seq), cache_dtype=kv_dtype)
    for t in inputs:
        g.input(t.name, t.dtype, t.shape)
    shape = {t.name: t.shape for t in outputs}
    input_ids, position_ids, write_index, logit_rows = io.INPUT_IDS, io.POSITION_IDS, io.WRITE_INDEX, io.LOGIT_ROWS

    with g.scope("target"):
        shapes = input_shapes(g, input_ids, cfg)
        packing = Packing(io.TOKEN_ROWS, g.op("Mul", shapes.batch, shapes.tokens, name="grid_cells"))
        flat_ids = g.op("Reshape", input_ids, g.const([-1], "flat_ids", "int64"))
        x = embedding(g, g.weight("model.embed_tokens.weight"), packing.pack(g, flat_ids))  # [P, d]
        fused = fuses_attention(g, cfg, dtype, attention, attention == "cpu", packing)
        rope = rope_inputs(g, position_ids, cfg, dtype, rotate=not fused)
        scatter_idx, bias, window = cache_io(g, shapes, write_index, cfg, max_seq, dtype, lowering=attention,
                                             fused=fused)
        captured: dict[int | str, str] = {-1: x}
        presents: list[tuple[str, str]] = []
        for i in range(cfg.num_layers):
            with g.scope(f"layers.{i}"):
                x, pk, pv = decoder_layer(g, x, f"model.layers.{i}", io.past_names(i), cfg, shapes, rope,
                                          scatter_idx, bias, dtype, window, lowering=attention,
                                          sized_cache=attention == "cpu", packing=packing, kv_dtype=kv_dtype)
            captured[i] = x
            presents.append((pk, pv))
        h = rms_norm(g, x, g.weight("model.norm.weight"), cfg.rms_norm_eps, dtype, name="norm", lowering=attention)
        captured[FINAL] = h

        with g.scope("head"):
            picked = g.op("Gather", h, logit_rows, axis=0, name="pick_rows")  # [R,d]
            head_w = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            logits = linear(g, picked, g.weight(head_w), name="lm_head")  # [R,V]
        g.output(logits, io.LOGITS, dtype, shape[io.LOGITS])
        if features:
            with g.scope("features"):
                feats = g.op("Concat", *[captured[s] for s in features], axis=-1) if len(features) > 1 \
                    else g.op("Identity", captured[features[0]])
                feats = packing.unpack(g, feats, d * len(features), dtype)  # zero at cells not computed
                feats = g.op("Reshape", feats, g.op("Concat", shapes.batch, shapes.tokens,
                                                    g.const([d * len(features)], "f", "int64"), axis=0))
            g.output(feats, io.FEATURES, dtype, shape[io.FEATURES])
    dtypes = {t.name: t.dtype for t in outputs}
    for i, (pk, pv) in enumerate(presents):
        for value, name in zip((pk, pv), io.present_names(i)):
            g.output(value, name, dtypes[name], shape[name])
