"""The MTP draft graph: C context rows through the MTP block, then G chained draft steps, sampled in-graph.

Weights live under `mtp.` (q/k/v and gate/up stacked like the target's); the embedding and head reuse the
target's tensor names when the checkpoint aliases them or stores equal copies, so weights.bin holds them once.
"""
from __future__ import annotations

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.model_config import EMBED, HEAD, MTPConfig
from specrt.exporter.onnx.attention import check_lowering
from specrt.exporter.onnx.builder import GraphBuilder
from specrt.exporter.onnx.layers import Shapes, embedding, linear, rms_norm, rope_tables, rotate_half_matrix
from specrt.exporter.onnx.quant import is_stored
from specrt.exporter.onnx.sampling import greedy_draft, sample_draft
from specrt.exporter.onnx.target import decoder_layer, input_shapes, slot_io, stack_layer_weights

PREFIX = "mtp"
OWN_EMBED, OWN_HEAD = f"{PREFIX}.{EMBED}", f"{PREFIX}.{HEAD}"
TARGET_EMBED = "model.embed_tokens.weight"


def target_head(target: ModelConfig) -> str:
    return TARGET_EMBED if target.tie_word_embeddings else "lm_head.weight"


def mtp_weights(cfg: MTPConfig, weights: dict[str, np.ndarray], target_weights: dict[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
    """Graph tensors: `mtp.*` (stacked), plus embed/head under the target's names unless truly own."""
    out = {f"{PREFIX}.{k}": v for k, v in weights.items() if k not in (EMBED, HEAD)}
    stack_layer_weights(out, PREFIX, cfg.layer)
    for own, name, target_name in ((cfg.has_own_embed, EMBED, TARGET_EMBED),
                                   (cfg.has_own_head, HEAD, target_head(cfg.layer))):
        t = target_weights[target_name]
        if own and not (weights[name].shape == t.shape and np.array_equal(weights[name], t)):
            out[f"{PREFIX}.{name}"] = weights[name]
        else:  # aliased: the graph reads the target's tensor (a no-op add when the target put it there)
            out[target_name] = t
    return out


def _fuse(g: GraphBuilder, ids: str, hidden: str, embed_w: str, cfg: ModelConfig, dtype: str, lowering: str) -> str:
    """eh_proj([enorm(emb(ids)) ; hnorm(hidden)]) as [N,d]: the embedding comes first (vLLM / SGLang order)."""
    e = rms_norm(g, embedding(g, g.weight(embed_w), ids), g.weight(f"{PREFIX}.enorm.weight"),
                 cfg.rms_norm_eps, dtype, name="enorm", lowering=lowering)
    hh = rms_norm(g, hidden, g.weight(f"{PREFIX}.hnorm.weight"), cfg.rms_norm_eps, dtype, name="hnorm",
                  lowering=lowering)
    u = g.op("Reshape", g.op("Concat", e, hh, axis=-1), g.const([-1, 2 * cfg.hidden_size], "flat", "int64"))
    return linear(g, u, g.weight(f"{PREFIX}.eh_proj.weight"), name="eh_proj")


def _head(g: GraphBuilder, h: str, head_w: str, cfg: ModelConfig, dtype: str, lowering: str) -> tuple[str, str]:
    """(shared_head.norm(h), logits) for h [B,d]."""
    normed = rms_norm(g, h, g.weight(f"{PREFIX}.shared_head.norm.weight"), cfg.rms_norm_eps, dtype,
                      name="shared_head_norm", lowering=lowering)
    return normed, linear(g, normed, g.weight(head_w), name="head")


# tokens[B,C] ─Gather(embed)─ enorm ─┐
# hidden[B,C,d] ──────────── hnorm ─┴─ Concat ─ eh_proj ─ decoder layer ─ x[B*C,d] ─ row last_row[b] ─ h'_1
#                                     (past.0; slot = position, causal: s <= t; rope at t)
# step 1:  h'_1 ─ shared_head.norm ─ head ─ logits_1 ─ sample(temperature, noise[:,0]) ─ tok_1
# step k:  (tok_{k-1}, h'_{k-1} pre|post norm) at position P+k-1 ─ same block over the updated cache ─ ...
# outputs: Concat over k ─ draft_tokens[B,G], draft_logits[B,G,V], draft_probs[B,G,V]; present.0.*
def build_mtp_graph(g: GraphBuilder, cfg: MTPConfig, target_cfg: ModelConfig, *, steps: int, max_seq: int,
                    dtype: str, feedback: str = "post", attention: str = "standard",
                    vocab_ids: np.ndarray | None = None, greedy: bool = False) -> None:
    """Emit the MTP draft graph into `g` with exactly `io.mtp_signature`'s inputs and outputs (axes B/C).

    Add `mtp_weights(...)` to `g.store` first: which embedding / head tensor names exist there picks them.
    `attention` is the target's lowering (`attention.LOWERINGS`). `vocab_ids`: a reduced draft vocabulary
    (FR-Spec); the head (stored as OWN_HEAD: those rows) scores len(vocab_ids) columns, and each sampled
    column is mapped back to its target token id before it is fed to the next step. `greedy`: the variant for
    rounds where every slot decodes greedily (argmax drafts; no draft_logits / draft_probs, io.GREEDY_DROPS)."""
    check_lowering(attention)
    if feedback not in ("post", "pre"):
        raise SpecrtError(f"MTP feedback must be 'post' or 'pre', got {feedback!r}")
    if steps < 1:
        raise SpecrtError(f"MTP graph needs steps >= 1, got {steps}")
    c, d, V = cfg.layer, target_cfg.hidden_size, target_cfg.vocab_size
    stored = lambda name: is_stored(g.store, name)  # noqa: E731
    embed_w = OWN_EMBED if stored(OWN_EMBED) else TARGET_EMBED  # mtp_weights decided the names
    head_w = OWN_HEAD if stored(OWN_HEAD) else target_head(target_cfg)
    n_vocab = len(vocab_ids) if vocab_ids is not None else 0
    if n_vocab and head_w != OWN_HEAD:
        raise SpecrtError("an MTP draft vocabulary needs its head rows stored as " + OWN_HEAD)
    inputs, outputs = io.mtp_signature(num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=d,
                                       vocab_size=V, steps=steps, max_seq=max_seq, dtype=dtype, draft_vocab=n_vocab)
    for t in inputs:
        g.input(t.name, t.dtype, t.shape)
    tokens, hidden, positions = io.MTP_TOKENS, io.MTP_HIDDEN, io.MTP_POSITIONS
    last_row, temperature, noise = io.MTP_LAST_ROW, io.TEMPERATURE, io.NOISE
    cache = io.past_names(0)

    def block(x: str, pos: str, shapes: Shapes, cache: tuple[str, str]) -> tuple[str, str, str]:
        rope = (*rope_tables(g, pos, c.inv_freq(), dtype), rotate)
        with g.scope("slot_io"):
            scatter_idx, bias, window = slot_io(g, shapes, pos, c, max_seq, lowering=attention)
        return decoder_layer(g, x, PREFIX, cache, c, shapes, rope, scatter_idx, bias, dtype, window,
                             lowering=attention)

    with g.scope("mtp"):
        shapes = input_shapes(g, tokens, c)
        rotate = g.const(rotate_half_matrix(c.head_dim, dtype), "rotate_half")
        t_col = g.op("Unsqueeze", temperature, g.const([1], "axis1", "int64"), name="temperature_col")  # [B,1]
        last = g.op("Unsqueeze", last_row, g.const([1], "axis1", "int64"))  # [B,1]
        with g.scope("rows"):
            # padding rows (c > last_row) continue the positions after the last row: their writes land
            # in slots the chain or a later call overwrites before any query reads them
            n_rows = g.op("Squeeze", shapes.tokens, g.const([0], "a0", "int64"))
            cols = g.op("Range", g.const(0, "zero", "int64"), n_rows, g.const(1, "one", "int64"))  # [C]
            p_last = g.op("GatherElements", positions, last, axis=1, name="last_position")  # [B,1]
            shifted = g.op("Add", p_last, g.op("Sub", cols, last))
            pos = g.op("Where", g.op("LessOrEqual", cols, last), positions, shifted, name="row_positions")
            x, pk, pv = block(_fuse(g, tokens, hidden, embed_w, c, dtype, attention), pos, shapes, cache)
            x3 = g.op("Reshape", x, g.op("Concat", shapes.batch, shapes.tokens, g.const([d], "d", "int64"), axis=0))
            idx = g.op("Expand", g.op("Unsqueeze", last, g.const([2], "axis2", "int64")),
                       g.op("Concat", shapes.batch, g.const([1, d], "one_d", "int64"), axis=0))
            h = g.op("Reshape", g.op("GatherElements", x3, idx, axis=1, name="pick_last_row"),
                     g.const([-1, d], "bd", "int64"))  # h'_1 [B,d]
        one_row = Shapes(batch=shapes.batch, tokens=g.const([1], "one_token", "int64"),
                         qkv=g.op("Concat", shapes.batch, g.const([1, c.num_heads + 2 * c.num_kv_heads, c.head_dim],
                                                                  "qkv_1", "int64"), axis=0, name="qkv_shape_1"))
        ids = g.const(np.asarray(vocab_ids, np.int64), "vocab_ids") if n_vocab else None
        toks, logits_all, probs_all = [], [], []
        for k in range(1, steps + 1):
            with g.scope(f"step.{k}"):
                if k > 1:  # one row: previous draft token, fed-back hidden, position P + k - 1
                    pos_k = g.op("Add", p_last, g.const([[k - 1]], "offset", "int64"), name="position")
                    h, pk, pv = block(_fuse(g, tok, fed, embed_w, c, dtype, attention), pos_k, one_row, (pk, pv))
                normed, logits = _head(g, h, head_w, c, dtype, attention)
                if greedy:
                    tok = greedy_draft(g, logits, dtype)
                else:
                    noise_k = g.op("Slice", noise, g.const([k - 1], "start", "int64"),
                                   g.const([k], "stop", "int64"), g.const([1], "axes", "int64"), name="noise_k")
                    tok, probs = sample_draft(g, logits, t_col, noise_k, n_vocab or V, dtype)
                if ids is not None:  # a draft-vocabulary column -> its target token id
                    tok = g.op("Gather", ids, tok, axis=0, name="token_id")
                fed = normed if feedback == "post" else h
                toks.append(g.op("Unsqueeze", tok, g.const([1], "axis1", "int64")))
                if not greedy:
                    logits_all.append(g.op("Unsqueeze", logits, g.const([1], "axis1", "int64")))
                    probs_all.append(g.op("Unsqueeze", probs, g.const([1], "axis1", "int64")))
        with g.scope("outputs"):
            outs = [(g.op("Concat", *v, axis=1, name=n) if len(v) > 1 else g.op("Identity", v[0], name=n)) if v
                    else None for v, n in ((toks, "tokens"), (logits_all, "logits"), (probs_all, "probs"))]
    named = dict(zip((io.DRAFT_TOKENS, io.DRAFT_LOGITS, io.DRAFT_PROBS, *io.present_names(0)), (*outs, pk, pv)))
    for t in outputs:
        if not (greedy and t.name in io.GREEDY_DROPS):
            g.output(named[t.name], t.name, t.dtype, t.shape)
