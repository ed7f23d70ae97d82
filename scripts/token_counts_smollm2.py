"""Token counts for the shipped SmolLM2 heads (specrt/heads/smollm2/token_counts.npy), for `--draft-vocab`.

    python scripts/token_counts_smollm2.py [--work work/token-counts]

The heads were distilled before `specrt distill` wrote token counts, so this regenerates the target's
greedy responses to the same training split as scripts/distill_smollm2.sh (720 prompts, seed 0, 256 new
tokens; the first 20 rows of every dataset file are never used) and counts the tokens of the "train"
prompts' responses. It generates on the default gguf artifact (the heads were distilled on the fp32
dequantization, so a few responses differ in their tails; the counts are a frequency estimate either way).
Resumable: responses go to WORK/responses.jsonl as they finish.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from specrt.configs.presets import resolve_model
from specrt.distill.data import generate_responses, read_responses, training_prompts
from specrt.exporter.vocab import COUNTS_FILE, count_tokens, coverage, draft_vocab, write_counts
from specrt.exporter.export import export_artifact
from specrt import artifact as io

DATASETS = [f"datasets/{n}.jsonl" for n in ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("work/token-counts"))
    ap.add_argument("--out", type=Path, default=Path("specrt/heads/smollm2") / COUNTS_FILE)
    args = ap.parse_args()
    split = training_prompts(prompt_files=[Path(f) for f in DATASETS], limit=720, calib_fraction=0.1, seed=0)
    art = args.work / "target"
    if not (art / io.MANIFEST).is_file():
        settings = io.ExportSettings(batch=8, max_seq=768, prefill_chunk=64, verify_len=1, weights="gguf",
                                     attention="cpu")
        export_artifact(resolve_model("smollm2"), art, settings, force=True)
    out = generate_responses(art, split.prompts, args.work / "responses.jsonl", max_new_tokens=256,
                             sampling="greedy", seed=0)
    rows = read_responses(out)
    train = set(split.train)
    counts = count_tokens((r["response_ids"] for r in rows if r["index"] in train), 49152)
    write_counts(args.out, counts)
    print(f"{args.out}: {int(counts.sum())} tokens from {len(train)} responses, {int((counts > 0).sum())} distinct")
    for n in (1024, 2048, 4096, 8192, 16384):
        print(f"  top {n:5d}: {coverage(counts, draft_vocab(counts, n)):.4f} of the tokens")


if __name__ == "__main__":
    main()
