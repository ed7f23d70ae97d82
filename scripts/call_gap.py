"""The target's decoding calls timed one by one inside engines served in turn: does an engine's own work between
calls make its next call slower?

    python scripts/call_gap.py ART ar/fixed dspark/sps ngram/sps 'ar/fixed!burn300' [--passes 12] [--threads 2]

Opens one engine per METHOD/SCHEDULER (in one process, one request in flight), then serves two prompts of
datasets/mt-bench.jsonl through each engine in turn per pass (the order reversed every other pass) and records
the wall time of every call of the target's decoding bucket (B=1, T=1). `!burnUS` makes that engine spin on the host
for US microseconds before each target call (outside the timed call): host work of a known length between calls.
Prints each engine's median call per pass and, against the first engine, the median of the per-pass ratios. Only
ratios within one run mean anything on a machine whose speed drifts.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from specrt import artifact as io
from specrt.runtime.config import EngineConfig
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Tokenizer
from specrt.tools.concurrency import serve
from specrt.tools.profile import open_engine

ROOT = Path(__file__).resolve().parent.parent


def _timed_decodes(engine, burn_s: float) -> list[float]:
    """Wrap the engine's target runner: every decoding call's seconds go into the returned list."""
    run, calls = engine.target.run, []

    def timed(index, bucket, *args, **kw):
        if burn_s:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < burn_s:
                pass
        t0 = time.perf_counter()
        out = run(index, bucket, *args, **kw)
        if bucket.get("B") == 1 and bucket.get("T") == 1 and bucket.get("P", 1) == 1:
            calls.append(time.perf_counter() - t0)
        return out

    engine.target.run = timed
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("engines", nargs="+", help="METHOD/SCHEDULER[!burnUS], e.g. ar/fixed dspark/sps 'ar/fixed!burn300'")
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    manifest = io.load_manifest(args.art)
    tokenizer = Tokenizer.from_dir(args.art / io.TOKENIZER_DIR, manifest.tokenizer)
    prompts = [encode_prompt(tokenizer, t) for t in read_prompts_file(ROOT / "datasets" / "mt-bench.jsonl", 16)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engines = []
    for i, spec in enumerate(args.engines):
        body, _, burn = spec.partition("!burn")
        method, _, scheduler = body.partition("/")
        engine = open_engine(args.art, EngineConfig(method=method, scheduler=scheduler or "fixed",
                                                    threads=args.threads, slots=1))
        calls = _timed_decodes(engine, float(burn or 0) * 1e-6)
        serve(engine, prompts[:1], params, 1)  # warm-up
        engines.append((f"{i}:{spec}", engine, calls))
    medians: dict[str, list[float]] = {label: [] for label, _, _ in engines}
    for k in range(args.passes):
        chunk = [prompts[2 * k % len(prompts)], prompts[(2 * k + 1) % len(prompts)]]
        for label, engine, calls in (engines if k % 2 == 0 else engines[::-1]):
            calls.clear()
            serve(engine, chunk, params, 1)
            medians[label].append(1e3 * statistics.median(calls))
    first = engines[0][0]
    for label, _, _ in engines:
        ratios = [a / b for a, b in zip(medians[label], medians[first])]
        print(f"{label:28s} median call per pass (ms) {' '.join(f'{m:.2f}' for m in medians[label])}")
        print(f"{'':28s} / {first}: median ratio {statistics.median(ratios):.3f}, "
              f"{sum(r > 1 for r in ratios)} of {len(ratios)} passes above 1", flush=True)
    for _, engine, _ in engines:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
