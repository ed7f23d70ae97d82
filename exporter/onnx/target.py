"""The target graph: embedding, decoder layers over a fixed-size KV cache, final norm, head.

    input_ids[B,T] -> Gather(embed) -> x[N=B*T, d]
        for each layer:  x += o_proj(attention(norm(x), cache))  ;  x += mlp(norm(x))
    norm(x) -> features[B,T,F] (optional) ; rows picked by logit_rows[B,R] -> Gemm(head) -> logits[B,R,V]

The graph is written for fixed shapes, but every Reshape takes its sizes from Shape(input_ids) or
0/-1, so the same graph body is valid for any B/T/R: the exporter writes one file per shape and the
ONNX Runtime backend may serve all of a family's shapes from one session (one copy of the weights).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt import artifact as io
from specrt.exporter.config import ModelConfig
from specrt.exporter.onnx.builder import GraphBuilder, onnx_dtype
from specrt.exporter.onnx.layers import Shapes, apply_rope, linear, mlp, rms_norm, rope_tables, rotate_half_matrix

FINAL = "final"  # feature source: the final-normed hidden state (what MTP consumes)


def cache_io(g: GraphBuilder, shapes: Shapes, write_index: str, cfg: ModelConfig, max_seq: int,
             dtype: str) -> tuple[str, str]:
    """Scatter indices and attention bias for T new tokens written at write_index[b] + t."""
    with g.scope("cache_io"):
        t_range = g.op("Range", g.const(0, "zero", "int64"),
                       g.op("Squeeze", shapes.tokens, g.const([0], "axis0", "int64")),
                       g.const(1, "one", "int64"))  # [T]
        qpos = g.op("Add", g.op("Unsqueeze", write_index, g.const([1], "axis1", "int64")), t_range,
                    name="query_positions")  # [B,T]: cache slot of each new token
        return slot_io(g, shapes, qpos, cfg, max_seq)


def slot_io(g: GraphBuilder, shapes: Shapes, slots: str, cfg: ModelConfig, max_seq: int) -> tuple[str, str]:
    """For new tokens at cache slots [B,T]: scatter indices [B,Hkv,T,D] and the bias [B,1,1,T,S]."""
    # Writes past the end go to the last slot, which the runtime never lets a valid token reach.
    last = g.op("Min", slots, g.const([max_seq - 1], "last_slot", "int64"))
    idx_shape = g.op("Concat", shapes.batch, g.const([cfg.num_kv_heads], "hkv", "int64"), shapes.tokens,
                     g.const([cfg.head_dim], "hd", "int64"), axis=0)
    scatter_idx = g.op("Expand", g.op("Unsqueeze", last, g.const([1, 3], "axes13", "int64")), idx_shape,
                       name="scatter_index")
    # Query t of slot b sees key s iff s <= its own slot. An explicit mask, never is_causal: a causal
    # flag against a cache aligns top-left in ORT.
    keys = g.const(np.arange(max_seq, dtype=np.int64).reshape(1, 1, max_seq), "key_positions")
    visible = g.op("LessOrEqual", keys, g.op("Unsqueeze", slots, g.const([2], "axis2", "int64")))
    neg = np.finfo(np.float32).min / 2  # finite: a fully masked (padding) row stays NaN-free
    bias = g.op("Where", visible, g.const(np.float32(0.0), "zero_f"), g.const(np.float32(neg), "neg_f"))
    return scatter_idx, g.op("Unsqueeze", bias, g.const([1, 2], "axes12", "int64"), name="attention_bias")


def _attention(g: GraphBuilder, x: str, p: str, cache: tuple[str, str], cfg: ModelConfig, shapes: Shapes,
               rope: tuple[str, str, str], scatter_idx: str, bias: str, dtype: str, max_seq: int
               ) -> tuple[str, str, str]:
    H, Hkv, D, G = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.kv_groups
    w = g.weight
    with g.scope("attn"):
        qkv_bias = w(f"{p}.qkv_proj.bias") if cfg.attention_bias else None
        qkv = linear(g, x, w(f"{p}.qkv_proj.weight"), qkv_bias, name="qkv_proj")
        qkv = g.op("Reshape", qkv, shapes.qkv, name="qkv_heads")  # [B,T,H+2Hkv,D]
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm on q and k before rope
            q, k, v = g.op("Split", qkv, g.const([H, Hkv, Hkv], "qkv_sizes", "int64"), axis=2, outputs=3)
            q = apply_rope(g, rms_norm(g, q, w(f"{p}.q_norm.weight"), cfg.rms_norm_eps, dtype, name="q_norm"),
                           *rope, name="q_rope")
            k = apply_rope(g, rms_norm(g, k, w(f"{p}.k_norm.weight"), cfg.rms_norm_eps, dtype, name="k_norm"),
                           *rope, name="k_rope")
        else:  # q and k share one rope pass
            qk, v = g.op("Split", qkv, g.const([H + Hkv, Hkv], "qk_v_sizes", "int64"), axis=2, outputs=2)
            q, k = g.op("Split", apply_rope(g, qk, *rope, name="qk_rope"), g.const([H, Hkv], "q_k_sizes", "int64"),
                        axis=2, outputs=2)
        # [B,T,H,D] -> [B,H,T,D] -> [B,Hkv,G*T,D]: the G query heads of a KV head become extra rows,
        # so attention reads each cached K/V once instead of repeating the cache G times.
        q = g.op("Mul", q, g.const(np.asarray(D ** -0.5, dtype=dtype), "scale"))
        q = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 1, 3]), g.const([0, Hkv, -1, D], "grouped", "int64"))
        k = g.op("Transpose", k, perm=[0, 2, 1, 3], name="k_bhtd")
        v = g.op("Transpose", v, perm=[0, 2, 1, 3], name="v_bhtd")
        past_k, past_v = cache
        present_k = g.op("ScatterElements", past_k, scatter_idx, k, axis=2, name="write_k")
        present_v = g.op("ScatterElements", past_v, scatter_idx, v, axis=2, name="write_v")
        scores = g.op("MatMul", q, g.op("Transpose", present_k, perm=[0, 1, 3, 2]), name="qk")  # [B,Hkv,G*T,S]
        scores = _split_groups(g, scores, Hkv, G, max_seq)
        if dtype != "float32":
            scores = g.op("Cast", scores, to=onnx_dtype("float32"))
        probs = g.op("Softmax", g.op("Add", scores, bias, name="mask"), axis=-1)
        if dtype != "float32":
            probs = g.op("Cast", probs, to=onnx_dtype(dtype))
        probs = g.op("Reshape", probs, g.const([0, Hkv, -1, max_seq], "rows", "int64"))
        out = g.op("MatMul", probs, present_v, name="pv")  # [B,Hkv,G*T,D]
        out = g.op("Transpose", g.op("Reshape", out, g.const([0, H, -1, D], "heads", "int64")), perm=[0, 2, 1, 3])
        out = g.op("Reshape", out, g.const([-1, H * D], "flat", "int64"))
        o = linear(g, out, w(f"{p}.o_proj.weight"), w(f"{p}.o_proj.bias") if cfg.o_proj_bias else None,
                   name="o_proj")
    return o, present_k, present_v


def _split_groups(g: GraphBuilder, scores: str, n_kv: int, groups: int, max_seq: int) -> str:
    """[B,Hkv,G*T,S] -> [B,Hkv,G,T,S] so the [B,1,1,T,S] bias broadcasts over groups."""
    return g.op("Reshape", scores, g.const([0, n_kv, groups, -1, max_seq], "per_group", "int64"))


def decoder_layer(g: GraphBuilder, x: str, prefix: str, cache: tuple[str, str], cfg: ModelConfig, shapes: Shapes,
                  rope: tuple[str, str, str], scatter_idx: str, bias: str, dtype: str, max_seq: int
                  ) -> tuple[str, str, str]:
    """One pre-norm decoder layer over its KV cache; returns (x, present_k, present_v).

    `prefix` names the layer's weights (`model.layers.3`), `cache` its past K/V graph inputs.
    """
    a = rms_norm(g, x, g.weight(f"{prefix}.input_layernorm.weight"), cfg.rms_norm_eps, dtype,
                 name="input_layernorm")
    o, pk, pv = _attention(g, a, f"{prefix}.self_attn", cache, cfg, shapes, rope, scatter_idx, bias, dtype, max_seq)
    x = g.op("Add", x, o, name="attn_residual")
    m = rms_norm(g, x, g.weight(f"{prefix}.post_attention_layernorm.weight"), cfg.rms_norm_eps, dtype,
                 name="post_attention_layernorm")
    x = g.op("Add", x, mlp(g, m, f"{prefix}.mlp", cfg.intermediate_size), name="mlp_residual")
    return x, pk, pv


def input_shapes(g: GraphBuilder, ids: str, cfg: ModelConfig) -> Shapes:
    """Shape tensors of a [B, T] token input, computed once per graph."""
    bt = g.op("Shape", ids, name="input_shape")
    qkv_heads = g.const([cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim], "qkv_heads", "int64")
    return Shapes(batch=g.op("Slice", bt, g.const([0], "s0", "int64"), g.const([1], "s1", "int64")),
                  tokens=g.op("Slice", bt, g.const([1], "s1", "int64"), g.const([2], "s2", "int64")),
                  qkv=g.op("Concat", bt, qkv_heads, axis=0, name="qkv_shape"))


def rope_inputs(g: GraphBuilder, position_ids: str, cfg: ModelConfig, dtype: str) -> tuple[str, str, str]:
    """(cos, sin, rotate_half matrix) for `apply_rope`."""
    return (*rope_tables(g, position_ids, cfg.inv_freq(), dtype),
            g.const(rotate_half_matrix(cfg.head_dim, dtype), "rotate_half"))


def stack_layer_weights(out: dict[str, np.ndarray], prefix: str, cfg: ModelConfig) -> None:
    """In place: q/k/v -> `{prefix}.self_attn.qkv_proj`, gate/up -> `{prefix}.mlp.gate_up_proj`."""
    a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
    out[f"{a}.qkv_proj.weight"] = np.concatenate([out.pop(f"{a}.{n}_proj.weight") for n in "qkv"])
    if cfg.attention_bias:
        out[f"{a}.qkv_proj.bias"] = np.concatenate([out.pop(f"{a}.{n}_proj.bias") for n in "qkv"])
    out[f"{m}.gate_up_proj.weight"] = np.concatenate([out.pop(f"{m}.gate_proj.weight"), out.pop(f"{m}.up_proj.weight")])


def target_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors the target graph reads: HF tensors, with q/k/v and gate/up stacked into one Gemm each."""
    out = dict(weights)
    for i in range(cfg.num_layers):
        stack_layer_weights(out, f"model.layers.{i}", cfg)
    return out


