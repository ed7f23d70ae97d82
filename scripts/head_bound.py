#!/usr/bin/env python3
"""What a draft head's acceptance allows at batch 1: its best speed against `ar` on the artifact's profiled costs.

    python scripts/head_bound.py ART --prompts datasets/humaneval.jsonl [--prompts ...] [--head dspark]
                                 [--limit 6] [--max-new-tokens 256] [--threads 2] [--json]

Decodes the prompts greedily with the head drafting its whole block every round (`fixed`), which records how many
of its drafts each round accepted (greedy output does not depend on the drafts, so these are the head's own
acceptances on this text). Then, on the artifact's cost profile for --threads (`specrt profile ART`; a verify of t
tokens in decoding steps, and the head's draft call), it prices three kinds of schedule over the same rounds:

    k drafts    every round verifies k drafts (k = 0 is `ar`): what a scheduler without per-round information gets
    sps         every round verifies what Algorithm 1 (`--scheduler sps`, runtime/schedulers.py `admission`) admits
                on the head's own calibrated confidences and the profile, the head called every round (a head with
                a confidence head only): what this head's confidences are worth to a scheduler without a gate
    oracle      every round verifies exactly the drafts that will be accepted (and drafts only if one will): no
                scheduler reaches it; what the head's confidences could at most be worth

each once with the draft call at its profiled cost and once free. Speeds are committed tokens per decoding step
(`ar` = 1); rounds cut short by a request's token budget are left out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.plugins.confidence_truncate import survival
from specrt.runtime.config import EngineConfig
from specrt.runtime.profile import load_profile
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.schedulers import admission
from specrt.runtime.tokenizer import Tokenizer
from specrt.tools.concurrency import serve
from specrt.runtime.engine import Engine


class _Steps:
    """The profile's batch-1 costs in decoding steps, as `admission` reads a cost table (a free draft: 0)."""

    def __init__(self, verify: dict[int, float], draft: float) -> None:
        self.verify, self.draft = verify, draft

    def verify_ms(self, batch: int, tokens: int) -> float:
        return self.verify[max(1, min(tokens, max(self.verify)))]

    def draft_ms(self, head: str, batch: int) -> float:
        return self.draft


def sps_lengths(a: np.ndarray, verify: dict[int, float], draft: float) -> list[int]:
    """Per round, the drafts Algorithm 1 admits on prefix survivals a [rounds, gamma] at these costs."""
    costs, active = _Steps(verify, draft), np.ones(1, bool)
    return [int(admission(row[None], active, draft, costs)[0][0]) for row in a]


def speeds(accepted: list[int], gamma: int, verify: dict[int, float], draft: float,
           survivals: np.ndarray | None = None) -> dict:
    """Committed tokens per decoding step of each schedule over rounds that accepted `accepted[i]` of `gamma`
    drafts; verify[t]: a verify of t tokens in steps; draft: the head's call in steps; survivals: each round's
    calibrated prefix survivals [rounds, gamma] (a confidence head's), for `sps`."""
    fixed = []
    for k in range(gamma + 1):
        tokens = sum(min(a, k) + 1 for a in accepted)
        fixed.append(round(tokens / (len(accepted) * (verify[k + 1] + (draft if k else 0.0))), 3))
    oracle = sum(a + 1 for a in accepted) / sum(verify[a + 1] + (draft if a else 0.0) for a in accepted)
    out = {"k_drafts": fixed, "best_k": max(range(gamma + 1), key=fixed.__getitem__), "oracle": round(oracle, 3)}
    if survivals is not None:
        ks = sps_lengths(survivals, verify, draft)
        tokens = sum(min(a, k) + 1 for a, k in zip(accepted, ks))
        out["sps"] = round(tokens / sum(verify[k + 1] + draft for k in ks), 3)
        out["sps_mean_drafts"] = round(float(np.mean(ks)), 3)
    return out


class _Record:
    """An observer keeping each round's confidence logits, verified and accepted drafts."""

    def __init__(self, rounds: list) -> None:
        self.rounds = rounds

    def on_round(self, r) -> None:
        self.rounds.append((r.confidence_logits, r.verify_len, r.accepted))

    def close(self) -> None:
        pass


def _auc(score: np.ndarray, hit: np.ndarray) -> float:
    """The probability that a round whose draft was accepted scored above one whose was not (ties count half)."""
    pos, neg = score[hit], score[~hit]
    if not len(pos) or not len(neg):
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("--prompts", type=Path, action="append", required=True)
    ap.add_argument("--head", default="dspark")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        manifest = io.load_manifest(args.art)
        if args.head not in manifest.heads:
            raise SpecrtError(f"{args.art} has no {args.head} head (it has: {', '.join(manifest.heads) or 'none'})")
        profile = load_profile(args.art, threads=args.threads)
        if profile is None:
            raise SpecrtError(f"{args.art} has no cost profile for {args.threads} threads (run `specrt profile ART "
                              f"--threads {args.threads}`)")
        tokenizer = Tokenizer.from_dir(args.art / io.TOKENIZER_DIR, manifest.tokenizer)
        prompts = [encode_prompt(tokenizer, t) for f in args.prompts for t in read_prompts_file(f, args.limit)]
        rounds: list = []  # (confidence logits, verified, accepted) per round
        engine = Engine.open(args.art, EngineConfig(method=args.head, scheduler="fixed", threads=args.threads, slots=1),
                             observers=[_Record(rounds)])
    except SpecrtError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve(engine, prompts, SamplingParams(max_new_tokens=args.max_new_tokens), 1)
    gamma = engine.stats.gamma
    full = [(conf, a) for conf, verified, a in rounds if verified == gamma]
    accepted = [a for _, a in full]
    engine.close()
    temperatures = np.asarray(manifest.heads[args.head].temperatures, np.float32)
    survivals = None  # the head's calibrated prefix survivals per round, where it has a confidence head
    if full and full[0][0] is not None and len(temperatures) >= gamma:
        survivals = survival(np.array([c for c, _ in full], np.float32)[:, :gamma], temperatures[:gamma])
    step = profile.verify_ms(1, 1)
    verify = {t: profile.verify_ms(1, t) / step for t in range(1, gamma + 2)}
    draft = profile.draft_ms(args.head, 1) / step
    report = {"head": args.head, "rounds": len(accepted), "gamma": gamma,
              "tau_fixed": round(sum(a + 1 for a in accepted) / len(accepted), 3),
              "first_acceptance": round(sum(a >= 1 for a in accepted) / len(accepted), 3),
              "verify_steps": {t: round(v, 3) for t, v in verify.items()}, "draft_steps": round(draft, 3),
              "profiled_draft": speeds(accepted, gamma, verify, draft, survivals),
              "free_draft": speeds(accepted, gamma, verify, 0.0, survivals)}
    if survivals is not None:
        first = survivals[:, 0]
        report["confidence"] = {"first_predicted": round(float(first.mean()), 3),
                                "first_auc": round(_auc(first, np.array(accepted) >= 1), 3)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.head}: {len(accepted)} rounds of {gamma} drafts, tau {report['tau_fixed']}, first draft accepted "
          f"{report['first_acceptance']:.0%}; its draft call {draft:.2f} decoding steps")
    for label, key in (("at its profiled cost", "profiled_draft"), ("free", "free_draft")):
        s = report[key]
        on = f"; sps on its confidences {s['sps']}x" if "sps" in s else ""
        print(f"  draft call {label:20s} k drafts every round (k = 0..{gamma}): {s['k_drafts']}  "
              f"best k {s['best_k']}{on}; oracle {s['oracle']}x ar")
    return 0


if __name__ == "__main__":
    sys.exit(main())
