"""Sequential Temperature Scaling (DSpark paper §3.2.1) of a DSpark head's confidences on the cache's "calib" split.

For k = 1..K in order, with T_1..T_{k-1} already fixed, pick T_k on a grid to minimise the ECE (20 equal-width bins)
of the prefix prediction Π_{i≤k} sigmoid(logit_i / T_i) against the prefix-acceptance indicator Π_{i≤k} accepted_i.

Acceptance indicator (teacher-forced, slot k conditional on the ground-truth prefix):
  "sampled" (default): accepted_k ~ Bernoulli(acc*_k), acc*_k = 1 − TV(p_draft, p_target), i.e. what T=1 rejection
             sampling accepts, and the very quantity the confidence head is trained on (reference §3, §1.10);
  "greedy":  accepted_k = [argmax draft logits == argmax target logits], what T=0 decoding accepts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.distill.cache import TargetCache
from specrt.distill.losses import SoftCE_L1, acceptance_target
from specrt.distill.train_dspark import FINAL, FrozenHead, block_rows, make_batch
from specrt.exporter.loaders.deepspec import load_dspark
from specrt.models.dspark import DSparkDraft

ECE_BINS = 20
# a temperature other than 1 only where it lowers the ECE by more than this: late positions, where prefix survivals
# are near 0, have ECEs of 1e-5..1e-3 at every temperature, and the lowest sat at a grid end (0.05 or 20: confidences
# made hard 0/1, or flat) for a gain far below the sampling noise's
ECE_TIE = 1e-3
ACCEPTANCE = ("sampled", "greedy")
DEFAULT_GRID = np.unique(np.append(np.exp(np.linspace(np.log(0.05), np.log(20.0), 241)), 1.0))


@dataclass
class Calibration:
    """Per draft position k: the chosen temperature, ECE of the prefix prediction before / after, rows counted."""

    temperatures: list[float]
    ece_before: list[float]
    ece_after: list[float]
    counts: list[int]
    acceptance: str = "sampled"
    bins: int = ECE_BINS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ece(pred: np.ndarray, label: np.ndarray, bins: int = ECE_BINS) -> np.ndarray:
    """ECE of predictions [n, ...] against labels [n]: Σ_b (n_b/n)·|mean pred − mean label| over equal-width bins
    on [0, 1]; one value per trailing column of `pred` (so a whole temperature grid at once)."""
    if len(pred) == 0:  # a position no block reaches
        return np.zeros(int(np.prod(pred.shape[1:])))
    pred = pred.reshape(len(pred), -1)
    n, g = pred.shape
    bin_of = np.minimum((pred * bins).astype(np.int64), bins - 1) + bins * np.arange(g)  # [n, g], per column
    pred_sum = np.bincount(bin_of.ravel(), weights=pred.ravel(), minlength=bins * g)
    label_sum = np.bincount(bin_of.ravel(), weights=np.repeat(label, g).astype(np.float64), minlength=bins * g)
    return np.abs(pred_sum - label_sum).reshape(g, bins).sum(-1) / n  # n_b/n·|Σp/n_b − Σy/n_b| = |Σp − Σy|/n


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def sts_temperatures(conf_logits: np.ndarray, accepted: np.ndarray, valid: np.ndarray, *,
                     grid: np.ndarray | None = None, bins: int = ECE_BINS) -> Calibration:
    """STS on confidence logits [N,K], acceptance indicators [N,K] and a contiguous validity mask [N,K].

    `grid`: candidate temperatures (default: 241 log-spaced in [0.05, 20], plus 1, which is kept where no other
    lowers the ECE by more than ECE_TIE)."""
    grid = DEFAULT_GRID if grid is None else np.asarray(grid, np.float64)
    logits, valid = np.asarray(conf_logits, np.float64), np.asarray(valid, bool)
    label = np.cumprod(np.asarray(accepted, bool) & valid, axis=1).astype(np.float64)  # prefix accepted through k
    prefix, prefix_raw = np.ones(len(logits)), np.ones(len(logits))  # Π_{i<k} with the chosen / with all T = 1
    out = Calibration([], [], [], [], bins=bins)
    for k in range(logits.shape[1]):
        rows = valid[:, k]
        scores = ece(prefix[rows, None] * sigmoid(logits[rows, k, None] / grid), label[rows, k], bins)
        best, one = int(np.argmin(scores)), np.flatnonzero(grid == 1.0)
        keep_one = one.size > 0 and scores[one[0]] <= scores[best] + ECE_TIE
        t_k = float(grid[best]) if rows.any() and not keep_one else 1.0
        prefix *= sigmoid(logits[:, k] / t_k)
        prefix_raw *= sigmoid(logits[:, k])
        out.temperatures.append(t_k)
        out.ece_before.append(float(ece(prefix_raw[rows], label[rows, k], bins)[0]))
        out.ece_after.append(float(ece(prefix[rows], label[rows, k], bins)[0]))
        out.counts.append(int(rows.sum()))
    return out


@torch.no_grad()
def collect_confidence(model: DSparkDraft, head: FrozenHead, batches: Iterable, acceptance: str,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(confidence logits, accepted, valid), each [anchors, K], over teacher-forced blocks of the batches."""
    if acceptance not in ACCEPTANCE:
        raise SpecrtError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, got {acceptance!r}")
    logits, accepted, valid = [], [], []
    for batch in batches:
        r = block_rows(model, head, batch)
        if acceptance == "sampled":
            acc = acceptance_target(SoftCE_L1.apply(r.logits, r.labels, r.p_target)[1]).numpy()
            ok = rng.random(len(acc)) < acc
        else:
            ok = (r.logits.argmax(-1) == r.p_target.argmax(-1)).numpy()
        v = batch.valid.reshape(-1, batch.valid.shape[-1]).numpy()
        for dst, rows in ((logits, r.conf.numpy()), (accepted, ok)):
            full = np.zeros(v.shape, rows.dtype)
            full[v] = rows
            dst.append(full)
        valid.append(v)
    return np.concatenate(logits), np.concatenate(accepted), np.concatenate(valid)


