"""Llama-family target (Llama / Mistral / Qwen2 / Qwen3) as small gpt-fast style torch modules.

Parameter names follow Hugging Face, so `load_state_dict` takes HF checkpoints as they are.
The KV cache is static ([B, Hkv, S_MAX, D] per layer, the graph I/O contract of specrt/artifact.py): `forward`
writes the new K/V at `write_index[b] + t` and attends with an explicit mask, so rollback is a smaller write_index.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rope (HF convention). x: [B, H, T, D]; cos/sin: [B, T, D], broadcast over H."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_cos_sin(inv_freq: Tensor, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [B, T, D] for `position_ids` [B, T], computed in fp32 like HF, then cast to dtype."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq.float()  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def cache_mask(write_index: Tensor, seq_len: int, max_seq: int) -> Tensor:
    """Bool mask [B, 1, T, S_MAX]: key s is visible to query t of slot b iff s <= write_index[b] + t."""
    q_pos = write_index.unsqueeze(1) + torch.arange(seq_len, device=write_index.device)  # [B, T]
    k_pos = torch.arange(max_seq, device=write_index.device)
    return (k_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (HF Llama/Qwen convention)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    """Static per-layer cache [B, Hkv, S_MAX, D]; `update` writes T new positions per slot in place."""

    def __init__(self, batch: int, num_kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        shape = (batch, num_kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, write_index: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Scatter k/v [B, Hkv, T, D] into cache positions write_index[b] + t (clamped to S-1, where the
        graphs send padding writes); return the whole cache."""
        b, h, t, d = k.shape
        pos = write_index.view(b, 1, 1, 1) + torch.arange(t, device=k.device).view(1, 1, t, 1)
        idx = pos.clamp(max=self.k_cache.shape[2] - 1).expand(b, h, t, d)
        self.k_cache.scatter_(2, idx, k.to(self.k_cache.dtype))
        self.v_cache.scatter_(2, idx, v.to(self.v_cache.dtype))
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    """GQA self-attention over the static cache; optional q/k/v bias (Qwen2) and q/k norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, qd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, kvd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, kvd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(qd, d, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, write_index: Tensor) -> Tensor:
        if self.kv_cache is None:
            raise SpecrtError("call Transformer.setup_caches(batch, max_seq) before forward")
        b, t, _ = x.shape
        hkv, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // hkv
        q = self.q_proj(x).view(b, t, self.num_heads, d)
        k = self.k_proj(x).view(b, t, hkv, d)
        v = self.v_proj(x).view(b, t, hkv, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = self.kv_cache.update(write_index, k, v)  # [B, Hkv, S, D]
        # GQA by grouping: query head h = j*g + i reads kv head j (HF repeat_kv order), no cache copy.
        qg = q.reshape(b, hkv, g * t, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * d ** -0.5  # [B, Hkv, g*T, S]
        scores = scores.view(b, hkv, g, t, -1).masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype).view(b, hkv, g * t, -1)
        out = torch.matmul(probs, values).view(b, self.num_heads, t, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * d))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, write_index: Tensor) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, write_index)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """The decoder stack (HF `model.*`): embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Causal LM (HF `*ForCausalLM` layout) over a static KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq = torch.tensor(config.inv_freq(), dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_batch = self.max_seq = 0

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, np.ndarray],
                     dtype: torch.dtype = torch.float32) -> "Transformer":
        """Build and load from HF-named numpy weights; lm_head.weight may be absent when tied."""
        model = cls(config)
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise SpecrtError(f"weights do not match the {config.family} model: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(dtype).eval()

    def setup_caches(self, batch: int, max_seq: int) -> None:
        """Allocate every layer's K/V cache [batch, Hkv, max_seq, D] once, in the weights' dtype/device."""
        cfg, w = self.config, self.lm_head.weight
        self.max_batch, self.max_seq = batch, max_seq
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(batch, cfg.num_kv_heads, max_seq, cfg.head_dim,
                                               w.dtype, w.device)

    def forward(self, input_ids: Tensor, position_ids: Tensor, write_index: Tensor, *,
                capture_layers: Sequence[int] = ()) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Run T new tokens per slot; return (logits [B,T,V], final-normed hidden [B,T,d], captured).

        `captured[i]` is the raw output of decoder layer `capture_layers[i]` (-1 = embedding output).
        """
        if input_ids.shape[0] != self.max_batch:
            raise SpecrtError(f"batch {input_ids.shape[0]} != cache batch {self.max_batch}; "
                              "call setup_caches first")
        bad = [i for i in capture_layers if not -1 <= i < self.config.num_layers]
        if bad:
            raise SpecrtError(f"capture_layers {bad} out of range -1..{self.config.num_layers - 1}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype)
        mask = cache_mask(write_index, input_ids.shape[1], self.max_seq)
        outputs = {-1: x} if -1 in capture_layers else {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, write_index)
            if i in capture_layers:
                outputs[i] = x
        hidden = self.model.norm(x)
        return self.lm_head(hidden), hidden, [outputs[i] for i in capture_layers]
