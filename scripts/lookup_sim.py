"""What n-gram lookups could give on an artifact's own greedy text: rounds, τ and modelled cost, offline.

    python scripts/lookup_sim.py ART [--prompts FILE.jsonl ...] [--limit 6] [--max-new-tokens 256]
                                 [--ngram 1,2,3,4,6] [--cap 2,4,7] [--json]

Decodes each prompt with `ar` (greedy), then replays the text round by round for every (n, cap): the lookup
(runtime/drafters.py `lookup`, the longest suffix up to n tokens) proposes up to `cap` drafts, the longest prefix
equal to the greedy text is accepted, one bonus token follows. A round costs the artifact's stored profile's
verify of 1 + drafts tokens at batch 1, in decoding steps. Greedy output does not depend on the drafts, so this is
exactly the τ a fixed-length lookup would reach; the cost is the profile's, not a timing. `speedup` is tokens per
modelled step (ar: 1). The bench's `sps` picks its lengths per round and can do better than any fixed cap.

`--by-match` adds, per set at the first n: each draft position's acceptance by the length of the suffix the lookup
matched, and the modelled speed of a policy that verifies the k drafts maximizing (1 + survivals) / cost, with one
survival curve for all lookups (as the hybrid's acceptance history) or one per match length (in-sample curves: an
upper bound on what conditioning on the match could give).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.runtime.drafters import lookup, lookup_match
from specrt.runtime.engine import Engine, Request
from specrt.runtime.profile import ceil_key, load_profile
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SETS = [ROOT / "datasets" / f"{s}.jsonl" for s in ("humaneval", "mbpp", "gsm8k", "math500", "mt-bench")]


def replay(prompt: list[int], out: list[int], max_n: int, cap: int, steps_of: dict[int, float]) -> tuple[int, float]:
    """(rounds, modelled steps) to produce out[1:] (out[0] comes from prefill) with lookups of up to `cap` drafts."""
    seq = np.asarray(prompt + out, np.int64)
    pos, end, rounds, cost = len(prompt) + 1, len(prompt) + len(out), 0, 0.0
    while pos < end:
        drafts = lookup(seq[:pos], max_n, cap)
        a = 0
        while a < len(drafts) and pos + a < end and drafts[a] == seq[pos + a]:
            a += 1
        rounds, cost, pos = rounds + 1, cost + steps_of[len(drafts) + 1], pos + a + 1
    return rounds, cost


def by_match(texts: list[tuple[list[int], list[int]]], max_n: int, cap: int, steps_of: dict[int, float]) -> dict:
    """Acceptance by match length, and the modelled speed of admission on one survival curve or one per length."""
    def rounds(policy):
        for prompt, out in texts:
            seq = np.asarray(prompt + out, np.int64)
            pos, end = len(prompt) + 1, len(prompt) + len(out)
            while pos < end:
                drafts, m = lookup_match(seq[:pos], max_n, cap)
                full = 0
                while full < len(drafts) and pos + full < end and drafts[full] == seq[pos + full]:
                    full += 1
                k = policy(m, len(drafts))
                yield m, len(drafts), full, k
                pos += min(full, k) + 1

    seen: dict[int, list[tuple[int, int]]] = {}
    for m, offered, full, _ in rounds(lambda m, offered: offered):
        if offered:
            seen.setdefault(m, []).append((offered, full))

    def curve(obs):
        return np.array([np.mean([f > i for o, f in obs if o > i]) if any(o > i for o, _ in obs) else 0.0
                         for i in range(cap)])
    curves = {m: curve(obs) for m, obs in seen.items()}
    overall = curve([x for obs in seen.values() for x in obs])

    def admit(a: np.ndarray, offered: int) -> int:
        rates = [(1 + a[:k].sum()) / steps_of[k + 1] for k in range(offered + 1)]
        return int(np.argmax(rates))

    out = {"acceptance_by_match": {m: {"rounds": len(seen[m]), "survival": [round(x, 3) for x in curves[m][:4]]}
                                   for m in sorted(seen)}}
    policies = {"one_curve": lambda m, offered: admit(overall, offered),
                "per_match": lambda m, offered: admit(curves.get(m, overall), offered)}
    for name, pick in policies.items():
        tokens = cost = n = 0
        for _, _, full, k in rounds(pick):
            tokens, cost, n = tokens + min(full, k) + 1, cost + steps_of[k + 1], n + 1
        out[name] = {"tau": round(tokens / n, 3), "speedup": round(tokens / cost, 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("--prompts", type=Path, nargs="+", default=SETS)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--ngram", default="1,2,3,4,6")
    ap.add_argument("--cap", default="2,4,7")
    ap.add_argument("--by-match", action="store_true", help="Acceptance by match length and two admission policies.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    profile = load_profile(args.art)
    if profile is None:
        sys.exit(f"error: {args.art} stores no cost profile (run `specrt profile {args.art}`)")
    row = profile.verify[ceil_key(profile.verify, 1)]
    caps = [int(c) for c in args.cap.split(",")]
    steps_of = {t: row[ceil_key(row, t)] / row[min(row)] for t in range(1, max(caps) + 2)}
    manifest = io.load_manifest(args.art)
    tokenizer = Tokenizer.from_dir(args.art / io.TOKENIZER_DIR, manifest.tokenizer)
    results = []
    with Engine(args.art, method="ar") as engine:
        for path in args.prompts:
            prompts = [list(encode_prompt(tokenizer, t)) for t in read_prompts_file(path, args.limit)]
            params = SamplingParams(max_new_tokens=args.max_new_tokens)
            outs, _ = engine.generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
            for n in (int(x) for x in args.ngram.split(",")):
                for cap in caps:
                    rounds = cost = tokens = 0
                    for p, o in zip(prompts, outs):
                        r, c = replay(p, list(o.output_ids), n, cap, steps_of)
                        rounds, cost, tokens = rounds + r, cost + c, tokens + len(o.output_ids) - 1
                    results.append({"set": path.stem, "ngram": n, "cap": cap, "tau": round(tokens / rounds, 3),
                                    "steps_per_token": round(cost / tokens, 3), "speedup": round(tokens / cost, 3)})
                    if not args.json:
                        r = results[-1]
                        print(f"{r['set']:10s} n {n} cap {cap}: τ {r['tau']:.3f}  steps/token "
                              f"{r['steps_per_token']:.3f}  speedup {r['speedup']:.3f}", flush=True)
            if args.by_match:
                n = int(args.ngram.split(",")[0])
                m = by_match([(p, list(o.output_ids)) for p, o in zip(prompts, outs)], n, max(caps), steps_of)
                results.append({"set": path.stem, "ngram": n, "cap": max(caps), "by_match": m})
                if not args.json:
                    print(f"{path.stem:10s} n {n} by match length: {json.dumps(m)}", flush=True)
    if args.json:
        print(json.dumps({"art": str(args.art), "verify_steps": steps_of, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
