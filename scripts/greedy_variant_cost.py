"""What the greedy variants of the draft graphs save: each head's propose call, full graph against greedy variant.

    python scripts/greedy_variant_cost.py [ART] [--threads N]   # default art/b1, 2 threads

Times both variants of every head at batch 1 with one and two new context rows, interleaved call by call (this
machine's speed drifts), and prints medians in ms and as a fraction of the plain decoding step measured the same
way.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.runtime.backends import load_runner
from specrt.runtime.calls import for_head
from specrt.runtime.measure import _fill_draft, _fill_target


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("art", nargs="?", default="art/b1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    art = Path(args.art)
    manifest = io.load_manifest(art)
    target = load_runner("ort", art, manifest, io.TARGET, threads=args.threads, spin=True)
    target.allocate(1)
    step = target.spec.bucket("decode", B=1)
    _fill_target(target.inputs(0, step), 128, 100)
    calls = {"step": lambda: target.run(0, step)}
    for name in manifest.heads:
        runner = load_runner("ort", art, manifest, name, threads=args.threads, spin=False)
        runner.allocate(1)
        for rows in (1, 2):
            bucket = runner.spec.bucket("propose", B=1, C=rows)
            for greedy in (False, True):
                _fill_draft(for_head(manifest.heads[name].kind), runner.inputs(0, bucket, greedy=greedy), 128,
                            rows, 100)
                calls[f"{name} C={rows} {'greedy' if greedy else 'full'}"] = (
                    lambda r=runner, b=bucket, g=greedy: r.run(0, b, greedy=g))
    times = {k: [] for k in calls}
    for rep in range(args.repeats):
        for key, call in calls.items():
            t0 = time.perf_counter()
            call()
            if rep >= 5:  # warm-up
                times[key].append(time.perf_counter() - t0)
    step_ms = float(np.median(times["step"])) * 1e3
    for key, ts in times.items():
        ms = float(np.median(ts)) * 1e3
        print(f"{key:24s} {ms:7.3f} ms  {ms / step_ms:6.3f} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
