"""The DSpark draft graph (contract: `dspark_signature` and the "draft graphs" comment in specrt/artifact.py).

Weights live under `dspark.*` in the shared weights.bin, except embed/lm_head, which reuse the target's
tensors when they are equal (DeepSpec stores frozen copies of them).
"""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from specrt import artifact as io
from specrt.model_config import ModelConfig
from specrt.model_config import DSparkConfig
from specrt.exporter.onnx.builder import PLUGIN_DOMAIN, GraphBuilder, onnx_dtype
from specrt.exporter.onnx.attention import (KeyBlock, Rope, attend, cache_block, check_lowering, project_heads,
                                            write_cache)
from specrt.exporter.onnx.layers import add_rms_norm, embedding, linear, mlp, rms_norm, rope_tables, rotate_half_matrix
from specrt.exporter.onnx.quant import is_stored
from specrt.exporter.onnx.sampling import greedy_draft, sample_draft

P = "dspark."  # weight-name prefix in the shared store
F32 = onnx_dtype("float32")


def dspark_weights(cfg: DSparkConfig, weights: dict[str, np.ndarray], target_weights: dict[str, np.ndarray],
                   vocab_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The tensors the draft graph reads: `dspark.`-prefixed DeepSpec tensors with k/v and gate/up stacked;
    embed/lm_head under the target's names when numerically equal to the target's (stored once).

    With a draft vocabulary (`vocab_ids`), markov_w2 keeps only those rows, and an own lm_head too; a head
    shared with the target gets its row subset from the exporter (`vocab_head_source`), in the target's form."""
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
        if own == "lm_head.weight" and vocab_ids is not None:
            if not same:
                out[P + own] = weights[own][vocab_ids]
            continue
        out[shared if same else P + own] = weights[own]
    if vocab_ids is not None and cfg.markov_rank:
        w2 = P + "markov_head.markov_w2.weight"
        out[w2] = out[w2][vocab_ids]
    return out


def vocab_head_source(out: dict[str, np.ndarray], target_cfg: ModelConfig) -> str | None:
    """The target tensor whose rows make a reduced-vocabulary DSpark's lm_head (None: it has its own)."""
    if P + "lm_head.weight" in out:
        return None
    return "model.embed_tokens.weight" if target_cfg.tie_word_embeddings else "lm_head.weight"


def _shared(g: GraphBuilder, own: str, target_name: str) -> str:
    """The draft's own copy when `dspark_weights` kept one, else the target's tensor."""
    mine = is_stored(g.store, P + own)
    return g.weight(P + own if mine else target_name)


# ctx_features[B,C,F] --fc--hidden_norm--> ctx[B*C,d] ------------------------------+ (every layer)
# [anchor, mask x (K-1)] --Gather(embed)--> x[B*K,d]   positions ctx_len + 0..K-1   |
#   layer i:  k/v(ctx) -k_norm-rope@ctx_positions-> ScatterElements(past, ctx_write_index + c) = present
#             q, k/v(norm(x)) -q/k_norm-rope-> softmax(q.[present (s < ctx_len) ; block K keys]) -> o_proj
#             x += attn ; x += mlp(norm(x))
# h = norm(x) --lm_head--> U[B,K,V]
# for k in 0..K-1 (unrolled): e = W1[prev_k] (prev_0 = anchor, prev_k = token_{k-1})
#   corrected_k = U_k + markov(e, h_k, state) --sample(T, noise_k)--> token_k, probs_k
# confidence = proj([h ; E]) + b


def build_dspark_graph(g: GraphBuilder, cfg: DSparkConfig, target_cfg: ModelConfig, *, max_seq: int,
                       dtype: str, attention: str = "standard", vocab_ids: np.ndarray | None = None,
                       greedy: bool = False) -> None:
    """Emit the whole DSpark draft graph into `g` over named axes B/C; its store must hold `dspark_weights(...)`.

    `greedy`: the variant for rounds where every slot decodes greedily: argmax drafts, no draft_logits or
    draft_probs (io.GREEDY_DROPS), nothing vocabulary-wide computed beyond the LM and Markov heads.

    `attention` is the target's lowering (`attention.LOWERINGS`). `vocab_ids`: a reduced draft vocabulary;
    the LM head is then the store's `dspark.lm_head.weight` (those rows), the Markov and sampling work spans
    len(vocab_ids) columns, and each sampled column is mapped back to its target token id."""
    check_lowering(attention)
    lc, K = cfg.layers, cfg.block_size
    cfg.check_target(target_cfg)
    inputs, outputs = dspark_signature(cfg, max_seq=max_seq, dtype=dtype,
                                       draft_vocab=len(vocab_ids) if vocab_ids is not None else 0)
    for t in inputs:
        g.input(t.name, t.dtype, t.shape)
    shape = {t.name: t.shape for t in outputs}
    feats, ctx_pos, write_index, ctx_len = io.CTX_FEATURES, io.CTX_POSITIONS, io.CTX_WRITE_INDEX, io.CTX_LEN
    anchor, temperature, noise = io.ANCHOR_IDS, io.TEMPERATURE, io.NOISE

    with g.scope("dspark"):
        ctx = _context(g, cfg, feats, dtype, attention)
        with g.scope("block"):
            ids = g.op("Where", g.const(np.arange(K).reshape(1, K) == 0, "is_anchor"),
                       g.op("Unsqueeze", anchor, g.const([1], "axis1", "int64")),
                       g.const(np.int64(cfg.mask_token_id), "mask_token"), name="block_ids")  # [B,K]
            x = embedding(g, _shared(g, "embed_tokens.weight", "model.embed_tokens.weight"), ids)
            x = g.op("Reshape", x, g.const([-1, lc.hidden_size], "flat", "int64"))  # [B*K, d]
            block_pos = g.op("Add", g.op("Unsqueeze", ctx_len, g.const([1], "axis1", "int64")),
                             g.const(np.arange(K, dtype=np.int64), "offsets"), name="positions")
            rope_block = rope_tables(g, block_pos, lc.inv_freq(), dtype)
        with g.scope("ctx"):
            rope_ctx = rope_tables(g, ctx_pos, lc.inv_freq(), dtype)
        rotate = g.const(rotate_half_matrix(lc.head_dim, dtype), "rotate_half")
        scatter_idx, bias, ctx_kv_shape, window = _cache_io(g, lc, ctx_pos, write_index, ctx_len, K, max_seq,
                                                            attention)
        presents = []
        for i in range(lc.num_layers):
            with g.scope(f"layers.{i}"):
                p = f"{P}layers.{i}"
                a = rms_norm(g, x, g.weight(f"{p}.input_layernorm.weight"), lc.rms_norm_eps, dtype,
                             name="input_layernorm", lowering=attention)
                o, pk, pv = _attention(g, a, ctx, f"{p}.self_attn", lc, K, io.past_names(i), (*rope_block, rotate),
                                       (*rope_ctx, rotate), scatter_idx, bias, ctx_kv_shape, dtype, window, attention)
                x, m = add_rms_norm(g, x, o, g.weight(f"{p}.post_attention_layernorm.weight"), lc.rms_norm_eps, dtype,
                                    name="post_attention_layernorm", residual="attn_residual", lowering=attention)
                x = g.op("Add", x, mlp(g, m, f"{p}.mlp", lc.intermediate_size), name="mlp_residual")
            presents.append((pk, pv))
        h = rms_norm(g, x, g.weight(P + "norm.weight"), lc.rms_norm_eps, dtype, name="norm", lowering=attention)
        head = "lm_head.weight" if not target_cfg.tie_word_embeddings else "model.embed_tokens.weight"
        base = linear(g, h, _shared(g, "lm_head.weight", head), name="lm_head")  # [B*K, V or len(vocab_ids)]
        ids = g.const(np.asarray(vocab_ids, np.int64), "vocab_ids") if vocab_ids is not None else None
        tokens, logits, probs, conf, first = _draft_heads(g, cfg, base, h, anchor, temperature, noise, dtype, ids,
                                                          len(vocab_ids) if vocab_ids is not None else lc.vocab_size,
                                                          greedy)

    named = {io.DRAFT_TOKENS: tokens, io.DRAFT_LOGITS: logits, io.DRAFT_PROBS: probs, io.CONFIDENCE_LOGITS: conf,
             io.DRAFT_FIRST_TOP: first[0], io.DRAFT_FIRST_PROBS: first[1]}
    if conf is not None:
        with g.scope("dspark"):
            named[io.SURVIVAL], named[io.VERIFY_LENGTHS] = _truncate(g, cfg, conf, dtype)
    named.update({n: v for i, kv in enumerate(presents) for n, v in zip(io.present_names(i), kv)})
    for t in outputs:
        if not (greedy and t.name in io.GREEDY_DROPS):
            g.output(named[t.name], t.name, t.dtype, t.shape)


def dspark_signature(cfg: DSparkConfig, *, max_seq: int, dtype: str, draft_vocab: int = 0
                     ) -> tuple[tuple[io.TensorSpec, ...], tuple[io.TensorSpec, ...]]:
    """`io.dspark_signature` for this checkpoint's config."""
    lc = cfg.layers
    return io.dspark_signature(num_layers=lc.num_layers, num_kv_heads=lc.num_kv_heads, head_dim=lc.head_dim,
                               hidden_size=lc.hidden_size, vocab_size=lc.vocab_size,
                               num_features=len(cfg.target_layer_ids), block=cfg.block_size, max_seq=max_seq,
                               dtype=dtype, confidence=cfg.enable_confidence_head, draft_vocab=draft_vocab)


def _context(g: GraphBuilder, cfg: DSparkConfig, feats: str, dtype: str, lowering: str) -> str:
    """ctx = hidden_norm(fc(features)) [B*C, d], in fp32 whatever the graph dtype (fp16 overflows here)."""
    with g.scope("context"):
        x = g.op("Reshape", feats, g.const([-1, cfg.feature_dim], "flat", "int64"))
        w, nw = g.weight(P + "fc.weight"), g.weight(P + "hidden_norm.weight")
        if dtype != "float32":
            x, w, nw = (g.op("Cast", t, to=F32) for t in (x, w, nw))
        ctx = rms_norm(g, linear(g, x, w, name="fc"), nw, cfg.layers.rms_norm_eps, "float32", name="hidden_norm",
                       lowering=lowering)
        return g.op("Cast", ctx, to=onnx_dtype(dtype)) if dtype != "float32" else ctx


def _cache_io(g: GraphBuilder, lc: ModelConfig, ctx_pos: str, write_index: str, ctx_len: str, K: int,
              max_seq: int, lowering: str) -> tuple[str, str, str, int | str]:
    """Scatter indices [B,Hkv,C,D] for the context K/V, bias [B,1,1,1,L+K] over [cache ; block], ctx K/V shape,
    and the cache window L: S, or in the cpu lowering a [1] i64 tensor, max(ctx_len) clamped to [1, S]."""
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
        # Cache slot s is visible iff s < ctx_len[b]; the K block keys (appended after the cache) always are.
        if lowering == "cpu":  # the keys past max(ctx_len) are masked for every row: cut the cache there
            longest = g.op("ReduceMax", ctx_len, keepdims=1, name="longest_context")  # [1]
            window = g.op("Min", g.op("Max", longest, g.const([1], "non_empty", "int64")),
                          g.const([max_seq], "cache_size", "int64"), name="cache_window")  # [1]
            end = g.op("Add", window, g.const([K], "block_size", "int64"), name="keys_end")
            keys = g.op("Unsqueeze", g.op("Range", g.const(np.int64(0), "first_key", "int64"),
                                          g.op("Squeeze", end, g.const([0], "axis0", "int64")),
                                          g.const(np.int64(1), "key_step", "int64")),
                        g.const([0], "axis0_u", "int64"), name="key_index")  # [1, L+K]
            in_ctx = g.op("Less", keys, g.op("Unsqueeze", ctx_len, g.const([1], "axis1", "int64")))
            visible = g.op("Or", in_ctx, g.op("GreaterOrEqual", keys, window, name="is_block"))
        else:
            window = max_seq
            keys = g.const(np.arange(max_seq + K, dtype=np.int64).reshape(1, -1), "key_index")
            in_ctx = g.op("Less", keys, g.op("Unsqueeze", ctx_len, g.const([1], "axis1", "int64")))
            visible = g.op("Or", in_ctx, g.const((np.arange(max_seq + K) >= max_seq).reshape(1, -1), "is_block"))
        neg = np.finfo(np.float32).min / 2  # finite: no NaN even with an empty context
        bias = g.op("Where", visible, g.const(np.float32(0.0), "zero_f"), g.const(np.float32(neg), "neg_f"))
        bias = g.op("Unsqueeze", bias, g.const([1, 2, 3], "axes123", "int64"), name="attention_bias")
    return scatter_idx, bias, kv_shape, window


def _attention(g: GraphBuilder, a: str, ctx: str, p: str, lc: ModelConfig, K: int, cache: tuple[str, str],
               rope_block: Rope, rope_ctx: Rope, scatter_idx: str, bias: str, ctx_kv_shape: str, dtype: str,
               window: int | str, lowering: str) -> tuple[str, str, str]:
    """Block queries over [cache (after writing the context rows' K/V) ; the block's own K/V]; (o, present k/v).

    Context rows need only k/v, so q is projected for the block alone; Qwen3's k_norm also applies to them.
    """
    with g.scope("attn"):
        H, Hkv, D = lc.num_heads, lc.num_kv_heads, lc.head_dim
        q, = project_heads(g, a, p, "q", g.const([-1, K, H, D], "q_shape", "int64"), lc, rope_block, dtype,
                           lowering=lowering)
        kb, vb = project_heads(g, a, p, "kv", g.const([-1, K, 2 * Hkv, D], "kv_shape", "int64"), lc, rope_block,
                               dtype, lowering=lowering)
        with g.scope("ctx"):
            kc, vc = project_heads(g, ctx, p, "kv", ctx_kv_shape, lc, rope_ctx, dtype, lowering=lowering)
        present_k, present_v = write_cache(g, cache, scatter_idx, kc, vc)
        blocks = [cache_block(g, present_k, present_v, window), KeyBlock("block", kb, vb, K)]
        o = attend(g, q, blocks, bias, f"{p}.o_proj", lc, dtype)
    return o, present_k, present_v


def _draft_heads(g: GraphBuilder, cfg: DSparkConfig, base: str, h: str, anchor: str, temperature: str, noise: str,
                 dtype: str, ids: str | None, V: int, greedy: bool = False
                 ) -> tuple[str, str | None, str | None, str | None, tuple[str, str]]:
    """Markov loop unrolled over the K slots with in-graph sampling, then the confidence head. V columns: the
    vocabulary, or the draft vocabulary `ids` (a [V] constant mapping a sampled column to its token id).
    `greedy`: argmax drafts only (logits and probs None). Also the first slot's io.FIRST_TOP likeliest tokens and
    their probabilities at temperature 1 (`_first_top`)."""
    lc, K, r = cfg.layers, cfg.block_size, cfg.markov_rank
    d = lc.hidden_size
    to_id = (lambda col: g.op("Gather", ids, col, name="token_id")) if ids is not None else (lambda col: col)
    with g.scope("heads"):
        base3 = g.op("Reshape", base, g.const([-1, K, V], "bkv", "int64"))
        h3 = g.op("Reshape", h, g.const([-1, K, d], "bkd", "int64"))
        first = None
        if not r:  # no Markov correction: the first slot's logits are its base logits
            first = _first_top(g, g.op("Gather", base3, g.const(np.int64(0), "k0"), axis=1), V, dtype, to_id)
        if not r and greedy:
            tokens, logits, probs, embs = to_id(greedy_draft(g, base3, dtype)), None, None, None
        elif not r:  # DFlash: no sequential dependency, all K slots sampled at once
            tokens, probs = sample_draft(g, base3, g.op("Unsqueeze", temperature, g.const([1, 2], "ax12", "int64")),
                                         g.op("Unsqueeze", noise, g.const([2], "ax2", "int64")), V, dtype)
            tokens = to_id(tokens)
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
                    e = embedding(g, g.weight(P + "markov_head.markov_w1.weight"), prev, name="markov_w1")
                    corrected, state = _markov_step(g, cfg, u, e, hk, state, dtype)
                    if k == 0:
                        first = _first_top(g, corrected, V, dtype, to_id)
                    if greedy:
                        col, pk = greedy_draft(g, corrected, dtype), None
                    else:
                        nz = g.op("Slice", noise, g.const([k], "k0", "int64"), g.const([k + 1], "k1", "int64"),
                                  g.const([1], "ax", "int64"))  # [B,1]
                        col, pk = sample_draft(g, corrected, t_col, nz, V, dtype)
                    prev = to_id(col)  # prev_{k+1} = token_k
                    ax1 = g.const([1], "ax1", "int64")
                    for key, val in (("tok", prev), ("logits", corrected), ("probs", pk), ("emb", e)):
                        if val is not None and not (greedy and key == "logits"):
                            cols[key].append(g.op("Unsqueeze", val, ax1, name=f"stack_{key}"))
            tokens, logits, probs, embs = (g.op("Concat", *cols[key], axis=1, name=key) if cols[key] else None
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
    return tokens, logits, probs, conf, first


def _first_top(g: GraphBuilder, logits: str, V: int, dtype: str, to_id) -> tuple[str, str]:
    """(ids [B, A], probabilities [B, A] f32): the A = io.FIRST_TOP likeliest tokens of one slot's logits [B, V] under
    softmax at temperature 1, best first (ties: the lower column, as TopK orders them)."""
    with g.scope("first_top"):
        lf = g.op("Cast", logits, to=1) if dtype != "float32" else logits  # 1: FLOAT
        probs = g.op("Softmax", lf, axis=-1, name="probs")
        values, cols = g.op("TopK", probs, g.const([min(io.FIRST_TOP, V)], "a", "int64"), axis=-1, largest=1,
                            sorted=1, outputs=2, name="top")
        return to_id(cols), values


def _truncate(g: GraphBuilder, cfg: DSparkConfig, conf: str, dtype: str) -> tuple[str, str]:
    """specrt::ConfidenceTruncate on the confidence logits with the head's STS temperatures (1 if uncalibrated)."""
    from specrt.plugins.confidence_truncate import OP

    temps = np.asarray(cfg.confidence_temperatures or [1.0] * cfg.block_size, np.float32)
    logits = g.op("Cast", conf, to=F32) if dtype != "float32" else conf
    survival, lengths = g.op(OP, logits, g.const(temps, "sts_temperatures"), io.TRUNCATE_THRESHOLD,
                             io.TRUNCATE_BUDGET, name="confidence_truncate", domain=PLUGIN_DOMAIN, outputs=2,
                             plugin_namespace=PLUGIN_DOMAIN, plugin_version="1")
    return survival, lengths


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
