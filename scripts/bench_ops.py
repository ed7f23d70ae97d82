#!/usr/bin/env python3
"""Micro-benchmark of specrt::MatMulGGUF (kernels/cpu) against ONNX Runtime's MatMulNBits on SmolLM2's shapes.

    python scripts/bench_ops.py [--lib build/cpp/libspecrt_ops.so] [--threads 2] [--calls 300] [--json]
                                [--ggml LLAMA_CPP_SOURCE]

For each weight shape and M = 1, 2, 4, 8, 16 activation rows: MatMulGGUF on the weight's GGUF blocks (Q4_1 and Q8_0,
as the default model's file has them; an initializer, so repacked once per session) on every instruction set this CPU
runs (--isas), and MatMulNBits (4- and 8-bit blocks of 32, uint8 zero points, accuracy level 4: its int8 path, the
fastest stock alternative; specrt's stock Q4_1 graphs add a second product for the minimums on top of the 4-bit one,
its Q8_0 LM head is the 8-bit one). Median microseconds per call over --calls calls, one session
at a time (another session's spinning thread pool would slow the one measured); "ONNX Runtime empty call" is a
graph of one Identity node, the part of every ONNX Runtime figure that is the call from Python, not the product.

--ggml: llama.cpp's own products beside them, ggml_mul_mat on ggml's CPU backend with the same weight bytes and
activations (scripts/ggml_mul_mat_bench.cpp, built here with g++ against LLAMA_CPP_SOURCE's ggml headers: the
llama.cpp that llama-cpp-python vendors, e.g. vendor/llama.cpp of its sdist, `pip download --no-deps --no-binary
:all: llama-cpp-python==VERSION`; linked with the ggml libraries the installed llama-cpp-python carries, so the
code llama.cpp decodes with). Each product's last row is checked against MatMulGGUF's (both quantize the
activations to 8 bits per block of 32: they agree to a small fraction of the row's scale). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from gguf import GGMLQuantizationType
from gguf.quants import quantize

SHAPES = {"q_proj/o_proj 576x576": (576, 576), "k_proj/v_proj 192x576": (192, 576),
          "gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}
ROWS = (1, 2, 4, 8, 16)
ISAS = ("scalar", "avx2", "avx512vnni", "amx")


def model_bytes(nodes, inits, k: int, n: int) -> bytes:
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("specrt", 1),
                                                   helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def session(data: bytes, threads: int, lib: str | None = None, isa: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if lib:
        so.register_custom_ops_library(lib)
    if isa:
        os.environ["SPECRT_OPS_ISA"] = isa
    try:
        return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    finally:
        os.environ.pop("SPECRT_OPS_ISA", None)


def build_ggml_bench(source: Path, out: Path) -> Path:
    """scripts/ggml_mul_mat_bench.cpp built against source's ggml headers and llama-cpp-python's ggml libraries."""
    include = next((p for p in (source / "ggml" / "include", source / "vendor" / "llama.cpp" / "ggml" / "include")
                    if (p / "ggml-cpu.h").is_file()), None)
    if include is None:
        sys.exit(f"bench_ops: --ggml {source}: no ggml/include/ggml-cpu.h there (give llama.cpp's source folder)")
    try:
        import llama_cpp
    except ImportError:
        sys.exit("bench_ops: --ggml needs llama-cpp-python installed (its ggml libraries are what is timed)")
    lib = Path(llama_cpp.__file__).parent / "lib"
    if not (lib / "libggml-cpu.so").is_file():
        sys.exit(f"bench_ops: no libggml-cpu.so in {lib} (a llama-cpp-python built with its ggml libraries)")
    binary = out / "ggml_mul_mat_bench"
    r = subprocess.run(["g++", "-O2", "-std=c++17", f"-I{include}", str(Path(__file__).with_name(
        "ggml_mul_mat_bench.cpp")), "-o", str(binary), f"-L{lib}", "-lggml", "-lggml-base", "-lggml-cpu",
        f"-Wl,-rpath,{lib}"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench_ops: building ggml_mul_mat_bench failed:\n{r.stderr[-2000:]}")
    return binary


def ggml_rows(binary: Path, fmt: str, raw: np.ndarray, acts: np.ndarray, n: int, k: int, threads: int,
              calls: int, tmp: Path) -> dict[int, dict]:
    """{M: {"us", "last_row"}} of ggml_mul_mat over raw's bytes, for every M in ROWS."""
    wfile, afile = tmp / "weights.bin", tmp / "acts.bin"
    np.ascontiguousarray(raw).tofile(wfile)
    np.ascontiguousarray(acts, dtype=np.float32).tofile(afile)
    r = subprocess.run([str(binary), fmt.lower(), str(n), str(k), str(threads), str(calls), str(wfile), str(afile),
                        ",".join(map(str, ROWS))], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench_ops: ggml_mul_mat_bench failed: {r.stderr.strip()}")
    return {d["M"]: d for d in map(json.loads, r.stdout.splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default=str(Path(__file__).parents[1] / "build" / "cpp" / "libspecrt_ops.so"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--isas", default=",".join(ISAS), help="Instruction sets to time (those the CPU runs).")
    ap.add_argument("--ggml", type=Path, metavar="LLAMA_CPP_SOURCE",
                    help="Also time llama.cpp's ggml_mul_mat (llama.cpp's source folder, for ggml's headers).")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_ops_") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    ggml = build_ggml_bench(args.ggml, tmp) if args.ggml else None
    identity = model_bytes([helper.make_node("Identity", ["A"], ["Y"])], [], 576, 576)
    empty = session(identity, args.threads)
    isa_of = ctypes.CDLL(args.lib).specrt_ops_isa
    isa_of.restype = ctypes.c_char_p
    runnable = []
    for isa in ISAS:
        os.environ["SPECRT_OPS_ISA"] = isa
        if isa_of().decode() == isa and isa in args.isas.split(","):
            runnable.append(isa)
    os.environ.pop("SPECRT_OPS_ISA", None)
    rng = np.random.default_rng(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = rng.normal(size=(n, k)).astype(np.float32) * 0.05
        acts = rng.normal(size=(max(ROWS), k)).astype(np.float32)
        sessions = {}
        if name == next(iter(SHAPES)):
            sessions["ONNX Runtime empty call"] = empty
        ggml_times = {}
        for fmt in ("Q4_1", "Q8_0"):
            raw = quantize(w, getattr(GGMLQuantizationType, fmt))
            if ggml:
                ggml_times[fmt] = ggml_rows(ggml, fmt, raw, acts, n, k, args.threads, args.calls, tmp)
            node = helper.make_node("MatMulGGUF", ["A", "W"], ["Y"], domain="specrt", format=fmt, K=k, N=n)
            data = model_bytes([node], [numpy_helper.from_array(np.ascontiguousarray(raw), "W")], k, n)
            for isa in runnable:
                sessions[f"MatMulGGUF {fmt} {isa}"] = session(data, args.threads, args.lib, isa)
        for bits in (4, 8):  # specrt's stock graphs: Q4_1 as 4-bit (plus a product for the minimums), Q8_0 as 8-bit
            codes = rng.integers(0, 256, size=(n, k // 32, 32 * bits // 8), dtype=np.uint8)
            scales = rng.uniform(0.01, 0.02, size=(n, k // 32)).astype(np.float32)
            zeros = rng.integers(0, 256, size=(n, (k // 32 * bits + 7) // 8), dtype=np.uint8)
            node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zp"], ["Y"], domain="com.microsoft", K=k,
                                    N=n, bits=bits, block_size=32, accuracy_level=4)
            inits = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "scales"),
                     numpy_helper.from_array(zeros, "zp")]
            sessions[f"MatMulNBits {bits}-bit acc4"] = session(model_bytes([node], inits, k, n), args.threads)
        for m in ROWS:
            a = acts[:m]
            times = {key: [] for key in sessions}
            for key, s in sessions.items():  # warm-up
                for _ in range(5):
                    s.run(None, {"A": a})
            for key, s in sessions.items():  # one session at a time: another's spinning pool would slow it
                time.sleep(0.05)
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    s.run(None, {"A": a})
                    times[key].append(time.perf_counter() - t0)
            for key, ts in times.items():
                rows.append({"shape": name, "M": m, "op": key, "us": round(statistics.median(ts) * 1e6, 1)})
            for fmt, by_m in ggml_times.items():
                ours = next(s for key, s in sessions.items() if key.startswith(f"MatMulGGUF {fmt}"))
                want = ours.run(None, {"A": a})[0][-1]
                got = np.asarray(by_m[m]["last_row"], dtype=np.float32)
                rel = float(np.abs(got - want).max() / np.abs(want).max())
                if rel > 0.02:
                    sys.exit(f"bench_ops: ggml_mul_mat's {fmt} {name} product at M={m} is not MatMulGGUF's "
                             f"(largest difference {rel:.3f} of the row's scale): not the same product")
                rows.append({"shape": name, "M": m, "op": f"llama.cpp ggml_mul_mat {fmt}", "us": by_m[m]["us"],
                             "vs_matmul_gguf": round(rel, 5)})
    if args.json:
        print(json.dumps({"threads": args.threads, "isas": runnable, "rows": rows}))
        return
    ops = list(dict.fromkeys(r["op"] for r in rows))
    print(f"{'shape':24s} {'M':>3s} " + " ".join(f"{o:>26s}" for o in ops) + "   (median us per call)")
    for name in SHAPES:
        for m in ROWS:
            cells = {r["op"]: r["us"] for r in rows if r["shape"] == name and r["M"] == m}
            print(f"{name:24s} {m:3d} " + " ".join(f"{cells[o]:26.1f}" if o in cells else f"{'':26s}" for o in ops))


if __name__ == "__main__":
    main()
