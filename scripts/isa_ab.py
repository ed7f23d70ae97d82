#!/usr/bin/env python3
"""What the kernels' instruction set is worth on this CPU: the target's calls with AVX2 forced against the best.

    python scripts/isa_ab.py ART [--isas avx2,best] [--tokens 1,2,4,8] [--position 128] [--repeats 15] [--json]
    python scripts/isa_ab.py ART --libs OLD.so,NEW.so [--cache 512] [...]

Opens the artifact's target once per instruction set in one process (specrt's kernels read $SPECRT_OPS_ISA when a
session makes them: "best" leaves them the best this CPU runs, see gguf_kernels.h), or with --libs once per build of
libspecrt_ops (each session registers its own copy of the library, $SPECRT_OPS_LIB: two builds of the kernels, e.g. a
commit's and the working tree's, paired on one machine in one process), then times a batch-1 call over
each number of tokens (1: the decoding step; more: a packed verify) on every session in turn, the order reversed
every repetition, 5 calls a turn. Neither session's threads spin after a call (each would take the cores the other
needs next), so absolute times are above an engine's; the ratios are what the instruction set changes. Prints each
session's median calls, each as a multiple of its call over the first --tokens count (a decoding step by default),
then each set's paired median ratio to the first set's. `--cache N`: each session's cache first grown to hold N
positions (one call at position N - the largest --tokens), as an engine's runtime-sized cache is after a longer
request and stays; the calls are then timed at --position, as a shorter request's are.
Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.runtime.backends import load_runner
from specrt.runtime.measure import _fill_target

ISA_ENV = "SPECRT_OPS_ISA"
LIB_ENV = "SPECRT_OPS_LIB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("--isas", default="avx2,best", help="instruction sets (scalar, avx2, avx512vnni, best)")
    ap.add_argument("--libs", help="instead of --isas: comma-separated builds of libspecrt_ops.so to compare")
    ap.add_argument("--tokens", default="1,2,4,8", help="tokens per call (1: a decoding step)")
    ap.add_argument("--position", type=int, default=128)
    ap.add_argument("--cache", type=int, default=0, help="grow each cache to N positions first (0: as the calls need)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    env, isas = (LIB_ENV, args.libs.split(",")) if args.libs else (ISA_ENV, args.isas.split(","))
    if args.libs:
        for lib in isas:
            if not Path(lib).is_file():
                print(f"error: --libs: {lib} is not a file", file=sys.stderr)
                return 2
        if len(set(isas)) != len(isas):
            print("error: --libs names one library twice (copy it to compare a build with itself)", file=sys.stderr)
            return 2
    manifest = io.load_manifest(args.art)
    runners = {}
    for isa in isas:
        if isa == "best":
            os.environ.pop(env, None)
        else:
            os.environ[env] = isa
        runners[isa] = load_runner("ort", args.art, manifest, io.TARGET, threads=args.threads, spin=False)
        runners[isa].allocate(1)
    os.environ.pop(env, None)
    spec = runners[isas[0]].spec
    buckets = {p: spec.bucket("decode", B=1) if p == 1 else spec.bucket("verify", B=1, T=p, P=p) for p in tokens}
    for r in runners.values():
        if args.cache:
            p = max(tokens)
            _fill_target(r.inputs(0, buckets[p]), args.cache - p, 100)
            r.run(0, buckets[p])
        for p, b in buckets.items():
            _fill_target(r.inputs(0, b), args.position, 100)
            r.run(0, b)  # warm-up: first-use allocations, cache growth
    times = {(isa, p): [] for isa in isas for p in tokens}
    for k in range(args.repeats):
        for isa in isas if k % 2 == 0 else isas[::-1]:
            for p, b in buckets.items():
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    runners[isa].run(0, b)
                    ts.append(time.perf_counter() - t0)
                times[(isa, p)].append(float(np.median(ts)) * 1e3)
    ms = {isa: {p: float(np.median(times[(isa, p)])) for p in tokens} for isa in isas}
    ratio = {isa: {p: float(np.median(np.array(times[(isa, p)]) / np.array(times[(isas[0], p)]))) for p in tokens}
             for isa in isas[1:]}
    if args.json:
        print(json.dumps({"position": args.position, "cache": args.cache, "threads": args.threads,
                          "repeats": args.repeats, "ms": ms, "ratio_to_first": ratio}))
        return 0
    for isa in isas:
        m = ms[isa]
        print(f"{Path(isa).name if args.libs else isa:10s} " + "  ".join(f"{p} tok {m[p]:6.2f} ms" for p in tokens)
              + f"   in calls of {tokens[0]} token: " + " ".join(f"{m[p] / m[tokens[0]]:.2f}" for p in tokens))
    for isa, r in ratio.items():
        name, first = (Path(isa).name, Path(isas[0]).name) if args.libs else (isa, isas[0])
        print(f"{name} / {first} (paired medians): " + "  ".join(f"{p} tok {r[p]:.3f}" for p in tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
