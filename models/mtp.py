"""DeepSeek-style MTP head as a torch module (the numerical reference for the MTP draft graph).

One step, with h_t the target's final-normed hidden at position t and x_{t+1} the next token:
    h' = block(eh_proj([enorm(emb(x_{t+1})) ; hnorm(h_t)]))    (embedding first, as vLLM / SGLang)
    logits = head(shared_head.norm(h'))                          (predicts the token at t+2)
`block` is one decoder layer of the target's family over its own static KV cache (slot = position),
with rope at t. Steps k >= 2 feed back the previous draft token and h' ("pre": before
shared_head.norm, as vLLM) or shared_head.norm(h') ("post": SGLang / Megatron, the default).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specrt.errors import SpecrtError
from specrt.model_config import EMBED, HEAD, MTPConfig
from specrt.models.llama import apply_rope, rope_cos_sin, DecoderLayer, KVCache, RMSNorm
from specrt.models.sampling import sample_draft

FEEDBACK = ("post", "pre")


@dataclass
class MTPDraft:
    tokens: Tensor  # [B,G] i64
    logits: Tensor  # [B,G,V]
    probs: Tensor  # [B,G,V] f32: the distribution each token was drawn from


class SlotKVCache(KVCache):
    """KVCache whose `update` takes explicit cache slots [B,T] (MTP rows carry their own positions)."""

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        b, h, t, d = k.shape
        idx = slots.view(b, 1, t, 1).expand(b, h, t, d)
        self.k_cache.scatter_(2, idx, k.to(self.k_cache.dtype))
        self.v_cache.scatter_(2, idx, v.to(self.v_cache.dtype))
        return self.k_cache, self.v_cache


class SharedHead(nn.Module):
    def __init__(self, d: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.head = nn.Linear(d, vocab, bias=False)


class MTP(DecoderLayer):
    """The MTP block: a target-family DecoderLayer plus enorm/hnorm/eh_proj/shared_head/embed_tokens.

    Subclassing keeps the checkpoint's names (`self_attn.q_proj.weight`, `enorm.weight`, ...) as is.
    """

    def __init__(self, cfg: MTPConfig, *, feedback: str = "post", vocab_ids: np.ndarray | None = None) -> None:
        """`vocab_ids`: a reduced draft vocabulary (FR-Spec): the head scores only those tokens, and a sampled
        column is mapped back to its token id."""
        super().__init__(cfg.layer)
        if feedback not in FEEDBACK:
            raise SpecrtError(f"MTP feedback must be one of {', '.join(FEEDBACK)}, got {feedback!r}")
        c = cfg.layer
        self.config, self.feedback = cfg, feedback
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.shared_head = SharedHead(c.hidden_size, len(vocab_ids) if vocab_ids is not None else c.vocab_size,
                                      c.rms_norm_eps)
        self.register_buffer("vocab_ids", None if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long),
                             persistent=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.register_buffer("inv_freq", torch.tensor(c.inv_freq(), dtype=torch.float32), persistent=False)
        self.max_seq = 0

    @classmethod
    def from_weights(cls, cfg: MTPConfig, weights: dict[str, np.ndarray], target_weights: dict[str, np.ndarray],
                     *, feedback: str = "post", dtype: torch.dtype = torch.float32,
                     vocab_ids: np.ndarray | None = None) -> "MTP":
        """Build from `load_mtp` weights; embedding / head come from the target's HF tensors when not own (a head
        with `vocab_ids` takes the weights' head as those rows already)."""
        t_head = "model.embed_tokens.weight" if cfg.layer.tie_word_embeddings else "lm_head.weight"
        state = dict(weights)
        if not cfg.has_own_embed:
            state[EMBED] = target_weights["model.embed_tokens.weight"]
        if not cfg.has_own_head:
            state[HEAD] = target_weights[t_head]
        model = cls(cfg, feedback=feedback, vocab_ids=vocab_ids)
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
        return model.to(dtype).eval()

    def setup_caches(self, batch: int, max_seq: int) -> None:
        """Allocate the block's K/V cache [batch, Hkv, max_seq, D] once."""
        c, w = self.config.layer, self.eh_proj.weight
        self.max_seq = max_seq
        self.self_attn.kv_cache = SlotKVCache(batch, c.num_kv_heads, max_seq, c.head_dim, w.dtype, w.device)

    def step(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        """h' [B,T,d] for rows (x_{t+1} = tokens, h_t = hidden, t = positions), written at cache slot t."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(tokens)), self.hnorm(hidden)), dim=-1))
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        keys = torch.arange(self.max_seq, device=x.device)
        mask = (keys.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B,1,T,S]: causal over slots
        # DecoderLayer hands its last argument to the cache's update: here the slots, not a write index.
        return super().forward(x, cos, sin, mask, positions.clamp(max=self.max_seq - 1))

    @torch.no_grad()
    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, last_row: Tensor,
                temperature: Tensor, noise: Tensor) -> MTPDraft:
        """Write rows [B,C] into the cache and chain G = noise.shape[1] drafts from row last_row[b].

        Padding rows (c > last_row[b]) are moved to positions continuing after the last row, so their
        writes land in slots the chain (or a later call) overwrites before anything reads them.
        """
        if self.self_attn.kv_cache is None:
            raise SpecrtError("call MTP.setup_caches(batch, max_seq) before forward")
        b, c = tokens.shape
        cols = torch.arange(c, device=tokens.device).unsqueeze(0)
        last = last_row.unsqueeze(1)
        p_last = positions.gather(1, last)  # [B,1]
        positions = torch.where(cols <= last, positions, p_last + cols - last)
        h = self.step(tokens, hidden, positions)[torch.arange(b, device=tokens.device), last_row]  # h'_1 [B,d]
        out_tokens, out_logits, out_probs = [], [], []
        for k in range(noise.shape[1]):
            if k:  # step k+1: previous draft token and fed-back hidden, at position P + k
                h = self.step(tok.unsqueeze(1), fed.unsqueeze(1), p_last + k)[:, 0]
            normed = self.shared_head.norm(h)
            logits = self.shared_head.head(normed)
            tok, probs = sample_draft(logits, temperature, noise[:, k])
            if self.vocab_ids is not None:
                tok = self.vocab_ids[tok]
            fed = normed if self.feedback == "post" else h
            out_tokens.append(tok)
            out_logits.append(logits)
            out_probs.append(probs)
        return MTPDraft(torch.stack(out_tokens, 1), torch.stack(out_logits, 1), torch.stack(out_probs, 1))

    # -- training (distill/train_mtp.py) -----------------------------------------------------------------

    def forward_train(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        """Training path, no cache: h' [B,T,d] for rows (x_{t+1}, h_t, t), causal over the T rows (as `step`)."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(tokens)), self.hnorm(hidden)), dim=-1))
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        attn, (b, t, _) = self.self_attn, x.shape
        a = self.input_layernorm(x)
        q = attn.q_proj(a).view(b, t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(a).view(b, t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(a).view(b, t, attn.num_kv_heads, attn.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        # rows are in position order, so causal over rows = causal over positions; gqa: head h reads kv head h // g
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        h = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp(self.post_attention_layernorm(h))
