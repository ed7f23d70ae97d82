"""Where a decode step of a `--attention cpu` artifact goes: time the target graph with parts cut out.

    python scripts/ablate_step.py ART [--position 200] [--rounds 6]

Copies ART's target graph into temporary artifacts with one part bypassed (the numbers are timings only: a
cut graph computes nonsense), then times a batch-1 decode step at the same position in every variant,
interleaved in one process (this machine's speed drifts, so only same-run differences mean anything):

    full       the graph as exported
    no-mins    GGUF Q4_1's minimums term (Reshape, ReduceSum, Gemm after each MatMulNBits) bypassed
    no-attn    attention (QK, mask, softmax, PV and the reshapes around them) bypassed; cache writes stay
    no-rope    rotary embedding of q and k bypassed
    matmuls    all three cut: MatMulNBits, norms, cache writes, embedding and head remain
    no-unpack  `--kernels specrt` graphs: the scatter of the packed rows onto the B x T grid bypassed
    no-pack    the gather of the packed rows after attention bypassed
    no-silu    the MLP's SiLU bypassed
    small      rope, unpack, pack and SiLU all cut

A cut whose nodes the graph does not have (rope, unpacking and packing live inside specrt::PackedAttention in a
`--kernels specrt` target) leaves it whole; each variant's node count is printed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from specrt.artifact import load_manifest
from specrt.runtime.backends import load_runner

VARIANTS = {"full": set(), "no-mins": {"mins"}, "no-attn": {"attn"}, "no-rope": {"rope"},
            "matmuls": {"mins", "attn", "rope"}, "no-unpack": {"unpack"}, "no-pack": {"pack"},
            "no-silu": {"silu"}, "small": {"rope", "unpack", "pack", "silu"}}


def _layer(name: str) -> str:
    return re.search(r"layers\.(\d+)", name).group(1)


def cut(model: onnx.ModelProto, parts: set[str]) -> onnx.ModelProto:
    """A copy of the target graph with `parts` bypassed and the nodes left dead removed."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    prefix = m.graph.node[0].name.split("/")[1]
    rename = {}
    produced = {o for n in m.graph.node for o in n.output}

    def feed(n: onnx.NodeProto, tensor: str) -> None:  # a cut that does not apply to this graph changes nothing
        if f"/{prefix}/layers.{_layer(n.name)}/{tensor}" in produced:  # (e.g. rope inside PackedAttention)
            n.input[0] = f"/{prefix}/layers.{_layer(n.name)}/{tensor}"

    for n in m.graph.node:
        if "mins" in parts and n.op_type == "Gemm" and n.name.endswith("/mins"):
            rename[n.output[0]] = n.input[2]  # the MatMulNBits output the term was added to
        if "attn" in parts and re.search(r"attn/o_proj(/Reshape)?$", n.name):
            feed(n, "input_layernorm:0")  # any [N, d] tensor
        if "rope" in parts and n.name.endswith("attn/Split_1"):
            feed(n, "attn/Split:0")
        if "unpack" in parts and n.name.endswith("attn/qkv_heads"):
            feed(n, "attn/qkv_proj:0")
        if "pack" in parts and n.name.endswith("attn/o_proj"):
            feed(n, "attn/Reshape:0")
        if "silu" in parts and n.name.endswith("mlp/Mul"):
            feed(n, "mlp/Split:0")
    for n in m.graph.node:
        for i, x in enumerate(n.input):
            n.input[i] = rename.get(x, x)
    live = {o.name for o in m.graph.output}
    keep = []
    for n in reversed(m.graph.node):
        if any(o in live for o in n.output):
            keep.append(n)
            live.update(n.input)
    del m.graph.node[:]
    m.graph.node.extend(reversed(keep))
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("--position", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    manifest = load_manifest(args.art)
    graph_file = manifest.graphs["target"].file
    model = onnx.load(args.art / graph_file, load_external_data=False)
    with tempfile.TemporaryDirectory() as tmp:
        runners, nodes = {}, {}
        for name, parts in VARIANTS.items():
            d = Path(tmp) / name
            d.mkdir()
            for f in args.art.iterdir():
                if f.name != graph_file and f.is_file():
                    try:  # ONNX Runtime refuses external data outside the model's folder: hard links
                        os.link(f, d / f.name)
                    except OSError:
                        shutil.copy(f, d / f.name)
            variant = cut(model, parts)
            nodes[name] = len(variant.graph.node)
            onnx.save(variant, d / graph_file)
            r = load_runner("ort", d, manifest, "target", threads=args.threads)
            r.allocate(1)
            runners[name] = r
            for p in range(args.position):
                _step(r, p)
        times = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, r in runners.items():
                ts = []
                for p in range(args.position, args.position + 30):
                    t = time.perf_counter()
                    _step(r, p)
                    ts.append(time.perf_counter() - t)
                times[name].append(np.median(ts) * 1e3)
        full = np.median(times["full"])
        print(f"decode step at position {args.position}, batch 1, {args.threads} threads "
              f"(median of {args.rounds} interleaved rounds of 30 steps)")
        for name, ts in times.items():
            print(f"  {name:9s} {np.median(ts):6.2f} ms   {full - np.median(ts):+6.2f} ms vs full   "
                  f"{nodes[name]} nodes")


def _step(r, pos: int) -> None:
    b = r.spec.bucket("decode", B=1, T=1, R=1)
    f = r.inputs(0, b)
    f["input_ids"][:] = 100
    f["position_ids"][:] = pos
    f["write_index"][:] = pos
    f["logit_rows"][:] = 0
    f["token_rows"][:] = 0
    r.run(0, b)


if __name__ == "__main__":
    sys.exit(main())