def build_target_graph(g: GraphBuilder, cfg: ModelConfig, *, batch: int, tokens: int, rows: int,
                       max_seq: int, dtype: str, features: Sequence[int | str] = ()) -> None:
    """Emit the whole target graph into `g` (the caller turns it into a model)."""
    d = cfg.hidden_size
    input_ids = g.input(io.INPUT_IDS, "int64", (batch, tokens))
    position_ids = g.input(io.POSITION_IDS, "int64", (batch, tokens))
    write_index = g.input(io.WRITE_INDEX, "int64", (batch,))
    logit_rows = g.input(io.LOGIT_ROWS, "int64", (batch, rows))
    cache_shape = (batch, cfg.num_kv_heads, max_seq, cfg.head_dim)
    for i in range(cfg.num_layers):
        for name in io.past_names(i):
            g.input(name, dtype, cache_shape)

    with g.scope("target"):
        shapes = input_shapes(g, input_ids, cfg)
        x = g.op("Gather", g.weight("model.embed_tokens.weight"), input_ids, name="embed_tokens")
        x = g.op("Reshape", x, g.const([-1, d], "flat", "int64"))  # [N, d]
        rope = rope_inputs(g, position_ids, cfg, dtype)
        scatter_idx, bias = cache_io(g, shapes, write_index, cfg, max_seq, dtype)
        captured: dict[int | str, str] = {-1: x}
        presents: list[tuple[str, str]] = []
        for i in range(cfg.num_layers):
            with g.scope(f"layers.{i}"):
                x, pk, pv = decoder_layer(g, x, f"model.layers.{i}", io.past_names(i), cfg, shapes, rope,
                                          scatter_idx, bias, dtype, max_seq)
            captured[i] = x
            presents.append((pk, pv))
        h = rms_norm(g, x, g.weight("model.norm.weight"), cfg.rms_norm_eps, dtype, name="norm")
        captured[FINAL] = h

        with g.scope("head"):
            h3 = g.op("Reshape", h, g.op("Concat", shapes.batch, shapes.tokens, g.const([d], "d", "int64"), axis=0))
            rows_shape = g.op("Shape", logit_rows)
            idx = g.op("Expand", g.op("Unsqueeze", logit_rows, g.const([2], "axis2", "int64")),
                       g.op("Concat", rows_shape, g.const([d], "d", "int64"), axis=0))
            picked = g.op("GatherElements", h3, idx, axis=1, name="pick_rows")  # [B,R,d]
            head_w = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            logits = linear(g, g.op("Reshape", picked, g.const([-1, d], "flat", "int64")), g.weight(head_w),
                            name="lm_head")
            logits = g.op("Reshape", logits, g.op("Concat", rows_shape,
                                                  g.const([cfg.vocab_size], "vocab", "int64"), axis=0))
        g.output(logits, io.LOGITS, dtype, (batch, rows, cfg.vocab_size))
        if features:
            with g.scope("features"):
                feats = g.op("Concat", *[captured[s] for s in features], axis=-1) if len(features) > 1 \
                    else g.op("Identity", captured[features[0]])
                feats = g.op("Reshape", feats, g.op("Concat", shapes.batch, shapes.tokens,
                                                    g.const([d * len(features)], "f", "int64"), axis=0))
            g.output(feats, io.FEATURES, dtype, (batch, tokens, d * len(features)))
    for i, (pk, pv) in enumerate(presents):
        for value, name in zip((pk, pv), io.present_names(i)):
            g.output(value, name, dtype, cache_shape)
