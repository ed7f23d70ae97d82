"""Generate the training corpus's responses: the default model's own responses to every training prompt, on the
batched engine and specrt's kernels, resumable.

    python scripts/corpus_generate.py --part base|chat|followups [--sampling greedy|deepspec] [--seed S]
                                      [--work ~/.cache/specrt/corpus] [--max-new-tokens 256] [--limit N]

Parts (datasets/corpus/README.md): base, the eval files' spare rows then the code sets (stdlib, numpy); chat, the
chat sets (careers, world); followups, the multi-turn set. Exports the default model (the demo's format and kernels,
16 slots, no heads) into WORK/target-b16 once, then appends one line per finished prompt to
WORK/<part>-<sampling>-<max_new_tokens>.jsonl (distill/generate.py: a rerun with the same settings skips what is
written; a progress bar shows the rate). Measured on the 2-core machine at 16 slots: ~325 response tokens/s
greedy, ~290 sampled.
"""
import argparse
import dataclasses
import json
import time
from pathlib import Path

from specrt.configs.fetch import cache_dir
from specrt.configs.presets import default_settings, resolve_model
from specrt.distill.generate import SAMPLING, generate_responses, read_responses
from specrt.distill.sources import PARTS, part_prompts
from specrt.exporter.export import export_artifact

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--part", choices=sorted(PARTS), required=True)
parser.add_argument("--work", type=Path, default=cache_dir() / "corpus")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--limit", type=int, default=None, help="at most N prompts, spread evenly over the files")
parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                    help="greedy, or DeepSpec's T=0.7/top-p 0.8/top-k 20 (each prompt seeded with --seed + its index)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

art = args.work / "target-b16"
if not (art / "manifest.json").is_file():
    settings = dataclasses.replace(default_settings(), batch=16, max_seq=768, draft_vocab=0)
    export_artifact(resolve_model("smollm2"), art, settings)
split = part_prompts(args.part, limit=args.limit)
name = f"{args.part}-{args.sampling}-{args.max_new_tokens}" + (f"-seed{args.seed}" if args.seed else "")
out = args.work / f"{name}.jsonl"
t0 = time.perf_counter()
before = sum(len(r["response_ids"]) for r in read_responses(out))
generate_responses(art, list(split.prompts), out, max_new_tokens=args.max_new_tokens,
                   sampling=args.sampling, seed=args.seed, threads=2)
rows = read_responses(out)
tokens = sum(len(r["response_ids"]) for r in rows)
print(json.dumps({"part": args.part, "prompts": len(split.prompts), "done": len(rows), "response_tokens": tokens,
                  "tokens_per_s_this_run": round((tokens - before) / (time.perf_counter() - t0), 1)}))
