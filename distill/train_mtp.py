"""`train_mtp`: distil a DeepSeek-style MTP head (one decoder block of the target's family) from a TargetCache.

Row t of a sequence feeds (x_{t+1}, h_t = the cache's "final" hidden at t) at position t, causal over the rows,
and predicts x_{t+2}; rows whose label is a response token carry the loss

    loss = CE(logits_t, x_{t+2}) + KL(p_target(t+1) ‖ p_mtp(t)),   p_target(t+1) = softmax(lm_head(h_{t+1})).

Embedding and head are the target's, frozen and not stored: the checkpoint aliases them (loaders/mtp.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.distill.cache import TargetCache
from specrt.distill.losses import LossParts, mtp_loss
from specrt.distill.train_dspark import (EVAL_SEED, FINAL, FrozenHead, TrainResult, frozen_param,
                                                  init_weights, on_device, run_training, train_device,
                                                  train_eval_split)
from specrt.model_config import EMBED, HEAD, MTPConfig
from specrt.exporter.loaders.mtp import save_mtp_checkpoint
from specrt.models.mtp import MTP

MAX_SEQS_PER_STEP = 16  # a step gathers sequences until it has batch_tokens loss rows, at most this many


@dataclass
class MTPBatch:
    """B padded sequences as MTP rows: tokens x_{t+1} [B,R], hidden h_t [B,R,d], and the loss rows (b, t) chosen,
    with their labels x_{t+2} and the target's hidden h_{t+1} (for p_target)."""

    tokens: Tensor
    hidden: Tensor
    rows: tuple[Tensor, Tensor]
    labels: Tensor
    target_hidden: Tensor


def make_batch(cache: TargetCache, samples: list[int], final_cols: slice, rng: np.random.Generator | None = None,
               max_rows: int | None = None) -> MTPBatch:
    """Rows t = 0..T-3 of each sequence; loss rows are those with t+2 >= prompt_len (`max_rows` of them at random)."""
    seqs = [cache[i] for i in samples]
    r, d = max(len(s.ids) for s in seqs) - 2, final_cols.stop - final_cols.start
    tokens, hidden = np.zeros((len(seqs), r), np.int64), np.zeros((len(seqs), r, d), np.float32)
    rows, labels, target_hidden = [], [], []
    for b, s in enumerate(seqs):
        n, h = len(s.ids) - 2, np.asarray(s.features[:, final_cols], np.float32)
        tokens[b, :n], hidden[b, :n] = s.ids[1:n + 1], h[:n]
        for t in range(max(0, s.prompt_len - 2), n):
            rows.append((b, t))
            labels.append(s.ids[t + 2])
            target_hidden.append(h[t + 1])
    keep = np.arange(len(rows))
    if max_rows is not None and len(rows) > max_rows:
        keep = np.sort(rng.choice(len(rows), size=max_rows, replace=False))
    bt = torch.tensor([rows[i] for i in keep], dtype=torch.long).view(-1, 2)
    return MTPBatch(torch.from_numpy(tokens), torch.from_numpy(hidden), (bt[:, 0], bt[:, 1]),
                    torch.tensor(np.asarray(labels, np.int64)[keep]),
                    torch.from_numpy(np.stack(target_hidden)[keep]).view(-1, d))


def mtp_batch_loss(model: MTP, head: FrozenHead, batch: MTPBatch) -> LossParts:
    """CE + KL over the batch's loss rows (only those rows go through the V-wide head)."""
    positions = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).expand_as(batch.tokens)
    h = model.forward_train(batch.tokens, batch.hidden, positions)
    logits = head(model.shared_head.norm(h[batch.rows]))
    with torch.no_grad():
        logp_target = torch.log_softmax(head(batch.target_hidden), dim=-1)
    return mtp_loss(logits, batch.labels, logp_target)


def chained_tau(acc: Tensor, rows: tuple[Tensor, Tensor], gamma: int) -> Tensor:
    """τ per start row t: 1 + Σ_{k=1..γ} Π_{i<k} a_{t+i}, with a = depth-1 acceptance (1 − TV) of consecutive rows.

    An estimate: depth k > 1 really feeds back the MTP's own hidden and draft token, so this is optimistic."""
    b, t = rows
    grid = torch.zeros(int(b.max()) + 1, int(t.max()) + 1 + gamma, device=acc.device)
    grid[b, t] = acc
    windows = grid.unfold(1, gamma, 1)[b, t]  # [R, γ]: a_t .. a_{t+γ-1}
    return 1 + torch.cumprod(windows, dim=-1).sum(-1)