def calibrate_dspark(cache: TargetCache, draft_dir: str | Path, target_cfg: ModelConfig, *, split: str = "calib",
                     acceptance: str = "sampled", anchors_per_seq: int = 64, max_seqs: int | None = None,
                     batch_seqs: int = 4, grid: np.ndarray | None = None, bins: int = ECE_BINS, seed: int = 0,
                     head_dtype: str | None = None, target_weights: dict[str, np.ndarray] | None = None,
                     progress: bool = False) -> Calibration:
    """STS temperatures for the DSpark head in `draft_dir` (DeepSpec layout) on the cache's `split` samples (at most
    `max_seqs` of them, spread evenly over the split)."""
    loaded = load_dspark(draft_dir, target_cfg)
    cfg = loaded.config
    if not cfg.enable_confidence_head:
        raise SpecrtError(f"{draft_dir}: the head has no confidence head to calibrate")
    splits = cache.manifest.get("splits") or {}
    samples = splits.get(split)
    if not samples:
        raise SpecrtError(f"target cache {cache.path}: its {split!r} split holds no sample (samples per split: "
                          f"{', '.join(f'{k} {len(v)}' for k, v in splits.items()) or 'none'}); give more prompts "
                          "or a larger --calib-fraction")
    samples = [i for i in samples if cache.samples[i][1] - cache.samples[i][2] >= 2]
    if max_seqs is not None and len(samples) > max_seqs:  # evenly spaced: the split holds its files in order
        samples = [samples[i] for i in np.linspace(0, len(samples) - 1, max_seqs).round().astype(int)]
    if loaded.shared and target_weights is None:
        raise SpecrtError(f"{draft_dir} shares {', '.join(loaded.shared)} with the target; pass target_weights")
    model = DSparkDraft.from_weights(cfg, loaded.with_target(target_weights) if loaded.shared else loaded.weights)
    head = FrozenHead(model.lm_head.weight, getattr(torch, head_dtype) if head_dtype else None)
    ctx_cols, final_cols = cache.feature_slice(list(cfg.target_layer_ids)), cache.feature_slice([FINAL])
    rng = np.random.default_rng(seed)
    starts = tqdm(range(0, len(samples), batch_seqs), desc="calibrate", unit="batch", disable=not progress)
    batches = (make_batch(cache, samples[i:i + batch_seqs], anchors_per_seq, cfg.block_size, rng, ctx_cols, final_cols)
               for i in starts)
    conf, accepted, valid = collect_confidence(model, head, batches, acceptance, rng)
    return replace(sts_temperatures(conf, accepted, valid, grid=grid, bins=bins), acceptance=acceptance)
