"""A speculative method under sps on an artifact's stored profile and on a stale-shaped copy of it, with this tree's
cost table and admission and with another revision's, interleaved in one process, beside `ar`.

    python scripts/stale_profile_ab.py ART --old-rev db30436^ [--methods dspark+ngram,dspark] [--passes 4]
        [--scale 1:1.21,2:1.35,3:1.37,4:1.03,5:1.04,6:1.05,7:1.06,8:1.06] [--draft-scale 1.18]

The stale copy (hard links to ART's files, a new profile.json) multiplies each batch-1 verify cell by --scale
and the draft calls by --draft-scale: by default the shape of 2026-12-06's stale Xeon profile against its fresh
one (a decoding step and 2-3 token verifies measured 21-37% dearer, 4-8 tokens right). The other revision's
runtime/steps.py and runtime/costs.py are loaded from git and patched in for its engines. Each configuration opens
an engine, warms up on one prompt, then generates 256 tokens for 6 humaneval and 6 mbpp prompts; passes alternate
the order. Prints each pass's tokens/s and the cost table's step before and after, then each configuration's median
and its ratios to the `ar` pass of the same round, and whether every output equals `ar`'s. This machine's speed
swings by 10-30% between passes: only differences larger than that mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from specrt.runtime import costs, engine as engine_mod, steps
from specrt.runtime.config import EngineConfig
from specrt.runtime.engine import Request
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def _module(rev: str, path: str, name: str) -> types.ModuleType:
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                            text=True).stdout
    mod = types.ModuleType(name)
    exec(compile(source, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def _stale(art: Path, out: Path, scale: dict[int, float], draft_scale: float) -> None:
    out.mkdir()
    for f in art.iterdir():
        if f.name != "profile.json":
            shutil.copytree(f, out / f.name) if f.is_dir() else os.link(f, out / f.name)
    prof = json.loads((art / "profile.json").read_text())
    for entry in prof["profiles"].values():
        row = entry["verify"]["1"]
        for t in row:
            row[t] = round(row[t] * scale.get(int(t), 1.0), 3)
        for head in entry["draft"].values():
            head["1"] = round(head["1"] * draft_scale, 3)
    (out / "profile.json").write_text(json.dumps(prof, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("--old-rev", required=True)
    ap.add_argument("--methods", default="dspark+ngram")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--scale", default="1:1.21,2:1.35,3:1.37,4:1.03,5:1.04,6:1.05,7:1.06,8:1.06")
    ap.add_argument("--draft-scale", type=float, default=1.18)
    args = ap.parse_args()
    old_steps = _module(args.old_rev, "runtime/steps.py", "steps_old")
    old_costs = _module(args.old_rev, "runtime/costs.py", "costs_old")
    code = {"new": (steps.admission, costs.CostTable), "old": (old_steps.admission, old_costs.CostTable)}
    texts = read_prompts_file(ROOT / "datasets/humaneval.jsonl", 6) + read_prompts_file(ROOT / "datasets/mbpp.jsonl", 6)
    with tempfile.TemporaryDirectory(dir=args.art.parent) as tmp:  # hard links: the same file system
        stale = Path(tmp) / "stale"
        _stale(args.art, stale, {int(k): float(v) for k, v in (p.split(":") for p in args.scale.split(","))},
               args.draft_scale)
        configs = [("ar", "fresh", "new")] + [(m, w, c) for m in args.methods.split(",")
                                              for w, c in (("fresh", "new"), ("stale", "old"), ("stale", "new"))]
        res: dict[tuple, list] = {c: [] for c in configs}
        for rep in range(args.passes):
            for c in configs if rep % 2 == 0 else configs[::-1]:
                method, which, rev = c
                steps.admission, engine_mod.CostTable = code[rev]  # schedulers call steps.admission at run time
                with Engine.open(args.art if which == "fresh" else stale,
                                 EngineConfig(method=method, scheduler="sps")) as engine:
                    ids = [encode_prompt(engine.tokenizer, t) for t in texts]
                    engine.generate([Request(prompt_ids=ids[0], params=SamplingParams(max_new_tokens=64))])
                    toks, secs, outs = 0, 0.0, []
                    for p in ids:
                        o, s = engine.generate([Request(prompt_ids=p, params=SamplingParams(max_new_tokens=256))])
                        d = s.to_dict()
                        toks += d["generated_tokens"]
                        secs += d["generated_tokens"] / d["decode_tokens_per_s"]
                        outs.append(o[0].output_ids)
                    table = engine.costs.describe() if engine.costs is not None else None
                res[c].append((toks / secs, outs))
                step = (table["initial"]["step_ms"], table["refined"]["step_ms"]) if table else None
                print(rep, c, f"{toks / secs:.1f} tok/s", f"table step {step}" if step else "", flush=True)
        steps.admission, engine_mod.CostTable = code["new"]
    base = res[configs[0]]
    for c in configs:
        ratios = [round(r[0] / a[0], 3) for r, a in zip(res[c], base)]
        print(c, f"median {statistics.median(r[0] for r in res[c]):.1f} tok/s", "x ar", ratios,
              "identical", all(r[1] == base[0][1] for r in res[c]))


if __name__ == "__main__":
    sys.exit(main())
