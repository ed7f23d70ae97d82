"""Parity of the gpt-fast style target (models/llama.py) with transformers, plus cache semantics."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file

from specrt.model_config import ModelConfig
from specrt.models.llama import apply_rope, Transformer

KINDS = [("llama", True), ("llama", False), ("qwen2", None), ("qwen3", None),
         ("llama3_scaled", None), ("mistral", None)]
KIND_IDS = ["llama_tied", "llama_untied", "qwen2", "qwen3", "llama3_scaled", "mistral"]
ATOL = 1e-4


def load_ours(model_dir: Path) -> Transformer:
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    weights: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    return Transformer.from_weights(cfg, weights)


def run(model: Transformer, ids: torch.Tensor, start: torch.Tensor, **kw) -> tuple:
    """One forward of ids [B,T] written at cache positions start[b] + t (positions = cache positions)."""
    pos = start.unsqueeze(1) + torch.arange(ids.shape[1])
    with torch.no_grad():
        return model(ids, pos, start, **kw)


def tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=KINDS, ids=KIND_IDS)
def model_dir(request, tiny_model_dir) -> Path:
    kind, tie = request.param
    return tiny_model_dir(kind, tie=tie)


def test_logits_match_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                              attn_implementation="eager").eval()
    ours = load_ours(model_dir)
    ids = tokens(20, seed=1).unsqueeze(0)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    ours.setup_caches(1, 32)
    logits, hidden, layers = run(ours, ids, torch.zeros(1, dtype=torch.long), capture_layers=(-1, 0, 1))
    assert logits.shape == (1, 20, hf.config.vocab_size)
    assert (logits - ref.logits).abs().max().item() <= ATOL
    assert (hidden - ref.hidden_states[-1]).abs().max().item() <= ATOL  # final-normed
    for got, want in zip(layers[:2], ref.hidden_states[:2]):  # embedding, raw layer-0 output
        assert (got - want).abs().max().item() <= ATOL
    torch.testing.assert_close(ours.lm_head(hidden), logits)
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_incremental_matches_full(model_dir: Path) -> None:
    model = load_ours(model_dir)
    ids = tokens(20, seed=2).unsqueeze(0)
    model.setup_caches(1, 32)
    full, _, _ = run(model, ids, torch.tensor([0]))
    model.setup_caches(1, 32)
    steps = [run(model, ids[:, :7], torch.tensor([0]))[0]]
    for t in range(7, 20):
        steps.append(run(model, ids[:, t:t + 1], torch.tensor([t]))[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


def test_batched_slots_equal_single(model_dir: Path) -> None:
    """Three slots at different cache lengths, one batched step each round, equal running each alone."""
    model = load_ours(model_dir)
    prompts = [tokens(n, seed=10 + n) for n in (5, 9, 3)]
    nxt = [tokens(4, seed=20 + i) for i in range(3)]
    alone = []
    for p, q in zip(prompts, nxt):
        model.setup_caches(1, 24)
        run(model, p.unsqueeze(0), torch.tensor([0]))
        alone.append(run(model, q.unsqueeze(0), torch.tensor([len(p)]))[0][0])
    model.setup_caches(3, 24)
    # Right-padded batched prefill: pad junk lands past each slot's length and stays masked.
    padded = torch.zeros(3, 9, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    run(model, padded, torch.zeros(3, dtype=torch.long))
    lens = torch.tensor([len(p) for p in prompts])
    batched, _, _ = run(model, torch.stack(nxt), lens)
    for b in range(3):
        torch.testing.assert_close(batched[b], alone[b], atol=ATOL, rtol=0)


def test_rollback_equals_fresh(model_dir: Path) -> None:
    model = load_ours(model_dir)
    prefix, rejected, accepted = tokens(6, seed=3), tokens(5, seed=4), tokens(3, seed=5)
    model.setup_caches(1, 32)
    run(model, prefix.unsqueeze(0), torch.tensor([0]))
    run(model, rejected.unsqueeze(0), torch.tensor([6]))
    rolled, _, _ = run(model, accepted.unsqueeze(0), torch.tensor([6]))  # write_index moved back
    model.setup_caches(1, 32)
    fresh, _, _ = run(model, torch.cat([prefix, accepted]).unsqueeze(0), torch.tensor([0]))
    torch.testing.assert_close(rolled, fresh[:, 6:], atol=ATOL, rtol=0)


def test_cache_shape_and_no_growth(tiny_model_dir) -> None:
    model = load_ours(tiny_model_dir("qwen3"))
    model.setup_caches(2, 16)
    cache = model.model.layers[0].self_attn.kv_cache
    assert cache.k_cache.shape == (2, model.config.num_kv_heads, 16, model.config.head_dim)
    ptr = cache.k_cache.data_ptr()
    run(model, tokens(8, seed=6).view(2, 4), torch.tensor([0, 3]))
    assert cache.k_cache.data_ptr() == ptr and cache.k_cache.shape[2] == 16
    assert "k_cache" not in "".join(model.state_dict())


def test_apply_rope_is_rotation() -> None:
    x = torch.randn(1, 2, 3, 8)
    ang = torch.randn(1, 3, 4)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rope(y, cos, -sin), x)
