"""How noisy is a requests-in-flight row? Serve the same prompts twice per configuration, interleaved.

    python scripts/c8_repeat_check.py [ART]   # ART exported with --batch 8 (default art/b8)

Prints, per repetition: method, scheduler, aggregate tokens/s, mean verify length, wall seconds, with 8 requests
in flight over the first 8 prompts of humaneval and gsm8k, 64 new tokens each (as the README's concurrency table).
"""
from __future__ import annotations

import sys
from pathlib import Path

from specrt.tools.concurrency import serve
from specrt.runtime.engine import Engine
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = (("ar", "fixed"), ("ngram", "sps"), ("dspark", "sps"))


def main() -> int:
    art = sys.argv[1] if len(sys.argv) > 1 else "art/b8"
    tokenizer = Engine(art).tokenizer
    prompts = [encode_prompt(tokenizer, t) for name in ("humaneval", "gsm8k")
               for t in read_prompts_file(ROOT / "datasets" / f"{name}.jsonl", 8)]
    params = SamplingParams(max_new_tokens=64)
    for rep in range(2):
        for method, scheduler in CONFIGS:
            engine = Engine(art, method=method, scheduler=scheduler, threads=2, slots=8)
            row, _ = serve(engine, prompts, params, 8)
            print(rep, method, scheduler, row["tokens_per_s"], row["mean_verify_len"], row["wall_s"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
