#!/usr/bin/env python3
"""What a draft head's acceptance allows at batch 1: its best speed against `ar` on the artifact's profiled costs.

    python scripts/head_bound.py ART --prompts datasets/humaneval.jsonl [--prompts ...] [--head dspark]
                                 [--limit 6] [--max-new-tokens 256] [--threads 2] [--json]

Decodes the prompts greedily with the head drafting its whole block every round (`fixed`), which records how many
of its drafts each round accepted (greedy output does not depend on the drafts, so these are the head's own
acceptances on this text). Then, on the artifact's cost profile for --threads (`specrt profile ART`; a verify of t
tokens in decoding steps, and the head's draft call), it prices two kinds of schedule over the same rounds:

    k drafts    every round verifies k drafts (k = 0 is `ar`): what a scheduler without per-round information gets
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

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.config import EngineConfig
from specrt.runtime.profile import load_profile
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Tokenizer
from specrt.tools.concurrency import serve
from specrt.tools.profile import open_engine


def speeds(accepted: list[int], gamma: int, verify: dict[int, float], draft: float) -> dict:
    """Committed tokens per decoding step of each schedule over rounds that accepted `accepted[i]` of `gamma`
    drafts; verify[t]: a verify of t tokens in steps; draft: the head's call in steps."""
    fixed = []
    for k in range(gamma + 1):
        tokens = sum(min(a, k) + 1 for a in accepted)
        fixed.append(round(tokens / (len(accepted) * (verify[k + 1] + (draft if k else 0.0))), 3))
    oracle = sum(a + 1 for a in accepted) / sum(verify[a + 1] + (draft if a else 0.0) for a in accepted)
    return {"k_drafts": fixed, "best_k": max(range(gamma + 1), key=fixed.__getitem__), "oracle": round(oracle, 3)}


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
        engine = open_engine(args.art, EngineConfig(method=args.head, scheduler="fixed", threads=args.threads, slots=1))
    except SpecrtError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve(engine, prompts, SamplingParams(max_new_tokens=args.max_new_tokens), 1)
    gamma = engine.stats.gamma
    accepted = [a for verified, a, _ in engine.stats.rounds if verified == gamma]
    engine.close()
    step = profile.verify_ms(1, 1)
    verify = {t: profile.verify_ms(1, t) / step for t in range(1, gamma + 2)}
    draft = profile.draft_ms(args.head, 1) / step
    report = {"head": args.head, "rounds": len(accepted), "gamma": gamma,
              "tau_fixed": round(sum(a + 1 for a in accepted) / len(accepted), 3),
              "first_acceptance": round(sum(a >= 1 for a in accepted) / len(accepted), 3),
              "verify_steps": {t: round(v, 3) for t, v in verify.items()}, "draft_steps": round(draft, 3),
              "profiled_draft": speeds(accepted, gamma, verify, draft),
              "free_draft": speeds(accepted, gamma, verify, 0.0)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.head}: {len(accepted)} rounds of {gamma} drafts, tau {report['tau_fixed']}, first draft accepted "
          f"{report['first_acceptance']:.0%}; its draft call {draft:.2f} decoding steps")
    for label, key in (("at its profiled cost", "profiled_draft"), ("free", "free_draft")):
        s = report[key]
        print(f"  draft call {label:20s} k drafts every round (k = 0..{gamma}): {s['k_drafts']}  "
              f"best k {s['best_k']}; oracle {s['oracle']}x ar")
    return 0


if __name__ == "__main__":
    sys.exit(main())
