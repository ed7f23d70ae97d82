"""Generate the training corpus's responses: the default model's own greedy responses to every training prompt
(the eval files' spare rows and datasets/corpus/), on the batched engine and specrt's kernels, resumable.

    python scripts/corpus_generate.py [--work ~/.cache/specrt/corpus] [--max-new-tokens 256] [--limit N]

Exports the default model (the demo's format and kernels, 16 slots, no heads) into WORK/target-b16 once, then
appends one line per finished prompt to WORK/greedy-<max_new_tokens>.jsonl (distill/generate.py: a rerun with the
same settings skips what is written; a progress bar shows the rate). Measured on the 2-core machine: ~300 response
tokens/s at 16 slots (242 at the demo artifact's 4).
"""
import argparse
import dataclasses
import json
import time
from pathlib import Path

from specrt.configs.fetch import cache_dir
from specrt.configs.presets import default_settings, resolve_model
from specrt.datasets import DATASETS_DIR
from specrt.distill.generate import generate_responses, read_responses
from specrt.distill.prompts import dataset_files, training_prompts
from specrt.exporter.export import export_artifact

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--work", type=Path, default=cache_dir() / "corpus")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--limit", type=int, default=None, help="at most N prompts, spread evenly over the files")
args = parser.parse_args()

art = args.work / "target-b16"
if not (art / "manifest.json").is_file():
    settings = dataclasses.replace(default_settings(), batch=16, max_seq=768, draft_vocab=0)
    export_artifact(resolve_model("smollm2"), art, settings)
files = [p.stem for p in dataset_files()]
corpus = sorted((DATASETS_DIR / "corpus").glob("*.jsonl.gz"))
split = training_prompts(files=files, prompt_files=corpus, limit=args.limit)
out = args.work / f"greedy-{args.max_new_tokens}.jsonl"
t0 = time.perf_counter()
before = sum(len(r["response_ids"]) for r in read_responses(out))
generate_responses(art, list(split.prompts), out, max_new_tokens=args.max_new_tokens, threads=2)
rows = read_responses(out)
tokens = sum(len(r["response_ids"]) for r in rows)
print(json.dumps({"prompts": len(split.prompts), "done": len(rows), "response_tokens": tokens,
                  "tokens_per_s_this_run": round((tokens - before) / (time.perf_counter() - t0), 1)}))
