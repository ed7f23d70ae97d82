"""The DSpark draft graph (contract: `dspark_signature` and the "draft graphs" comment in specrt/artifact.py).

Weights live under `dspark.*` in the shared weights.bin, except embed/lm_head, which reuse the target's
tensors when they are equal (DeepSpec stores frozen copies of them).
"""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from specrt import artifact as io
from specrt.exporter.config import ModelConfig
from specrt.exporter.loaders.deepspec import DSparkConfig
from specrt.exporter.onnx.builder import GraphBuilder, onnx_dtype
from specrt.exporter.onnx.layers import apply_rope, linear, mlp, rms_norm, rope_tables, rotate_half_matrix

P = "dspark."  # weight-name prefix in the shared store
F32 = onnx_dtype("float32")


def dspark_weights(cfg: DSparkConfig, weights: dict[str, np.ndarray],
                   target_weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors the draft graph reads: `dspark.`-prefixed DeepSpec tensors with k/v and gate/up stacked;
    embed/lm_head under the target's names when numerically equal to the target's (stored once)."""
    out = {P + k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    for i in range(cfg.layers.num_layers):
        a, m = f"{P}layers.{i}.self_attn", f"{P}layers.{i}.mlp"
        # k/v stacked (context rows need only k/v); q stays apart, so no q is computed for context rows
        out[f"{a}.kv_proj.weight"] = np.concatenate([out.pop(f"{a}.k_proj.weight"), out.pop(f"{a}.v_proj.weight")])
        if cfg.layers.attention_bias:
            out[f"{a}.kv_proj.bias"] = np.concatenate([out.pop(f"{a}.k_proj.bias"), out.pop(f"{a}.v_proj.bias")])
        out[f"{m}.gate_up_proj.weight"] = np.concatenate([out.pop(f"{m}.gate_proj.weight"),
                                                          out.pop(f"{m}.up_proj.weight")])
    head_name = "lm_head.weight" if "lm_head.weight" in target_weights else "model.embed_tokens.weight"
    for own, shared in (("embed_tokens.weight", "model.embed_tokens.weight"), ("lm_head.weight", head_name)):
        if own not in weights:  # a compact checkpoint: the target's tensor by definition
            continue
        ref = target_weights.get(shared)
        same = ref is not None and np.array_equal(weights[own], ref)
        out[shared if same else P + own] = weights[own]
    return out


def _shared(g: GraphBuilder, own: str, target_name: str) -> str:
    """The draft's own copy when `dspark_weights` kept one, else the target's tensor."""
    return g.weight(P + own if P + own in g.store else target_name)


# ctx_features[B,C,F] --fc--hidden_norm--> ctx[B*C,d] ------------------------------+ (every layer)
# [anchor, mask x (K-1)] --Gather(embed)--> x[B*K,d]   positions ctx_len + 0..K-1   |
#   layer i:  k/v(ctx) -k_norm-rope@ctx_positions-> ScatterElements(past, ctx_write_index + c) = present
#             q, k/v(norm(x)) -q/k_norm-rope-> softmax(q.[present (s < ctx_len) ; block K keys]) -> o_proj
#             x += attn ; x += mlp(norm(x))
# h = norm(x) --lm_head--> U[B,K,V]
# for k in 0..K-1 (unrolled): e = W1[prev_k] (prev_0 = anchor, prev_k = token_{k-1})
#   corrected_k = U_k + markov(e, h_k, state) --sample(T, noise_k)--> token_k, probs_k
# confidence = proj([h ; E]) + b


def build_dspark_graph(g: GraphBuilder, cfg: DSparkConfig, target_cfg: ModelConfig, *, batch: int, ctx_rows: int,
                       max_seq: int, dtype: str) -> None:
    """Emit the whole DSpark draft graph into `g`; its store must hold `dspark_weights(...)`."""
    lc, K = cfg.layers, cfg.block_size
    cfg.check_target(target_cfg)
    feats = g.input(io.CTX_FEATURES, dtype, (batch, ctx_rows, cfg.feature_dim))
    ctx_pos = g.input(io.CTX_POSITIONS, "int64", (batch, ctx_rows))
    write_index = g.input(io.CTX_WRITE_INDEX, "int64", (batch,))
    ctx_len = g.input(io.CTX_LEN, "int64", (batch,))
    anchor = g.input(io.ANCHOR_IDS, "int64", (batch,))
    temperature = g.input(io.TEMPERATURE, "float32", (batch,))
    noise = g.input(io.NOISE, "float32", (batch, K))
    cache_shape = (batch, lc.num_kv_heads, max_seq, lc.head_dim)
    for i in range(lc.num_layers):
        for name in io.past_names(i):
            g.input(name, dtype, cache_shape)

    with g.scope("dspark"):
        ctx = _context(g, cfg, feats, dtype)
        with g.scope("block"):
            ids = g.op("Where", g.const(np.arange(K).reshape(1, K) == 0, "is_anchor"),
                       g.op("Unsqueeze", anchor, g.const([1], "axis1", "int64")),
                       g.const(np.int64(cfg.mask_token_id), "mask_token"), name="block_ids")  # [B,K]
            x = g.op("Gather", _shared(g, "embed_tokens.weight", "model.embed_tokens.weight"), ids,
                     name="embed_tokens")
            x = g.op("Reshape", x, g.const([-1, lc.hidden_size], "flat", "int64"))  # [B*K, d]
            block_pos = g.op("Add", g.op("Unsqueeze", ctx_len, g.const([1], "axis1", "int64")),
                             g.const(np.arange(K, dtype=np.int64), "offsets"), name="positions")
            rope_block = rope_tables(g, block_pos, lc.inv_freq(), dtype)
        with g.scope("ctx"):
            rope_ctx = rope_tables(g, ctx_pos, lc.inv_freq(), dtype)
        rotate = g.const(rotate_half_matrix(lc.head_dim, dtype), "rotate_half")
        scatter_idx, bias, ctx_kv_shape = _cache_io(g, lc, ctx_pos, write_index, ctx_len, K, max_seq)
        presents = []
        for i in range(lc.num_layers):
            with g.scope(f"layers.{i}"):
                p = f"{P}layers.{i}"
                a = rms_norm(g, x, g.weight(f"{p}.input_layernorm.weight"), lc.rms_norm_eps, dtype,
                             name="input_layernorm")
                o, pk, pv = _attention(g, a, ctx, p, lc, K, io.past_names(i), (*rope_block, rotate),
                                       (*rope_ctx, rotate), scatter_idx, bias, ctx_kv_shape, dtype, max_seq)
                x = g.op("Add", x, o, name="attn_residual")
                m = rms_norm(g, x, g.weight(f"{p}.post_attention_layernorm.weight"), lc.rms_norm_eps, dtype,
                             name="post_attention_layernorm")
                x = g.op("Add", x, mlp(g, m, f"{p}.mlp", lc.intermediate_size), name="mlp_residual")
            presents.append((pk, pv))
        h = rms_norm(g, x, g.weight(P + "norm.weight"), lc.rms_norm_eps, dtype, name="norm")
        head = "lm_head.weight" if not target_cfg.tie_word_embeddings else "model.embed_tokens.weight"
        base = linear(g, h, _shared(g, "lm_head.weight", head), name="lm_head")  # [B*K, V]
        tokens, logits, probs, conf = _draft_heads(g, cfg, base, h, anchor, temperature, noise, dtype)

    V = lc.vocab_size
    g.output(tokens, io.DRAFT_TOKENS, "int64", (batch, K))
    g.output(logits, io.DRAFT_LOGITS, dtype, (batch, K, V))
    g.output(probs, io.DRAFT_PROBS, "float32", (batch, K, V))
    if conf is not None:
        g.output(conf, io.CONFIDENCE_LOGITS, dtype, (batch, K))
    for i, (pk, pv) in enumerate(presents):
        for value, name in zip((pk, pv), io.present_names(i)):
            g.output(value, name, dtype, cache_shape)


def _context(g: GraphBuilder, cfg: DSparkConfig, feats: str, dtype: str) -> str:
    """ctx = hidden_norm(fc(features)) [B*C, d], in fp32 whatever the graph dtype (fp16 overflows here)."""
    with g.scope("context"):
        x = g.op("Reshape", feats, g.const([-1, cfg.feature_dim], "flat", "int64"))
        w, nw = g.weight(P + "fc.weight"), g.weight(P + "hidden_norm.weight")
        if dtype != "float32":
            x, w, nw = (g.op("Cast", t, to=F32) for t in (x, w, nw))
        ctx = rms_norm(g, linear(g, x, w, name="fc"), nw, cfg.layers.rms_norm_eps, "float32", name="hidden_norm")
        return g.op("Cast", ctx, to=onnx_dtype(dtype)) if dtype != "float32" else ctx


def _cache_io(g: GraphBuilder, lc: ModelConfig, ctx_pos: str, write_index: str, ctx_len: str, K: int,
              max_seq: int) -> tuple[str, str, str]:
    """Scatter indices [B,Hkv,C,D] for the context K/V, bias [B,1,1,S+K] over [cache ; block], ctx K/V shape."""
    with g.scope("cache_io"):
        bc = g.op("Shape", ctx_pos, name="ctx_shape")  # [B, C]
        c_range = g.op("Range", g.const(0, "zero", "int64"), g.op("Gather", bc, g.const(1, "one", "int64")),
                       g.const(1, "step", "int64"))
        slot = g.op("Add", g.op("Unsqueeze", write_index, g.const([1], "axis1", "int64")), c_range, name="slots")
        # Rows past the end go to the last slot, which the runtime never lets a valid row reach.
        slot = g.op("Min", slot, g.const([max_seq - 1], "last_slot", "int64"))
        idx_shape = g.op("Concat", g.op("Slice", bc, g.const([0], "s0", "int64"), g.const([1], "s1", "int64")),
                         g.const([lc.num_kv_heads], "hkv", "int64"), g.op("Gather", bc, g.const([1], "c", "int64")),
                         g.const([lc.head_dim], "hd", "int64"), axis=0)
        scatter_idx = g.op("Expand", g.op("Unsqueeze", slot, g.const([1, 3], "axes13", "int64")), idx_shape,
                           name="scatter_index")
        kv_shape = g.op("Concat", bc, g.const([2 * lc.num_kv_heads, lc.head_dim], "kv_heads", "int64"), axis=0)
        # Cache slot s is visible iff s < ctx_len[b]; the K block keys (appended after S) always are.
        keys = g.const(np.arange(max_seq + K, dtype=np.int64).reshape(1, -1), "key_index")
        in_ctx = g.op("Less", keys, g.op("Unsqueeze", ctx_len, g.const([1], "axis1", "int64")))
        visible = g.op("Or", in_ctx, g.const((np.arange(max_seq + K) >= max_seq).reshape(1, -1), "is_block"))
        neg = np.finfo(np.float32).min / 2  # finite: no NaN even with an empty context
        bias = g.op("Where", visible, g.const(np.float32(0.0), "zero_f"), g.const(np.float32(neg), "neg_f"))
        bias = g.op("Unsqueeze", bias, g.const([1, 2], "axes12", "int64"), name="attention_bias")
    return scatter_idx, bias, kv_shape


def _attention(g: GraphBuilder, a: str, ctx: str, p: str, lc: ModelConfig, K: int, cache: tuple[str, str],
               rope_block: tuple[str, str, str], rope_ctx: tuple[str, str, str], scatter_idx: str, bias: str,
               ctx_kv_shape: str, dtype: str, max_seq: int) -> tuple[str, str, str]:
    H, Hkv, D = lc.num_heads, lc.num_kv_heads, lc.head_dim
    w = g.weight
    with g.scope("attn"):
        bq, bkv = (w(f"{p}.self_attn.q_proj.bias"), w(f"{p}.self_attn.kv_proj.bias")) if lc.attention_bias \
            else (None, None)
        q = g.op("Reshape", linear(g, a, w(f"{p}.self_attn.q_proj.weight"), bq, name="q_proj"),
                 g.const([-1, K, H, D], "q_heads", "int64"))  # [B,K,H,D]
        kv_w = w(f"{p}.self_attn.kv_proj.weight")
        kv_b = g.op("Reshape", linear(g, a, kv_w, bkv, name="kv_proj"),
                    g.const([-1, K, 2 * Hkv, D], "kv_heads", "int64"))  # [B,K,2Hkv,D]
        kv_c = g.op("Reshape", linear(g, ctx, kv_w, bkv, name="ctx_kv_proj"), ctx_kv_shape)  # [B,C,2Hkv,D]
        sizes = g.const([Hkv, Hkv], "kv_sizes", "int64")
        kb, vb = g.op("Split", kv_b, sizes, axis=2, outputs=2, name="split_block")
        kc, vc = g.op("Split", kv_c, sizes, axis=2, outputs=2, name="split_ctx")
        if lc.qk_norm:  # Qwen3: per-head RMSNorm before rope; k_norm also on the context keys
            q = rms_norm(g, q, w(f"{p}.self_attn.q_norm.weight"), lc.rms_norm_eps, dtype, name="q_norm")
            kb = rms_norm(g, kb, w(f"{p}.self_attn.k_norm.weight"), lc.rms_norm_eps, dtype, name="k_norm")
            kc = rms_norm(g, kc, w(f"{p}.self_attn.k_norm.weight"), lc.rms_norm_eps, dtype, name="ctx_k_norm")
        q = apply_rope(g, q, *rope_block, name="q_rope")
        kb = apply_rope(g, kb, *rope_block, name="k_rope")
        kc = apply_rope(g, kc, *rope_ctx, name="ctx_k_rope")
        # [B,K,H,D] -> [B,Hkv,G*K,D]: a KV head's G query heads become extra rows (HF repeat_kv order)
        q = g.op("Mul", q, g.const(np.asarray(D ** -0.5, dtype=dtype), "scale"))
        q = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 1, 3]), g.const([0, Hkv, -1, D], "grouped", "int64"))
        kb, vb, kc, vc = (g.op("Transpose", t, perm=[0, 2, 1, 3], name=n)
                          for t, n in ((kb, "k_bhkd"), (vb, "v_bhkd"), (kc, "ctx_k_bhcd"), (vc, "ctx_v_bhcd")))
        present_k = g.op("ScatterElements", cache[0], scatter_idx, kc, axis=2, name="write_k")
        present_v = g.op("ScatterElements", cache[1], scatter_idx, vc, axis=2, name="write_v")
        # Scores against the cache and against the block, side by side: the cache is never copied.
        s_cache = g.op("MatMul", q, g.op("Transpose", present_k, perm=[0, 1, 3, 2]), name="qk_cache")
        s_block = g.op("MatMul", q, g.op("Transpose", kb, perm=[0, 1, 3, 2]), name="qk_block")
        scores = g.op("Concat", s_cache, s_block, axis=-1, name="scores")  # [B,Hkv,G*K,S+K]
        if dtype != "float32":
            scores = g.op("Cast", scores, to=F32)
        probs = g.op("Softmax", g.op("Add", scores, bias, name="mask"), axis=-1)
        if dtype != "float32":
            probs = g.op("Cast", probs, to=onnx_dtype(dtype))
        p_cache, p_block = g.op("Split", probs, g.const([max_seq, K], "sk_sizes", "int64"), axis=-1, outputs=2)
        out = g.op("Add", g.op("MatMul", p_cache, present_v, name="pv_cache"),
                   g.op("MatMul", p_block, vb, name="pv_block"))  # [B,Hkv,G*K,D]
        out = g.op("Transpose", g.op("Reshape", out, g.const([0, H, K, D], "heads", "int64")), perm=[0, 2, 1, 3])
        out = g.op("Reshape", out, g.const([-1, H * D], "flat", "int64"))
        bo = w(f"{p}.self_attn.o_proj.bias") if lc.o_proj_bias else None
        o = linear(g, out, w(f"{p}.self_attn.o_proj.weight"), bo, name="o_proj")
    return o, present_k, present_v


def _draft_heads(g: GraphBuilder, cfg: DSparkConfig, base: str, h: str, anchor: str, temperature: str, noise: str,
                 dtype: str) -> tuple[str, str, str, str | None]:
    """Markov loop unrolled over the K slots with in-graph sampling, then the confidence head."""
    lc, K, r = cfg.layers, cfg.block_size, cfg.markov_rank
    V, d = lc.vocab_size, lc.hidden_size
    with g.scope("heads"):
        base3 = g.op("Reshape", base, g.const([-1, K, V], "bkv", "int64"))
        h3 = g.op("Reshape", h, g.const([-1, K, d], "bkd", "int64"))
        if not r:  # DFlash: no sequential dependency, all K slots sampled at once
            tokens, probs = _sample(g, base3, g.op("Unsqueeze", temperature, g.const([1, 2], "ax12", "int64")),
                                    g.op("Unsqueeze", noise, g.const([2], "ax2", "int64")), V, dtype)
            logits, embs = base3, None
        else:
            t_col = g.op("Unsqueeze", temperature, g.const([1], "ax1", "int64"))  # [B,1]
            state = None
            if cfg.markov_head_type == "rnn":  # s_0 = 0, [B, r]
                shape = g.op("Concat", g.op("Shape", anchor), g.const([r], "rank", "int64"), axis=0)
                state = g.op("ConstantOfShape", shape, value=numpy_helper.from_array(np.zeros(1, dtype)))
            prev, cols = anchor, {"tok": [], "logits": [], "probs": [], "emb": []}
            for k in range(K):
                with g.scope(f"slot.{k}"):
                    u = g.op("Gather", base3, g.const(np.int64(k), "k"), axis=1, name="base_logits")  # [B,V]
                    hk = g.op("Gather", h3, g.const(np.int64(k), "k"), axis=1, name="hidden")  # [B,d]
                    e = g.op("Gather", g.weight(P + "markov_head.markov_w1.weight"), prev, name="markov_w1")
                    corrected, state = _markov_step(g, cfg, u, e, hk, state, dtype)
                    nz = g.op("Slice", noise, g.const([k], "k0", "int64"), g.const([k + 1], "k1", "int64"),
                              g.const([1], "ax", "int64"))  # [B,1]
                    prev, pk = _sample(g, corrected, t_col, nz, V, dtype)  # prev_{k+1} = token_k
                    ax1 = g.const([1], "ax1", "int64")
                    for key, val in (("tok", prev), ("logits", corrected), ("probs", pk), ("emb", e)):
                        cols[key].append(g.op("Unsqueeze", val, ax1, name=f"stack_{key}"))
            tokens, logits, probs, embs = (g.op("Concat", *cols[key], axis=1, name=key)
                                           for key in ("tok", "logits", "probs", "emb"))
        conf = None
        if cfg.enable_confidence_head:
            with g.scope("confidence_head"):
                feats = g.op("Concat", h3, embs, axis=-1) if cfg.confidence_head_with_markov else h3
                width = d + (r if cfg.confidence_head_with_markov else 0)
                flat = g.op("Reshape", feats, g.const([-1, width], "flat", "int64"))
                c = linear(g, flat, g.weight(P + "confidence_head.proj.weight"),
                           g.weight(P + "confidence_head.proj.bias"), name="proj")
                conf = g.op("Reshape", c, g.const([-1, K], "bk", "int64"))
    return tokens, logits, probs, conf


def _markov_step(g: GraphBuilder, cfg: DSparkConfig, u: str, e: str, hk: str, state: str | None, dtype: str
                 ) -> tuple[str, str | None]:
    """corrected = U_k + W2(.) for the vanilla / gated / rnn head (reference §1.7); returns the new rnn state."""
    w2 = g.weight(P + "markov_head.markov_w2.weight")
    mh = P + "markov_head."
    if cfg.markov_head_type == "vanilla":
        return g.op("Add", u, linear(g, e, w2, name="markov_w2")), state
    if cfg.markov_head_type == "gated":  # g = sigmoid(gate_proj([h ; e]))
        gate = g.op("Sigmoid", linear(g, g.op("Concat", hk, e, axis=-1), g.weight(mh + "gate_proj.weight"),
                                      g.weight(mh + "gate_proj.bias"), name="gate_proj"))
        return g.op("Add", u, linear(g, g.op("Mul", gate, e), w2, name="markov_w2")), state
    # rnn: z = [s ; e ; h] -> gate, candidate, output; the output uses z (the old state)
    r = cfg.markov_rank
    z = g.op("Concat", state, e, hk, axis=-1)
    j = linear(g, z, g.weight(mh + "joint_proj.weight"), g.weight(mh + "joint_proj.bias"), name="joint_proj")
    gate, cand, out = g.op("Split", j, g.const([r, r, r], "sizes", "int64"), axis=-1, outputs=3)
    sg = g.op("Sigmoid", gate)
    new_state = g.op("Add", g.op("Mul", sg, state),
                     g.op("Mul", g.op("Sub", g.const(np.asarray(1.0, dtype=dtype), "one"), sg),
                          g.op("Tanh", cand)), name="state")
    return g.op("Add", u, linear(g, g.op("Tanh", out), w2, name="markov_w2")), new_state


def _sample(g: GraphBuilder, logits: str, temp: str, noise: str, V: int, dtype: str) -> tuple[str, str]:
    """The sampling rule of artifact.py over the last axis; temp/noise broadcast as [...,1].

    Returns (tokens [...], probs [..., V] f32): probs = softmax(logits / T) (T = 1 where temperature = 0),
    token = min(#(cumsum(probs) <= noise * total), V-1) if temperature > 0 else the first argmax.
    """
    with g.scope("sample"):
        lf = g.op("Cast", logits, to=F32) if dtype != "float32" else logits
        hot = g.op("Greater", temp, g.const(np.float32(0.0), "zero"))
        t = g.op("Where", hot, temp, g.const(np.float32(1.0), "one"))
        probs = g.op("Softmax", g.op("Div", lf, t), axis=-1, name="probs")
        greedy = g.op("ArgMax", lf, axis=-1, keepdims=1, select_last_index=0, name="greedy")  # first max
        cdf = g.op("CumSum", probs, g.const(np.int64(-1), "axis"), name="cdf")
        total = g.op("Slice", cdf, g.const([-1], "last", "int64"), g.const([V], "end", "int64"),
                     g.const([-1], "axes", "int64"), name="total")  # cdf[-1], ~1 up to rounding
        below = g.op("LessOrEqual", cdf, g.op("Mul", noise, total))
        count = g.op("ReduceSum", g.op("Cast", below, to=F32), g.const([-1], "axes", "int64"), keepdims=1)
        sampled = g.op("Min", g.op("Cast", count, to=onnx_dtype("int64")), g.const([V - 1], "last_id", "int64"))
        token = g.op("Where", hot, sampled, greedy, name="token")
        return g.op("Squeeze", token, g.const([-1], "axes", "int64")), probs