@torch.no_grad()
def evaluate_mtp(model: MTP, head: FrozenHead, batches: list[MTPBatch], gamma: int) -> dict[str, Any]:
    """Held-out loss, mean depth-1 acceptance 1 − TV, and the chained τ estimate for γ draft steps."""
    taus, accs, losses = [], [], []
    for batch in batches:
        parts = mtp_batch_loss(model, head, batch)
        taus.append(chained_tau(parts.acc, batch.rows, gamma).cpu())
        accs.append(parts.acc.cpu())
        losses.append(parts.total.item())
    return {"tau": torch.cat(taus).mean().item(), "acc": torch.cat(accs).mean().item(), "loss": float(np.mean(losses))}


def train_mtp(cache: TargetCache, target_weights: dict[str, np.ndarray], target_cfg: ModelConfig,
              out_dir: str | Path, *, steps: int = 5000, batch_tokens: int = 256, lr: float = 6e-4,
              warmup: float = 0.04, seed: int = 0, threads: int | None = None, head_dtype: str | None = None,
              gamma: int = 3, save_every: int = 200, eval_every: int | None = None, eval_seqs: int = 16,
              progress: bool = True, resume: bool = True, device: str = "cpu") -> TrainResult:
    """Train an MTP head on the cache's train split; save it with `save_mtp_checkpoint` to `out_dir` (trained on
    `device`: "cpu" or "cuda[:N]").

    τ is the chained estimate for `gamma` draft steps from the depth-1 acceptances (see `chained_tau`).
    The defaults take about 25 minutes for SmolLM2-135M on 2 CPU cores (~3.3 steps/s with bf16)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final_cols = cache.feature_slice([FINAL])
    if int(cache.manifest["hidden_size"]) != target_cfg.hidden_size:
        raise SpecrtError(f"target cache hidden size {cache.manifest['hidden_size']} does not match the target's "
                          f"{target_cfg.hidden_size}")
    train, held = train_eval_split(cache, min_response=2)
    loss_rows = {i: int(cache.samples[i][1] - max(2, cache.samples[i][2])) for i in range(len(cache))}
    train, held = [i for i in train if loss_rows[i] > 0], [i for i in held if loss_rows[i] > 0]
    dev = train_device(device)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or old_threads)
    try:
        torch.manual_seed(seed)
        cfg = MTPConfig(layer=target_cfg, layer_index=target_cfg.num_layers, has_own_head=False, has_own_embed=False)
        model = MTP(cfg)
        init_weights(model)
        embed = target_weights["model.embed_tokens.weight"]
        model.embed_tokens.weight = frozen_param(embed)  # aliases of the target's, never saved
        model.shared_head.head.weight = frozen_param(target_weights.get("lm_head.weight", embed))
        model.to(dev)
        head = FrozenHead(model.shared_head.head.weight, getattr(torch, head_dtype) if head_dtype else None)
        held = list(np.random.default_rng([seed, EVAL_SEED]).permutation(held)[:eval_seqs])
        eval_batches = [on_device(make_batch(cache, held[i:i + 4], final_cols), dev) for i in range(0, len(held), 4)]

        def step_loss(step: int) -> LossParts:
            rng = np.random.default_rng([seed, step])  # a function of the step alone: resuming replays exactly
            picked, rows = [], 0
            for i in rng.permutation(train)[:MAX_SEQS_PER_STEP]:
                picked.append(int(i))
                rows += loss_rows[int(i)]
                if rows >= batch_tokens:
                    break
            return mtp_batch_loss(model, head, on_device(make_batch(cache, picked, final_cols, rng, batch_tokens), dev))

        def save() -> None:
            weights = {k: v.cpu() for k, v in model.state_dict().items() if k not in (EMBED, HEAD)}
            save_mtp_checkpoint(out, target_cfg.to_hf(), weights)

        config = {"kind": "mtp", "steps": steps, "batch_tokens": batch_tokens, "lr": lr, "warmup": warmup,
                  "seed": seed, "gamma": gamma, "head_dtype": str(head.weight.dtype).removeprefix("torch."),
                  "train_samples": len(train), "eval_samples": len(held)}
        return run_training(model, step_loss, lambda: evaluate_mtp(model, head, eval_batches, gamma), save,
                            out_dir=out, config=config, steps=steps, lr=lr, warmup=warmup, save_every=save_every,
                            eval_every=eval_every or max(1, steps // 10), progress=progress, resume=resume,
                            desc="distill mtp")
    finally:
        torch.set_num_threads(old_threads)
