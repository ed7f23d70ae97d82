#!/usr/bin/env python3
"""Held-out τ of DSpark heads on a feature cache, per prompt set: which head drafts better, before any decoding.

    python scripts/head_eval.py CACHE --target smollm2 --head shipped=specrt/heads/smollm2/dspark \\
                                --head corpus=~/.cache/specrt/heads/dspark-corpus [--split val] [--per-set 48]
                                [--anchors 32] [--threads 2] [--json]

CACHE is a completed `specrt distill` feature cache (WORK/cache.given, WORK/cache), made for --target. Its --split
samples (by default "val", the prompts `specrt distill --responses` held out of training) are grouped by the
file their prompt came from (humaneval, gsm8k, corpus/careers.jsonl.gz, ...), up to --per-set of each (a seeded
draw, the same for every head), and each head is run teacher-forced on --anchors random block starts per response
(the same anchors for every head), as training evaluates (distill/train_dspark.py `evaluate_blocks`). Per set and
head it reports two τ (1 + the expected drafts a block gets accepted):

    greedy     a draft counts while it is the target's argmax at its position (T=0 verification: what greedy
               decoding accepts, on greedy responses; on sampled ones the label is the sampled token)
    sampled    DeepSpec's tau_probabilistic: acceptance 1 - TV(p_draft, p_target) (T=1 rejection sampling)

Both ignore the confidence head: they are what the head's whole block is worth, not what a scheduler verifies.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from specrt.configs.presets import resolve_model
from specrt.distill.cache import TargetCache
from specrt.distill.train_dspark import FrozenHead, evaluate_blocks, make_batch
from specrt.errors import SpecrtError
from specrt.exporter.loaders import load_target
from specrt.exporter.loaders.deepspec import load_dspark
from specrt.exporter.onnx.target import FINAL
from specrt.models.dspark import DSparkDraft

BATCH_SEQS = 2


def samples_by_set(cache: TargetCache, split: str, per_set: int, seed: int) -> dict[str, list[int]]:
    """The split's cache samples with at least one response token, grouped by prompt file, up to per_set each."""
    ids = (cache.manifest.get("splits") or {}).get(split)
    if not ids:
        have = sorted(cache.manifest.get("splits") or {})
        raise SpecrtError(f"{cache.path}: no {split!r} split (its splits: {', '.join(have) or 'none'})")
    provenance = cache.manifest["provenance"]
    groups: dict[str, list[int]] = defaultdict(list)
    for i in ids:
        _, n, p = cache.samples[i]
        if n - p >= 2:
            groups[str(provenance[i].get("file") or "?")].append(int(i))
    rng = np.random.default_rng(seed)
    return {name: sorted(rng.permutation(g)[:per_set].tolist()) for name, g in sorted(groups.items())}


def load_head(path: Path, loaded) -> tuple[DSparkDraft, FrozenHead]:
    head = load_dspark(path, loaded.config)
    model = DSparkDraft.from_weights(head.config, head.with_target(loaded.weights))
    model.eval()
    return model, FrozenHead(model.lm_head.weight)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--target", required=True, help="the model the cache was captured from (preset or path)")
    ap.add_argument("--head", action="append", required=True, metavar="NAME=DIR", help="a DSpark checkpoint")
    ap.add_argument("--split", default="val")
    ap.add_argument("--per-set", type=int, default=48)
    ap.add_argument("--anchors", type=int, default=32, help="block starts per response")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    heads = {}
    for spec in a.head:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SpecrtError(f"--head {spec!r}: expected NAME=DIR")
        heads[name] = Path(path).expanduser()
    if a.threads:
        torch.set_num_threads(a.threads)
    cache = TargetCache(a.cache)
    loaded = load_target(resolve_model(a.target, progress=False))
    sets = samples_by_set(cache, a.split, a.per_set, a.seed)
    models = {name: load_head(path, loaded) for name, path in heads.items()}
    blocks = {m.config.block_size for m, _ in models.values()}
    layers = {tuple(m.config.target_layer_ids) for m, _ in models.values()}
    if len(blocks) != 1 or len(layers) != 1:
        raise SpecrtError(f"the heads differ in block size {sorted(blocks)} or feature layers {sorted(layers)}: "
                          "compare heads of one shape")
    block, ids = blocks.pop(), list(layers.pop())
    ctx_cols, final_cols = cache.feature_slice(ids), cache.feature_slice([FINAL])
    results = []
    for set_name, samples in sets.items():
        rng = np.random.default_rng([a.seed, len(samples)])
        batches = [make_batch(cache, samples[i:i + BATCH_SEQS], a.anchors, block, rng, ctx_cols, final_cols)
                   for i in range(0, len(samples), BATCH_SEQS)]
        row = {"set": set_name, "samples": len(samples)}
        for name, (model, head) in models.items():
            for objective in ("greedy", "sampled"):
                row[f"{name}:{objective}"] = round(evaluate_blocks(model, head, batches, objective)["tau"], 4)
        results.append(row)
        if not a.json:
            print(f"{set_name:34s} n={len(samples):3d}  " + "  ".join(
                f"{k} {v:.3f}" for k, v in row.items() if ":" in k), flush=True)
    if a.json:
        print(json.dumps({"cache": str(a.cache), "split": a.split, "anchors": a.anchors,
                          "heads": {k: str(v) for k, v in heads.items()}, "sets": results}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except SpecrtError as e:
        sys.exit(f"error: {e}")
