#!/usr/bin/env python3
"""Where a decoding step's and a verify's time can go at best on this machine: the memory floor and the kernels' floor.

    python scripts/roofline.py ART [--threads 2] [--rows 1,2,4,8] [--json]

A call of the target over M token rows reads every MatMulGGUF weight of the graph once, whatever M (specrt's kernels
tile so; gguf_kernels.h), and does M rows of integer dot products over them. So it takes at least

    memory floor   the graph's weight bytes / this machine's read bandwidth (numpy reductions over a buffer far
                   larger than the caches, --threads threads, best of 7), and
    kernel floor   the sum over the graph's MatMulGGUF nodes of one node's time at M rows, each distinct shape timed
                   alone and called again and again so that its weights stay in the cache as far as they fit (all
                   but the LM head's fit in L2 or L3), less an empty call's time (the lowest of 3 medians of
                   --calls calls each),

and the larger of the two is the bound. The target's attention, norms and other nodes come on top. Beside them:
the call as `specrt profile` times it, in the same run (the decoding step at batch 1 and the verify of M
tokens; nothing is written to the artifact). The ratio `bound / step` is the verify cost in decoding steps
that no kernel of this instruction set can beat by tiling alone. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from gguf import GGMLQuantizationType
from gguf.quants import quantize
from specrt.blocks import KERNEL_TYPES
from specrt.native import ops_library


def read_bandwidth(threads: int, mib: int = 512) -> float:
    """Bytes per second that `threads` threads read from memory (the best of 7 passes over `mib` MiB)."""
    buf = np.ones((mib << 20) // 8, np.int64)
    parts = np.array_split(buf, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(7):
            t0 = time.perf_counter()
            list(pool.map(np.bitwise_or.reduce, parts))  # numpy releases the GIL for the reduction
            best = max(best, buf.nbytes / (time.perf_counter() - t0))
    return best


def matmuls(art: Path) -> tuple[Counter, int]:
    """The target graph's MatMulGGUF nodes as a Counter of (format, K, N), and their weights' bytes."""
    model = onnx.load(str(art / "target.onnx"), load_external_data=False)
    nodes = Counter()
    for n in model.graph.node:
        if n.op_type == "MatMulGGUF":
            at = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            nodes[(at["format"].decode(), at["K"], at["N"])] += 1
    return nodes, sum(c * n * k // KERNEL_TYPES[f][0] * KERNEL_TYPES[f][1] for (f, k, n), c in nodes.items())


def _session(nodes, inits, k: int, n: int, threads: int, lib: str) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "roofline", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("specrt", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _median_s(s: ort.InferenceSession, a: dict, calls: int) -> float:
    for _ in range(5):
        s.run(None, a)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        s.run(None, a)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def node_us(fmt: str, k: int, n: int, rows: list[int], threads: int, calls: int, lib: str) -> dict[int, float]:
    """Microseconds one MatMulGGUF node of this shape takes at each M, called again and again (its weights stay in
    the cache as far as they fit), less what a call of a graph that only copies its input takes (the call's own
    overhead)."""
    rng = np.random.default_rng(0)
    try:
        raw = np.ascontiguousarray(quantize(rng.normal(size=(n, k)).astype(np.float32) * 0.05,
                                            getattr(GGMLQuantizationType, fmt)))
    except NotImplementedError:  # gguf has no quantizer for the K-quants: random blocks of the size (every byte
        elems, size = KERNEL_TYPES[fmt]  # pattern is a block; the time does not depend on the values)
        raw = rng.integers(0, 256, size=(n, k // elems * size), dtype=np.uint8)
    op = _session([helper.make_node("MatMulGGUF", ["A", "W"], ["Y"], domain="specrt", format=fmt, K=k, N=n)],
                  [numpy_helper.from_array(raw, "W")], k, n, threads, lib)
    empty = _session([helper.make_node("Identity", ["A"], ["Y"])], [], k, k, threads, lib)
    out = {}
    for m in rows:
        a = {"A": rng.normal(size=(m, k)).astype(np.float32)}
        # the lowest of 3 medians, each session in turn: the least disturbed estimate on a machine shared with others
        t_op = min(_median_s(op, a, calls) for _ in range(3))
        t_empty = min(_median_s(empty, a, calls) for _ in range(3))
        out[m] = max(0.0, t_op - t_empty) * 1e6
    return out


def measured(art: Path, threads: int) -> dict[int, float]:
    """The target's calls at batch 1 as `specrt profile` times them, in this run (ms per M tokens)."""
    from specrt.runtime.measure import measure

    return {int(t): float(ms) for t, ms in measure(art, threads=threads, repeats=3, progress=False).verify[1].items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.art / "target.onnx").is_file():
        print(f"error: {args.art} has no target.onnx (not an artifact?)", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    nodes, weight_bytes = matmuls(args.art)
    if not nodes:
        print(f"error: {args.art}'s target graph has no specrt::MatMulGGUF (export with --kernels specrt)",
              file=sys.stderr)
        return 2
    lib = str(ops_library("target.onnx"))
    bandwidth = read_bandwidth(args.threads)
    memory_ms = weight_bytes / bandwidth * 1e3
    per_shape = {key: node_us(*key, rows, args.threads, args.calls, lib) for key in nodes}
    kernel_ms = {m: sum(c * per_shape[key][m] for key, c in nodes.items()) / 1e3 for m in rows}
    calls = measured(args.art, args.threads)
    step = calls.get(1)
    table = []
    for m in rows:
        bound = max(memory_ms, kernel_ms[m])
        table.append({"M": m, "memory_floor_ms": round(memory_ms, 2), "kernel_floor_ms": round(kernel_ms[m], 2),
                      "bound_ms": round(bound, 2), "profiled_ms": calls.get(m),
                      "bound_steps": round(bound / step, 2) if step else None,
                      "profiled_steps": round(calls[m] / step, 2) if step and m in calls else None})
    report = {"threads": args.threads, "weight_bytes": weight_bytes, "read_gb_s": round(bandwidth / 1e9, 1),
              "nodes": [{"format": f, "K": k, "N": n, "count": c, "us": {str(m): round(per_shape[(f, k, n)][m], 1)
                                                                        for m in rows}}
                        for (f, k, n), c in nodes.items()],
              "rows": table}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{weight_bytes / 1e6:.1f} MB of MatMulGGUF weights per call; this machine reads {bandwidth / 1e9:.1f} GB/s "
          f"on {args.threads} threads")
    for (f, k, n), c in nodes.items():
        cells = "  ".join(f"M={m}: {per_shape[(f, k, n)][m]:.1f}" for m in rows)
        print(f"  {c:3d} x {f} {n}x{k}  us per node, weights cached: {cells}")
    print(f"{'M':>3s} {'memory floor':>13s} {'kernel floor':>13s} {'bound':>8s} {'profiled':>9s} "
          f"{'bound/step':>11s} {'profiled/step':>14s}")
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    for r in table:
        print(f"{r['M']:3d} {r['memory_floor_ms']:10.2f} ms {r['kernel_floor_ms']:10.2f} ms {r['bound_ms']:5.2f} ms "
              f"{fmt(r['profiled_ms'], '6.2f'):>6s} ms {fmt(r['bound_steps'], '11.2f'):>11s} "
              f"{fmt(r['profiled_steps'], '14.2f'):>14s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
