"""Time the target's calls of several artifacts (or of one artifact under other settings) side by side in one process.

    python scripts/step_ab.py ART_A ART_B [...] [--tokens 1,2,4,8] [--rounds 8] [--position 300]
    python scripts/step_ab.py SPECRT_OPS_HUGEPAGES=1:ART SPECRT_OPS_HUGEPAGES=0:ART ...

Each argument is an artifact directory, optionally prefixed by NAME=VALUE: (an environment variable set while its
engine is created: libspecrt_ops reads SPECRT_OPS_HUGEPAGES and SPECRT_OPS_ISA when a session is made). Every engine
prefills the same random tokens to `--position`, then in each round each engine in turn times 30 calls of T tokens
(batch 1) at that position, for every T. Prints the median milliseconds of a call and its cost in decoding steps.
This machine's speed drifts and which session was created first matters, so only same-run differences mean
anything: give an engine twice, first and last, to see the order's effect.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from specrt import artifact as io
from specrt.runtime.backends import infer
from specrt.runtime.config import EngineConfig
from specrt.runtime.engine import Engine


def _open(spec: str, threads: int) -> Engine:
    env, _, path = spec.partition(":") if "=" in spec.split(":", 1)[0] else ("", "", spec)
    old = {}
    if env:
        name, value = env.split("=", 1)
        old[name] = os.environ.get(name)
        os.environ[name] = value
    try:
        return Engine(path, EngineConfig(threads=threads))
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _feeds(ids: np.ndarray, start: int, logits: int) -> dict[str, np.ndarray]:
    n = ids.shape[1]
    return {io.INPUT_IDS: ids, io.POSITION_IDS: np.arange(start, start + n)[None], io.WRITE_INDEX: np.array([start]),
            io.TOKEN_ROWS: np.arange(n), io.LOGIT_ROWS: np.arange(logits)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arts", nargs="+")
    ap.add_argument("--tokens", default="1,2,4,8", help="call sizes T, comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--position", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    engines = [_open(a, args.threads) for a in args.arts]
    prompt = np.random.default_rng(0).integers(3, 40000, size=args.position)
    for e in engines:
        r = e.target
        r.allocate(max(r.slots, 1))
        chunk = r.spec.bucket("prefill")["T"]
        for s in range(0, args.position - chunk + 1, chunk):
            infer(r, 0, _feeds(prompt[None, s:s + chunk], s, 1))
    times = {(i, t): [] for i in range(len(engines)) for t in sizes}
    for _ in range(args.rounds):
        for i, e in enumerate(engines):
            for t in sizes:
                feeds = _feeds(np.full((1, t), 77), args.position, t)
                for _ in range(3):
                    infer(e.target, 0, feeds)
                for _ in range(30):
                    start = time.perf_counter()
                    infer(e.target, 0, feeds)
                    times[(i, t)].append(time.perf_counter() - start)
    print(f"target calls at position {args.position}, batch 1, {args.threads} threads "
          f"(median of {args.rounds} interleaved rounds of 30 calls)")
    for i, a in enumerate(args.arts):
        ms = {t: float(np.median(times[(i, t)])) * 1e3 for t in sizes}
        print(f"  {a}: " + "  ".join(f"T={t} {ms[t]:.2f} ms ({ms[t] / ms[sizes[0]]:.2f})" for t in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
