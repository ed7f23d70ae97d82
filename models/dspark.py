"""DSpark draft head (DeepSpec layout) as small torch modules: the numerical reference of the ONNX graph.

Parameter names are DeepSpec's (reference/deepspec-dspark.md §1.2, no `model.` prefix), so a checkpoint
loads as it is. Like the target (models/llama.py), the draft keeps a static cache [B, Hkv, S_MAX, D] per
layer holding only context K/V: one call writes C context rows at ctx_write_index[b] + c and drafts a
block for the anchor at position ctx_len[b]; the block's own K/V never enter the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specrt.errors import SpecrtError
from specrt.model_config import DSparkConfig
from specrt.models.llama import MLP, apply_rope, rope_cos_sin, Attention, KVCache, RMSNorm
from specrt.models.sampling import sample_draft


class DraftAttention(Attention):
    """Block queries over [cached context K/V (s < ctx_len) ; the block's own K/V], no causal mask."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__(cfg.layers)  # the projections of the family's attention (Qwen3: k_norm on context keys too)

    def _kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        return k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]

    def forward(self, x: Tensor, ctx: Tensor, rope_block: tuple[Tensor, Tensor], rope_ctx: tuple[Tensor, Tensor],
                write_index: Tensor, visible: Tensor) -> Tensor:
        b, t, _ = x.shape
        hkv, d = self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, self.num_heads, d)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), *rope_block)
        kb, vb = self._kv(x)
        kc, vc = self._kv(ctx)
        kc = apply_rope(kc, *rope_ctx)
        keys, values = self._write(write_index, kc, vc)
        keys = torch.cat([keys, apply_rope(kb, *rope_block)], dim=2)  # [B, Hkv, S + K, D]
        values = torch.cat([values, vb], dim=2)
        qg = q.reshape(b, hkv, -1, d)  # query head h = j*g + i reads kv head j (HF repeat_kv order)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * d ** -0.5
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values).view(b, self.num_heads, t, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * d))

    def forward_train(self, x: Tensor, ctx: Tensor, rope_block: tuple[Tensor, Tensor],
                      rope_ctx: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """Training path, no cache: queries x [B,Q,d] over keys [ctx (C) ; x (Q)] under a bool mask [B,Q,C+Q]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), *rope_block)
        kb, vb = self._kv(x)
        kc, vc = self._kv(ctx)
        keys = torch.cat([apply_rope(kc, *rope_ctx), apply_rope(kb, *rope_block)], dim=2)
        values = torch.cat([vc, vb], dim=2)
        # enable_gqa: query head h reads kv head h // g, the HF repeat_kv order of the eval path
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def _write(self, write_index: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Scatter context K/V [B,Hkv,C,D] to slots write_index[b] + c (clamped to S-1, like the graph)."""
        if self.kv_cache is None:
            raise SpecrtError("call DSparkDraft.setup_caches(batch, max_seq) before forward")
        return self.kv_cache.update(write_index, k, v)


class DraftLayer(nn.Module):
    """Pre-norm block whose attention also reads the context K/V; the context itself is never updated."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.layers)
        self.input_layernorm = RMSNorm(cfg.layers.hidden_size, cfg.layers.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.layers.hidden_size, cfg.layers.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_block: tuple[Tensor, Tensor], rope_ctx: tuple[Tensor, Tensor],
                write_index: Tensor, visible: Tensor) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), ctx, rope_block, rope_ctx, write_index, visible)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_train(self, x: Tensor, ctx: Tensor, rope_block: tuple[Tensor, Tensor],
                      rope_ctx: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        h = x + self.self_attn.forward_train(self.input_layernorm(x), ctx, rope_block, rope_ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """Low-rank bias from the previous token (§1.7): vanilla W2·W1[prev], gated, or rnn."""

    def __init__(self, cfg: DSparkConfig, draft_vocab: int | None = None) -> None:
        super().__init__()
        v, d, r = cfg.layers.vocab_size, cfg.layers.hidden_size, cfg.markov_rank
        self.kind, self.rank = cfg.markov_head_type, r
        self.markov_w1 = nn.Embedding(v, r)  # indexed by target token ids, whatever the draft vocabulary
        self.markov_w2 = nn.Linear(r, draft_vocab or v, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def step(self, base: Tensor, prev_emb: Tensor, h: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """Corrected logits [B,V] of one slot from base [B,V], W1[prev] [B,r], h_k [B,d]; also the new rnn state."""
        if self.kind == "vanilla":
            return base + self.markov_w2(prev_emb), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([h, prev_emb], dim=-1)))
            return base + self.markov_w2(gate * prev_emb), state
        gate, cand, out = self.joint_proj(torch.cat([state, prev_emb, h], dim=-1)).split(self.rank, dim=-1)
        g = torch.sigmoid(gate)
        return base + self.markov_w2(torch.tanh(out)), g * state + (1 - g) * torch.tanh(cand)

    def features(self, prev_emb: Tensor, h: Tensor) -> Tensor:
        """Teacher-forced training path: what W2 maps to the bias, [..., K, r] from W1[prev] [..., K, r], h [..., K, d].

        Same math as `step` (logits_k = U_k + W2 · features_k); the rnn state is unrolled over K.
        """
        if self.kind == "vanilla":
            return prev_emb
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, prev_emb], dim=-1))) * prev_emb
        state, outs = prev_emb.new_zeros(prev_emb[..., 0, :].shape), []
        for i in range(prev_emb.shape[-2]):
            gate, cand, out = self.joint_proj(torch.cat([state, prev_emb[..., i, :], h[..., i, :]], -1)).split(
                self.rank, dim=-1)
            g = torch.sigmoid(gate)
            outs.append(torch.tanh(out))
            state = g * state + (1 - g) * torch.tanh(cand)
        return torch.stack(outs, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)


@dataclass
class DraftOutput:
    """One draft call: tokens [B,K], corrected logits [B,K,V], probs [B,K,V] f32, base logits, confidences [B,K]."""

    tokens: Tensor
    logits: Tensor
    probs: Tensor
    base_logits: Tensor
    confidence_logits: Tensor | None


class DSparkDraft(nn.Module):
    """The DSpark / DFlash draft: fc + hidden_norm context, draft layers, norm, lm_head, Markov + confidence heads."""

    def __init__(self, cfg: DSparkConfig, vocab_ids: np.ndarray | None = None) -> None:
        """`vocab_ids`: a reduced draft vocabulary (FR-Spec, exporter/vocab.py): the LM head and the Markov
        head's W2 score only these target tokens, and drafts are mapped back to target ids."""
        super().__init__()
        c = self.config = cfg
        d, v = c.layers.hidden_size, c.layers.vocab_size
        n = len(vocab_ids) if vocab_ids is not None else None
        self.register_buffer("vocab_ids", None if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long),
                             persistent=False)
        self.embed_tokens = nn.Embedding(v, d)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(c.layers.num_layers))
        self.norm = RMSNorm(d, c.layers.rms_norm_eps)
        self.fc = nn.Linear(c.feature_dim, d, bias=False)
        self.hidden_norm = RMSNorm(d, c.layers.rms_norm_eps)
        self.lm_head = nn.Linear(d, n or v, bias=False)
        self.markov_head = MarkovHead(cfg, n) if c.markov_rank else None
        self.confidence_head = ConfidenceHead(d + (c.markov_rank if c.confidence_head_with_markov else 0)) \
            if c.enable_confidence_head else None
        self.register_buffer("inv_freq", torch.tensor(c.layers.inv_freq(), dtype=torch.float32), persistent=False)
        self.max_seq = 0

    @classmethod
    def from_weights(cls, cfg: DSparkConfig, weights: dict[str, np.ndarray],
                     dtype: torch.dtype = torch.float32, vocab_ids: np.ndarray | None = None) -> "DSparkDraft":
        """Build and load from DeepSpec-named numpy weights (strict); lm_head and markov_w2 hold only the
        `vocab_ids` rows when a draft vocabulary is given."""
        model = cls(cfg, vocab_ids)
        state = {k: torch.from_numpy(np.ascontiguousarray(w)) for k, w in weights.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise SpecrtError(f"weights do not match the draft: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(dtype).eval()

    def setup_caches(self, batch: int, max_seq: int) -> None:
        """Allocate every layer's context K/V cache [batch, Hkv, max_seq, D] once."""
        c, w = self.config.layers, self.lm_head.weight
        self.max_seq = max_seq
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(batch, c.num_kv_heads, max_seq, c.head_dim, w.dtype, w.device)

    def forward(self, ctx_features: Tensor, ctx_positions: Tensor, ctx_write_index: Tensor, ctx_len: Tensor,
                anchor_ids: Tensor, temperature: Tensor | None = None, noise: Tensor | None = None) -> DraftOutput:
        """Write C context rows into the cache, then draft K tokens for the anchor at position ctx_len (artifact.py)."""
        cfg, (b, k) = self.config, (anchor_ids.shape[0], self.config.block_size)
        dev = anchor_ids.device
        ctx = self.hidden_norm(self.fc(ctx_features))  # used unchanged by every layer
        ids = torch.full((b, k), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor_ids
        x = self.embed_tokens(ids)
        rope_block = rope_cos_sin(self.inv_freq, ctx_len.view(b, 1) + torch.arange(k, device=dev), x.dtype)
        rope_ctx = rope_cos_sin(self.inv_freq, ctx_positions, x.dtype)
        # cache slot s is visible iff s < ctx_len[b]; the K block slots always are (non-causal block)
        visible = torch.cat([torch.arange(self.max_seq, device=dev).view(1, -1) < ctx_len.view(b, 1),
                             torch.ones(b, k, dtype=torch.bool, device=dev)], dim=1)
        for layer in self.layers:
            x = layer(x, ctx, rope_block, rope_ctx, ctx_write_index, visible)
        h = self.norm(x)
        base = self.lm_head(h)
        temperature = torch.zeros(b, device=dev) if temperature is None else temperature
        noise = torch.zeros(b, k, device=dev) if noise is None else noise
        return self.sample_block(base, h, anchor_ids, temperature, noise)

    def sample_block(self, base: Tensor, h: Tensor, anchor_ids: Tensor, temperature: Tensor,
                     noise: Tensor) -> DraftOutput:
        """Left-to-right over the K slots: Markov-correct, sample, feed the token back as prev (prev_0 = anchor)."""
        mk, b, k = self.markov_head, base.shape[0], base.shape[1]
        prev, tokens, logits, probs, prev_embs = anchor_ids, [], [], [], []
        state = h.new_zeros(b, mk.rank) if mk is not None else None
        for i in range(k):
            corrected = base[:, i]
            if mk is not None:
                prev_emb = mk.markov_w1(prev)
                corrected, state = mk.step(corrected, prev_emb, h[:, i], state)
                prev_embs.append(prev_emb)
            prev, p = sample_draft(corrected, temperature, noise[:, i])
            if self.vocab_ids is not None:  # an index into the draft vocabulary -> the target's token id
                prev = self.vocab_ids[prev]
            tokens.append(prev), logits.append(corrected), probs.append(p)
        conf = None
        if self.confidence_head is not None:
            feats = torch.cat([h, torch.stack(prev_embs, 1)], -1) if self.config.confidence_head_with_markov else h
            conf = self.confidence_head.proj(feats).squeeze(-1)
        return DraftOutput(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(probs, 1), base, conf)

    # -- training (teacher forcing, distill/train_dspark.py) ----------------------------------------------

    def forward_train(self, ctx_features: Tensor, anchors: Tensor, anchor_ids: Tensor) -> Tensor:
        """Final-normed h [B,N,K,d] for N anchors per sequence at once (DeepSpec's training pattern, §1.5).

        ctx_features [B,C,F] are the target features of positions 0..C-1. Block j = [anchor_ids[:,j], M×(K-1)] at
        positions anchors[:,j]+k sees context positions < anchors[:,j] and every slot of its own block, nothing else.
        """
        (b, n), k, dev = anchors.shape, self.config.block_size, anchors.device
        ctx = self.hidden_norm(self.fc(ctx_features))  # [B,C,d], used unchanged by every layer
        ids = torch.full((b, n, k), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[..., 0] = anchor_ids
        x = self.embed_tokens(ids).view(b, n * k, -1)
        q_pos = (anchors.unsqueeze(-1) + torch.arange(k, device=dev)).view(b, n * k)
        ctx_pos = torch.arange(ctx.shape[1], device=dev)
        rope_block = rope_cos_sin(self.inv_freq, q_pos, x.dtype)
        rope_ctx = rope_cos_sin(self.inv_freq, ctx_pos.expand(b, -1), x.dtype)
        # dense mask [B, N*K, C + N*K]: context s < anchor_j, and block-diagonal over the N blocks
        ctx_visible = ctx_pos.view(1, 1, -1) < anchors.repeat_interleave(k, dim=1).unsqueeze(-1)
        block_of = torch.arange(n, device=dev).repeat_interleave(k)
        own_block = (block_of.view(-1, 1) == block_of.view(1, -1)).expand(b, -1, -1)
        mask = torch.cat([ctx_visible, own_block], dim=-1)
        for layer in self.layers:
            x = layer.forward_train(x, ctx, rope_block, rope_ctx, mask)
        return self.norm(x).view(b, n, k, -1)

    def confidence_logits(self, h: Tensor, prev_emb: Tensor | None) -> Tensor:
        """Confidence logits [...] from h [..., d] and W1[prev] [..., r] (§1.8), as in `sample_block`."""
        feats = torch.cat([h, prev_emb], -1) if self.config.confidence_head_with_markov else h
        return self.confidence_head.proj(feats).squeeze(-1)
