"""Where an engine's time goes under requests in flight: graph calls (target, head) against the host's own work.

    python scripts/host_time.py ART ar/fixed dspark/sps dspark+ngram/sps 'ar/fixed!burn300' [--concurrency 1]
                                [--prompts FILE.jsonl] [--limit 8] [--max-new-tokens 128] [--passes 4]

Opens one engine per METHOD/SCHEDULER (in the order given), warms each up, then serves the prompts through every
engine in turn for --passes passes (the order reversed every other pass, so a drift of the machine's speed falls on
each alike), printing per engine and pass: tokens/s, rounds (steps), the target's and the head's graph calls and
their time, the median of the target's decoding calls (one token per slot), and the host's time per step (wall time
minus every graph call's). Then, per engine, the median over the passes of its decoding call's median against the
first engine's: whether an engine's calls of the same graph are slower. `!burnUS` makes that engine spin on the host
for US microseconds before each target call (outside its timed call): host work of a known length between calls.
Only differences within one run mean anything on a machine whose speed drifts.
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
from specrt.runtime.engine import Engine

ROOT = Path(__file__).resolve().parent.parent


def _timed(runner, acc: list, decodes: list | None = None, burn_s: float = 0.0) -> None:
    """Count the runner's graph calls and their seconds into acc = [calls, seconds], and each decoding call's seconds
    into `decodes`; spin `burn_s` seconds on the host before each call."""
    run = runner.run

    def timed(index, bucket, *args, **kw):
        if burn_s:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < burn_s:
                pass
        t0 = time.perf_counter()
        out = run(index, bucket, *args, **kw)
        seconds = time.perf_counter() - t0
        acc[0] += 1
        acc[1] += seconds
        if decodes is not None and bucket.get("T") == 1 and bucket.get("P", bucket["B"]) == bucket["B"]:
            decodes.append(seconds)
        return out

    runner.run = timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("engines", nargs="+", help="METHOD/SCHEDULER, e.g. ar/fixed dspark/sps")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=Path, default=ROOT / "datasets" / "mt-bench.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    manifest = io.load_manifest(args.art)
    tokenizer = Tokenizer.from_dir(args.art / io.TOKENIZER_DIR, manifest.tokenizer)
    prompts = [encode_prompt(tokenizer, t) for t in read_prompts_file(args.prompts, args.limit)]
    params, c = SamplingParams(max_new_tokens=args.max_new_tokens), args.concurrency
    engines = []
    for i, spec in enumerate(args.engines):
        body, _, burn = spec.partition("!burn")
        method, _, scheduler = body.partition("/")
        engine = Engine.open(args.art, EngineConfig(method=method, scheduler=scheduler or "fixed",
                                                    threads=args.threads, slots=c))
        calls = {"target": [0, 0.0], "head": [0, 0.0], "decodes": []}
        _timed(engine.target, calls["target"], calls["decodes"], float(burn or 0) * 1e-6)
        head = getattr(engine.drafter, "head", None)  # a graph drafter's head, alone or inside the hybrid
        runner = getattr(head, "runner", None) or getattr(engine.drafter, "runner", None)
        if runner is not None:
            _timed(runner, calls["head"])
        serve(engine, prompts[:c], params, c)  # warm-up
        engines.append((f"{i}:{spec}", engine, calls))
    medians: dict[str, list[float]] = {label: [] for label, _, _ in engines}  # each pass's median decoding call
    for k in range(args.passes):
        for label, engine, calls in (engines if k % 2 == 0 else engines[::-1]):
            calls["target"][:], calls["head"][:], calls["decodes"][:] = [0, 0.0], [0, 0.0], []
            row, _ = serve(engine, prompts, params, c)
            steps = engine.stats.steps
            (tn, ts), (hn, hs) = calls["target"], calls["head"]
            host = row["wall_s"] - ts - hs
            medians[label].append(1e3 * statistics.median(calls["decodes"]) if calls["decodes"] else float("nan"))
            print(f"pass {k} {label:22s} {row['tokens_per_s']:7.1f} tok/s  steps {steps:5d}  target {tn:5d} calls "
                  f"{ts:6.2f} s ({1e3 * ts / max(tn, 1):.2f} ms, decoding {medians[label][-1]:.2f})  head {hn:4d} "
                  f"calls {hs:6.3f} s  host {1e3 * host / max(steps, 1):.3f} ms/step", flush=True)
    first = engines[0][0]
    for label, _, _ in engines[1:]:
        ratios = [a / b for a, b in zip(medians[label], medians[first])]
        print(f"{label:22s} decoding call / {first}'s: median ratio {statistics.median(ratios):.3f}, "
              f"{sum(r > 1 for r in ratios)} of {len(ratios)} passes above 1")
    for _, engine, _ in engines:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
