"""specrt's custom ONNX Runtime operators (kernels/cpu, libspecrt_ops), loaded by ONNX Runtime's Python API as a
user of the artifact would load them (SessionOptions.register_custom_ops_library).

specrt::MatMulGGUF multiplies activations by weights in GGUF's own blocks (the bytes `gguf.quants.quantize` writes,
as a GGUF file holds them): every format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K), every row
count M from 1 to 16 and batched leading axes, SmolLM2's shapes and odd ones (3 blocks, N = 7, N = 1), on every instruction set this CPU runs (the scalar reference
and AVX2 forced by SPECRT_OPS_ISA, AVX-512 VNNI and AMX where the CPU has them). Checked two ways: against a numpy emulation
of the documented arithmetic (activations quantized per 32-block to int8, integer dot products, scales applied in
float32) to float rounding, and against the plain float product of `gguf`'s own dequantized weights, within the
bound that quantizing the activations allows (half an activation step times the weights' absolute sum, per block)."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")
gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

from specrt.kernels import reference  # noqa: E402

FORMATS = {name: GGMLQuantizationType[name] for name in reference.FORMATS}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # 256 weights a block: K a multiple of 256, and gguf has no quantizer for them
ISAS = ("scalar", "avx2", "avx512vnni", "amx")


@pytest.fixture(scope="module")
def ops_lib(cpp_build):
    return cpp_build / "libspecrt_ops.so"


def _supported(lib, isa: str) -> bool:
    """Whether forcing `isa` gets it here (the library falls back to the best the CPU has otherwise)."""
    os.environ["SPECRT_OPS_ISA"] = isa
    try:
        f = ctypes.CDLL(str(lib)).specrt_ops_isa
        f.restype = ctypes.c_char_p
        return f().decode() == isa
    finally:
        del os.environ["SPECRT_OPS_ISA"]


def _open(lib, graph, isa: str):
    """A 2-thread session of `graph` with the library registered and `isa` forced (read when a kernel is made)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("specrt", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    so.intra_op_num_threads = 2
    os.environ["SPECRT_OPS_ISA"] = isa
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    finally:
        del os.environ["SPECRT_OPS_ISA"]


def _session(lib, fmt: str, k: int, n: int, isa: str, constant: np.ndarray | None = None):
    """A MatMulGGUF session; W is an input fed with each call, or with `constant` an initializer (which the SIMD
    paths repack once, 8 rows at a time)."""
    node = helper.make_node("MatMulGGUF", ["A", "W"], ["Y"], domain="specrt", format=fmt, K=k, N=n)
    row = _row_bytes(fmt, k)
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])]
    if constant is None:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.UINT8, [n, row]))
    inits = [] if constant is None else [numpy_helper.from_array(constant, "W")]
    graph = helper.make_graph([node], "matmul_gguf", inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)
    return _open(lib, graph, isa)


def _row_bytes(fmt: str, k: int) -> int:
    f = reference.FORMATS.get(fmt)
    return k if f is None else k // f.block_elems * f.block_bytes  # a format the kernels refuse: any width


def _weights(fmt: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks of a random [n, k] weight (as the file stores them) and gguf's own dequantization of them. gguf
    quantizes the 32-weight formats; K-quant blocks are random bytes (every byte pattern is a block) with their
    fp16 scales (and minimums) set to a weight's magnitudes, so every code, sub-block scale and minimum occurs."""
    if fmt in K_QUANTS:
        f = reference.FORMATS[fmt]
        blocks = rng.integers(0, 256, size=(n, k // f.block_elems, f.block_bytes), dtype=np.uint8)
        at = 208 if fmt == "Q6_K" else 0  # Q6_K keeps d last
        scales = rng.uniform(0.0005, 0.004, size=(n, k // f.block_elems, 1)).astype(np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8)
        if fmt != "Q6_K":  # dmin
            blocks[..., 2:4] = (scales * rng.uniform(0.5, 2.0, size=scales.shape).astype(np.float16)).view(np.uint8)
        raw = blocks.reshape(n, -1)
    else:
        w = rng.normal(size=(n, k)).astype(np.float32) * rng.uniform(0.01, 0.2, size=(n, 1)).astype(np.float32)
        w += rng.normal(size=(n, k)).astype(np.float32) * 0.01 if fmt in ("Q4_1", "Q5_1") else 0.0  # mins not 0
        raw = gguf_quants.quantize(w, FORMATS[fmt])
    return np.ascontiguousarray(raw), gguf_quants.dequantize(raw, FORMATS[fmt]).astype(np.float32)


def _k(fmt: str, k: int) -> int:
    """A test's K for `fmt`: the K-quants' blocks are 256 weights, so K is rounded up to a multiple of 256."""
    return -(-k // 256) * 256 if fmt in K_QUANTS else k


def test_the_reference_formats_dequantize_as_gguf_does():
    """Each entry of the reference's format table (block bytes, scales, offset, codes) gives gguf's own weights."""
    rng = np.random.default_rng(0)
    for fmt in FORMATS:
        raw, deq = _weights(fmt, 5, _k(fmt, 96), rng)
        np.testing.assert_array_equal(reference.dequantize(raw, fmt), deq, err_msg=fmt)


def test_the_exporter_refuses_a_kernel_node_off_its_schema():
    """The schemas are checked where nodes are made: a MatMulGGUF without its K, or with an attribute the library
    does not read, is an export error, not a session that fails to load."""
    from specrt.exporter.onnx.builder import PLUGIN_DOMAIN, GraphBuilder

    g = GraphBuilder(store=None, kernels="specrt")
    g.op("MatMulGGUF", "x", "w", domain=PLUGIN_DOMAIN, format="Q4_0", K=64, N=8)
    with pytest.raises(ValueError, match="no K"):
        g.op("MatMulGGUF", "x", "w", domain=PLUGIN_DOMAIN, format="Q4_0", N=8)
    with pytest.raises(ValueError, match="unknown bias"):
        g.op("MatMulGGUF", "x", "w", domain=PLUGIN_DOMAIN, format="Q4_0", K=64, N=8, bias=1)
    with pytest.raises(ValueError, match="3 inputs"):
        g.op("RMSNorm", "x", "w", "z", domain=PLUGIN_DOMAIN, epsilon=1e-5)


def _check(y: np.ndarray, a: np.ndarray, raw: np.ndarray, deq: np.ndarray, fmt: str, what: str) -> None:
    emulated = reference.matmul_gguf(a, raw, fmt)
    scale = np.abs(emulated).max() + 1e-6
    assert np.abs(y - emulated).max() <= 2e-5 * scale + 1e-6, f"{what}: differs from the emulated arithmetic"
    exact = a.astype(np.float64) @ deq.T.astype(np.float64)
    _, da = reference.quantize_activations(a)
    wabs = np.abs(deq).reshape(deq.shape[0], -1, 32).sum(axis=-1)  # [n, b]
    bound = (da[:, None, :] / 2 * wabs[None]).sum(axis=-1)  # |a - â| <= d_a / 2 per element
    assert (np.abs(y - exact) <= bound * 1.001 + 1e-4 * scale).all(), f"{what}: outside the quantization bound"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matmul_gguf_every_row_count_and_odd_shapes(ops_lib, fmt, isa):
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(7)
    for k, n, rows in ((96, 7, range(1, 17)), (32, 1, (1, 3, 16)), (576, 1536, (1, 2, 5, 16)),
                       (1536, 576, (1, 4, 8)), (576, 49152 // 64, (1, 9))):
        k = _k(fmt, k)
        raw, deq = _weights(fmt, n, k, rng)
        fed, packed = _session(ops_lib, fmt, k, n, isa), _session(ops_lib, fmt, k, n, isa, constant=raw)
        for m in rows:
            a = rng.normal(size=(m, k)).astype(np.float32) * 2
            a[0, :32] = 0  # an all-zero block (scale 0)
            for how, y in (("fed", fed.run(None, {"A": a, "W": raw})[0]), ("initializer", packed.run(None, {"A": a})[0])):
                assert y.shape == (m, n)
                _check(y, a, raw, deq, fmt, f"{fmt} {isa} K={k} N={n} M={m} W {how}")


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_gguf_q8_0_codes_over_the_whole_int8_range(ops_lib, isa):
    """Q8_0 codes a file may hold but gguf's quantizer never writes (-128) and extreme activations: the VNNI kernel
    multiplies w + 128 and subtracts 128 times the activations' code sum, which must give w x exactly."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(11)
    n, k = 37, 192
    codes = rng.integers(-128, 128, size=(n, k // 32, 32), dtype=np.int8)
    codes[0] = -128  # a row of the code no quantizer writes
    codes[1] = 127
    scales = rng.uniform(0.001, 0.01, size=(n, k // 32, 1)).astype(np.float16)
    raw = np.concatenate([scales.view(np.uint8), codes.view(np.uint8)], axis=-1).reshape(n, -1)
    deq = (codes.astype(np.float32) * scales.astype(np.float32)).reshape(n, k)
    fed, packed = _session(ops_lib, "Q8_0", k, n, isa), _session(ops_lib, "Q8_0", k, n, isa, constant=raw)
    for m in (1, 3, 8, 11):
        a = rng.normal(size=(m, k)).astype(np.float32)
        a[0] = np.where(np.arange(k) % 2, 4.0, -4.0)  # every code at +-127
        for how, y in (("fed", fed.run(None, {"A": a, "W": raw})[0]), ("initializer", packed.run(None, {"A": a})[0])):
            _check(y, a, raw, deq, "Q8_0", f"Q8_0 {isa} M={m} W {how}")


def test_matmul_gguf_paths_agree_and_take_leading_axes(ops_lib):
    """Every path the CPU runs gives the same products (to float rounding); a [2, 3, K] input is 6 rows."""
    rng = np.random.default_rng(3)
    raw, deq = _weights("Q4_1", 64, 256, rng)
    a = rng.normal(size=(6, 256)).astype(np.float32)
    outs = {isa: _session(ops_lib, "Q4_1", 256, 64, isa).run(None, {"A": a, "W": raw})[0]
            for isa in ISAS if _supported(ops_lib, isa)}
    assert "scalar" in outs and len(outs) >= 2
    for isa, y in outs.items():
        np.testing.assert_allclose(y, outs["scalar"], rtol=1e-5, atol=1e-5, err_msg=isa)
    node = helper.make_node("MatMulGGUF", ["A", "W"], ["Y"], domain="specrt", format="Q4_1", K=256, N=64)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3, 256]),
                                            helper.make_tensor_value_info("W", TensorProto.UINT8, [64, 160])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, 64])])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(ops_lib))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("specrt", 1)])
    (y,) = ort.InferenceSession(model.SerializeToString(), so).run(None, {"A": a.reshape(2, 3, 256), "W": raw})
    np.testing.assert_allclose(y.reshape(6, 64), outs["scalar"], rtol=1e-5, atol=1e-5)


def test_the_library_is_never_unloaded(ops_lib):
    """RegisterCustomOps makes the "specrt" op domain once per process and keeps it behind a static pointer, and
    ONNX Runtime's C and C++ API unload a custom-op library when the last session options that registered it go
    (its Python API keeps it): so the library is linked never to unload (-z nodelete), and the domain stays
    reachable. Without it LeakSanitizer reported the domain as leaked when specrt-cpp exited after a failed engine
    (`SPECRT_CPP_SANITIZE=1 python -m pytest tests/test_cpp.py`, docs/benchmarks.md); that run is the behaviour's
    test, this one the flag's."""
    import shutil
    import subprocess

    if shutil.which("readelf") is None:
        pytest.skip("reading the library's dynamic section needs readelf (binutils, installed with g++)")
    r = subprocess.run(["readelf", "-d", str(ops_lib)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    flags = [line for line in r.stdout.splitlines() if "FLAGS_1" in line]
    assert flags and "NODELETE" in flags[0], r.stdout


def test_packed_weights_in_huge_page_chunks_or_the_heap_give_the_same_bits(ops_lib, monkeypatch):
    """Repacked weights live in 32 MiB chunks backed by transparent huge pages, or (SPECRT_OPS_HUGEPAGES=0) on the
    heap: the same products either way; sessions whose weights fill several chunks, made and dropped in turn (chunks
    given back and carved again, zeroed), keep giving them."""
    if not _supported(ops_lib, "avx2"):
        pytest.skip("weights are repacked only for the SIMD kernels, and this CPU runs none")
    rng = np.random.default_rng(4)
    raw, _ = _weights("Q8_0", 4096 + 3, 4096, rng)  # 17.8 MB: two fill a chunk; rows past N pad a group with zeros
    a = rng.normal(size=(3, 4096)).astype(np.float32)
    monkeypatch.setenv("SPECRT_OPS_HUGEPAGES", "0")
    want = _session(ops_lib, "Q8_0", 4096, 4096 + 3, "avx2", constant=raw).run(None, {"A": a})[0]
    monkeypatch.delenv("SPECRT_OPS_HUGEPAGES")
    for round_ in range(3):
        sessions = [_session(ops_lib, "Q8_0", 4096, 4096 + 3, "avx2", constant=raw) for _ in range(3)]
        for s in sessions:
            np.testing.assert_array_equal(s.run(None, {"A": a})[0], want, err_msg=f"round {round_}")
        del sessions


def test_matmul_gguf_refuses_bad_attributes_and_shapes(ops_lib):
    rng = np.random.default_rng(0)
    raw, _ = _weights("Q8_0", 4, 64, rng)
    with pytest.raises(Exception, match="format IQ2_XS"):
        _session(ops_lib, "IQ2_XS", 64, 4, "scalar")
    with pytest.raises(Exception, match="multiple of 32"):
        _session(ops_lib, "Q8_0", 48, 4, "scalar")
    with pytest.raises(Exception, match="multiple of 256 .Q6_K's block"):
        _session(ops_lib, "Q6_K", 576, 4, "scalar")
    session = _session(ops_lib, "Q8_0", 64, 4, "scalar")
    with pytest.raises(Exception, match="invalid dimensions for input: W|W is not"):
        session.run(None, {"A": np.zeros((1, 64), np.float32), "W": raw[:, :-1].copy()})


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matmul_gguf_rows_do_not_depend_on_the_call(ops_lib, fmt, isa):
    """A row's product has the same bits whether it is multiplied alone or among 15 others: a verify of T tokens
    gives each token what decoding it alone gives (the greedy identity rests on it; ONNX Runtime's own MatMul and
    MatMulNBits do not promise it, and on AVX2 CPUs a row alone takes another path). Under amx up to 15 rows take the
    VNNI kernel and whole passes of 16 the tile multiplies (20: 16 on the tiles, 4 on VNNI)."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(11)
    k = _k(fmt, 576)
    raw, _ = _weights(fmt, 203, k, rng)
    a = rng.normal(size=(20, k)).astype(np.float32)
    for how, session, feed in (("fed", _session(ops_lib, fmt, k, 203, isa), {"W": raw}),
                               ("initializer", _session(ops_lib, fmt, k, 203, isa, constant=raw), {})):
        alone = np.stack([session.run(None, {"A": a[i:i + 1], **feed})[0][0] for i in range(20)])
        for m in (2, 3, 4, 5, 8, 16, 20):
            (y,) = session.run(None, {"A": a[:m], **feed})
            np.testing.assert_array_equal(y, alone[:m], err_msg=f"W {how}, M={m}")


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matmul_gguf_prefetching_changes_no_bits(ops_lib, fmt, isa, monkeypatch):
    """Packed passes ask for weights ahead from $SPECRT_OPS_PREFETCH_ROWS rows (by default 1 on Intel CPUs, 4
    elsewhere; read when a kernel is made): each pass size, with and without, gives the same bits."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(12)
    k = _k(fmt, 576)
    raw, _ = _weights(fmt, 203, k, rng)
    a = rng.normal(size=(9, k)).astype(np.float32)
    outs = {}
    for rows in ("1", "9"):  # 1: every pass prefetches; 9: none does
        monkeypatch.setenv("SPECRT_OPS_PREFETCH_ROWS", rows)
        session = _session(ops_lib, fmt, k, 203, isa, constant=raw)
        outs[rows] = [session.run(None, {"A": a[:m]})[0] for m in range(1, 10)]
    for m, (y, z) in enumerate(zip(outs["1"], outs["9"]), 1):
        np.testing.assert_array_equal(y, z, err_msg=f"M={m}")


@pytest.mark.parametrize("isa", ["avx512vnni", "amx"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matmul_gguf_wide_vectors_change_no_bits(ops_lib, fmt, isa, monkeypatch):
    """On AVX-512 VNNI, packed weights go two groups (16 rows) per 512-bit vector where $SPECRT_OPS_WIDE allows (by
    default on Intel CPUs; read when a kernel is made), else 8 rows per 256-bit one: the same bits either way, for
    one group alone (N = 7), a pair with a short second group (13), and an odd last group of a thread's share (203);
    under amx for the rows below its tile multiplies' minimum."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(13)
    for n in (7, 13, 203):
        k = _k(fmt, 576)
        raw, deq = _weights(fmt, n, k, rng)
        a = rng.normal(size=(16, k)).astype(np.float32)
        outs = {}
        for wide in ("0", "1"):
            monkeypatch.setenv("SPECRT_OPS_WIDE", wide)
            session = _session(ops_lib, fmt, k, n, isa, constant=raw)
            outs[wide] = [session.run(None, {"A": a[:m]})[0] for m in (*range(1, 10), 16)]
        for m, y, z in zip((*range(1, 10), 16), outs["0"], outs["1"]):
            np.testing.assert_array_equal(y, z, err_msg=f"N={n}, M={m}")
        _check(outs["1"][-1], a, raw, deq, fmt, f"wide, N={n}")


def _gather_session(lib, fmt: str, k: int, v: int):
    node = helper.make_node("GatherGGUF", ["W", "ids"], ["Y"], domain="specrt", format=fmt, K=k)
    row = _row_bytes(fmt, k)
    graph = helper.make_graph([node], "gather_gguf",
                              [helper.make_tensor_value_info("W", TensorProto.UINT8, [v, row]),
                               helper.make_tensor_value_info("ids", TensorProto.INT64, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("specrt", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gather_gguf_rows_are_gguf_dequantized_rows(ops_lib, fmt):
    rng = np.random.default_rng(5)
    k = _k(fmt, 96)
    raw, deq = _weights(fmt, 50, k, rng)
    session = _gather_session(ops_lib, fmt, k, 50)
    ids = np.array([[0, 49, 7], [7, -1, 3]], np.int64)
    (y,) = session.run(None, {"W": raw, "ids": ids})
    assert y.shape == (2, 3, k)
    np.testing.assert_array_equal(y, deq[ids])  # gguf's own arithmetic, bit for bit
    with pytest.raises(Exception, match="index 50 is out of range"):
        session.run(None, {"W": raw, "ids": np.array([50], np.int64)})


def _matmul_session(lib, fmt: str, k: int, n: int, isa: str, raw: np.ndarray, activation: str = "", packed=True):
    """MatMulGGUF over `raw`, an initializer (`packed`: the SIMD paths repack it) or fed as input W."""
    attrs = {"activation": activation} if activation else {}
    node = helper.make_node("MatMulGGUF", ["A", "W"], ["Y"], domain="specrt", format=fmt, K=k, N=n, **attrs)
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])]
    if not packed:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.UINT8, list(raw.shape)))
    graph = helper.make_graph([node], "matmul_gguf", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT,
                                                                                          None)],
                              initializer=[numpy_helper.from_array(raw, "W")] if packed else [])
    session = _open(lib, graph, isa)
    return lambda a: session.run(None, {"A": a} if packed else {"A": a, "W": raw})[0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("half", [48, 300])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "fed"])
def test_matmul_gguf_swiglu_is_the_documented_arithmetic_on_its_product(ops_lib, isa, half, packed):
    """activation "swiglu": silu(gate) * up of the same node's product without it, bit for bit as elementwise.inc
    computes it (emulated in numpy float32), within 1e-6 of float64's silu, each row alone; gates from -400 to 400
    (exp's argument clamped), N/2 a whole number of 8-row groups (computed inside each task) or not (after)."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(21)
    raw, _ = _weights("Q8_0", 2 * half, 256, rng)
    a = (rng.normal(size=(16, 256)) * np.geomspace(0.01, 30, 16)[:, None]).astype(np.float32)
    product = _matmul_session(ops_lib, "Q8_0", 256, 2 * half, isa, raw, packed=packed)(a)
    swiglu = _matmul_session(ops_lib, "Q8_0", 256, 2 * half, isa, raw, "swiglu", packed=packed)
    y = swiglu(a)
    assert y.shape == (16, half)
    assert np.abs(product[:, :half]).max() > 200  # the clamp is reached
    np.testing.assert_array_equal(y, reference.swiglu(product))
    g, u = product[:, :half].astype(np.float64), product[:, half:].astype(np.float64)
    exact = g / (1 + np.exp(-g)) * u
    assert (np.abs(y - exact) <= 1e-6 * np.abs(exact) + 1e-30).all()
    for i in (0, 5, 15):
        np.testing.assert_array_equal(swiglu(a[i:i + 1]), y[i:i + 1], err_msg=f"row {i} alone")


def test_matmul_gguf_refuses_an_unknown_activation_or_an_odd_n(ops_lib):
    raw, _ = _weights("Q8_0", 5, 64, np.random.default_rng(0))
    with pytest.raises(Exception, match="activation gelu"):
        _matmul_session(ops_lib, "Q8_0", 64, 5, "scalar", raw, "gelu")
    with pytest.raises(Exception, match="even N"):
        _matmul_session(ops_lib, "Q8_0", 64, 5, "scalar", raw, "swiglu")


def _norm_session(lib, isa: str, skip: bool, w: np.ndarray):
    names = ["X", "S", "W"] if skip else ["X", "W"]
    node = helper.make_node("SkipRMSNorm" if skip else "RMSNorm", names, ["Y", "Z"] if skip else ["Y"],
                            domain="specrt", epsilon=1e-5)
    f = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
    graph = helper.make_graph([node], "norm", [f("X"), *([f("S")] if skip else [])],
                              [f("Y"), *([f("Z")] if skip else [])], initializer=[numpy_helper.from_array(w, "W")])
    return _open(lib, graph, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [576, 37])
def test_rms_norms_are_the_documented_arithmetic(ops_lib, isa, d):
    """specrt::RMSNorm and SkipRMSNorm (the sum x + skip, then its norm), bit for bit the fixed-order arithmetic of
    elementwise.inc (emulated in numpy float32), within 1e-6 of float64's norm, any leading axes, each row alone."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(d)
    w = rng.normal(size=d).astype(np.float32)
    x = (rng.normal(size=(2, 5, d)) * 4).astype(np.float32)
    skip = rng.normal(size=(2, 5, d)).astype(np.float32)
    (y,) = _norm_session(ops_lib, isa, False, w).run(None, {"X": x})
    np.testing.assert_array_equal(y, reference.rms_norm(x, w))
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    session = _norm_session(ops_lib, isa, True, w)
    y, s = session.run(None, {"X": x, "S": skip})
    np.testing.assert_array_equal(s, x + skip)
    np.testing.assert_array_equal(y, reference.rms_norm(x + skip, w))
    np.testing.assert_array_equal(session.run(None, {"X": x[1, 2:3], "S": skip[1, 2:3]})[0], y[1, 2:3])


def test_rms_norms_refuse_mismatched_shapes(ops_lib):
    w = np.ones(8, np.float32)
    with pytest.raises(Exception, match="W must be"):
        _norm_session(ops_lib, "scalar", False, w).run(None, {"X": np.ones((2, 9), np.float32)})
    with pytest.raises(Exception, match="skip must have"):
        _norm_session(ops_lib, "scalar", True, w).run(None, {"X": np.ones((2, 8), np.float32),
                                                             "S": np.ones((1, 8), np.float32)})


KV_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _attention_session(lib, isa: str, scale: float, kv: str = "float32", cells: bool = False):
    """A session of one CacheAttention; `cells`: with its optional fifth input (the grid cells computed)."""
    names = ["q", "k", "v", "bias", *(["cells"] if cells else [])]
    node = helper.make_node("CacheAttention", names, ["Y"], domain="specrt", scale=scale)
    f = lambda name, t=TensorProto.FLOAT: helper.make_tensor_value_info(name, t, None)  # noqa: E731
    inputs = [f("q"), f("k", KV_TYPES[kv]), f("v", KV_TYPES[kv]), f("bias"), *([f("cells", TensorProto.INT64)]
                                                                              if cells else [])]
    graph = helper.make_graph([node], "attention", inputs, [f("Y")])
    return _open(lib, graph, isa)


def _stored(x: np.ndarray, kv: str) -> tuple[object, np.ndarray]:
    """float32 `x` as a `kv` cache holds it: (what is fed to the op, the float32 values it stands for). bfloat16
    rounds to nearest even (as ONNX Runtime's Cast does) and is fed as an OrtValue over its bits."""
    if kv == "float32":
        return x, x
    if kv == "float16":
        h = x.astype(np.float16)
        return h, h.astype(np.float32)
    u = x.view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16),
            (bits.astype(np.uint32) << 16).view(np.float32))


def _causal_bias(B: int, T: int, L: int, starts) -> np.ndarray:
    """[B,1,1,T,L]: query t of batch b (at position starts[b] + t) sees keys <= its position."""
    pos = np.asarray(starts)[:, None] + np.arange(T)[None]  # [B, T]
    visible = np.arange(L)[None, None, :] <= pos[:, :, None]
    return np.where(visible, 0.0, np.finfo(np.float32).min / 2).astype(np.float32)[:, None, None]


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_cache_attention_matches_softmax_attention(ops_lib, isa, kv):
    """Grouped-query attention of T = 1..16 queries over a cache of S positions, of which the first L are read,
    with a causal bias (per query) or one bias row for every query, against float64 softmax attention over the
    values the cache holds (float32, or float16 / bfloat16: `specrt export --kv-dtype`)."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(9)
    for B, T, H, Hkv, D, S in ((1, 1, 9, 3, 64, 40), (2, 5, 4, 2, 32, 24), (3, 16, 9, 3, 64, 70),
                               (1, 3, 2, 2, 8, 9)):
        scale = D ** -0.5
        session = _attention_session(ops_lib, isa, scale, kv)
        q = rng.normal(size=(B, T, H, D)).astype(np.float32)
        k, k32 = _stored(rng.normal(size=(B, Hkv, S, D)).astype(np.float32), kv)
        v, v32 = _stored(rng.normal(size=(B, Hkv, S, D)).astype(np.float32), kv)
        starts = rng.integers(0, S - T + 1, size=B)
        L = int(starts.max()) + T
        for bias in (_causal_bias(B, T, L, starts), rng.normal(size=(B, 1, 1, 1, L)).astype(np.float32)):
            (y,) = session.run(None, {"q": q, "k": k, "v": v, "bias": bias})
            assert y.shape == q.shape
            np.testing.assert_allclose(y, reference.attention(q, k32, v32, bias, scale), rtol=2e-5, atol=2e-5,
                                       err_msg=f"{isa} {kv} B={B} T={T} H={H}/{Hkv} D={D} L={L}")


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_cache_attention_rows_do_not_depend_on_the_call(ops_lib, isa, kv):
    """Query t among T queries gets the bits it gets as the only query (with its own bias row)."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(2)
    B, T, H, Hkv, D, S = 2, 16, 9, 3, 64, 90
    session = _attention_session(ops_lib, isa, D ** -0.5, kv)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k, _ = _stored(rng.normal(size=(B, Hkv, S, D)).astype(np.float32), kv)
    v, _ = _stored(rng.normal(size=(B, Hkv, S, D)).astype(np.float32), kv)
    bias = _causal_bias(B, T, 70, [40, 54])
    (y,) = session.run(None, {"q": q, "k": k, "v": v, "bias": bias})
    for t in range(T):
        (alone,) = session.run(None, {"q": q[:, t:t + 1].copy(), "k": k, "v": v, "bias": bias[:, :, :, t:t + 1].copy()})
        np.testing.assert_array_equal(y[:, t:t + 1], alone, err_msg=f"query {t}")


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_cache_attention_a_tree_row_gets_the_bits_of_its_path_decoded(ops_lib, isa, kv):
    """A draft tree's row sees the cache, the anchor and its ancestors, with its siblings' cells masked between them
    (runtime/tree.py): it gets the bits its path gives decoded, the same keys in the same order with nothing between
    them (each weight summed in the lane of its key's rank among the keys the row sees)."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(11)
    neg = np.finfo(np.float32).min / 2
    for D, base, seen in ((64, 37, (1, 4, 5, 9)), (32, 5, (2, 3)), (64, 40, (3,)), (128, 13, (1, 2, 6, 7, 8)),
                          (8, 20, (4, 6))):
        H, Hkv, S = 6, 3, base + 16
        session = _attention_session(ops_lib, isa, D ** -0.5, kv)
        q = rng.normal(size=(1, 1, H, D)).astype(np.float32)
        k, k32 = _stored(rng.normal(size=(1, Hkv, S, D)).astype(np.float32), kv)
        v, v32 = _stored(rng.normal(size=(1, Hkv, S, D)).astype(np.float32), kv)
        keys = [*range(base + 1), *(base + c for c in seen)]  # the cache, the anchor, the row's ancestors
        bias = np.full((1, 1, 1, 1, base + max(seen) + 1), neg, np.float32)
        bias[..., keys] = 0.0
        (tree_row,) = session.run(None, {"q": q, "k": k, "v": v, "bias": bias})
        take = lambda x32: _stored(np.ascontiguousarray(x32[:, :, keys]), kv)[0]  # exact: stored values  # noqa: E731
        (decoded,) = session.run(None, {"q": q, "k": take(k32), "v": take(v32),
                                        "bias": np.zeros((1, 1, 1, 1, len(keys)), np.float32)})
        np.testing.assert_array_equal(tree_row, decoded, err_msg=f"D={D} anchor at {base}, ancestors {seen}")


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_cache_attention_keys_masked_past_every_row_change_no_bit(ops_lib, isa, kv):
    """A bias wider than the positions (a cache allocated past them: keys masked for every query of a batch row)
    gives the bits of the bias cut after the last visible key, however wide, whatever the cache holds there; a
    row that sees no key at all still attends every key (uniform weights over all L, as softmax gives them)."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(4)
    B, T, H, Hkv, D, S = 2, 5, 9, 3, 64, 300
    session = _attention_session(ops_lib, isa, D ** -0.5, kv)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k, _ = _stored(rng.normal(size=(B, Hkv, S, D)).astype(np.float32), kv)
    v, v32 = _stored(rng.normal(size=(B, Hkv, S, D)).astype(np.float32), kv)
    starts = [37, 120]  # batch row 0 sees keys <= 41, row 1 keys <= 124
    (cut,) = session.run(None, {"q": q, "k": k, "v": v, "bias": _causal_bias(B, T, 125, starts)})
    for width in (126, 133, 192, 299):
        (wide,) = session.run(None, {"q": q, "k": k, "v": v, "bias": _causal_bias(B, T, width, starts)})
        np.testing.assert_array_equal(wide, cut, err_msg=f"bias {width} keys wide")
    blind = np.full((B, 1, 1, 1, 64), np.finfo(np.float32).min / 2, np.float32)  # every key masked for every row
    (y,) = session.run(None, {"q": q, "k": k, "v": v, "bias": blind})
    mean = np.repeat(v32[:, :, :64].astype(np.float64).mean(axis=2), H // Hkv, axis=1)  # [B, H, D]
    np.testing.assert_allclose(y, np.broadcast_to(mean[:, None], y.shape), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_cache_attention_computes_only_the_cells_a_packed_call_names(ops_lib, isa):
    """With `cells` (a packed verify's token rows: indices into the [B, T] grid, in any order, padding cells
    included), the named cells get the bits the full call gives them and every other cell is zero; one cell, few
    cells (single-row tasks) and runs longer than a task all agree. A cell outside the grid is refused."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(5)
    B, T, H, Hkv, D, S = 4, 8, 9, 3, 64, 80
    full = _attention_session(ops_lib, isa, D ** -0.5)
    packed = _attention_session(ops_lib, isa, D ** -0.5, cells=True)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k = rng.normal(size=(B, Hkv, S, D)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, S, D)).astype(np.float32)
    bias = _causal_bias(B, T, 60, [10, 30, 45, 52])
    (want,) = full.run(None, {"q": q, "k": k, "v": v, "bias": bias})
    lengths = [[0, 0, 0, 0], [7, 0, 2, 0], [3, 5, 0, 7], [7, 7, 7, 7]]
    for verify in lengths:  # each slot's anchor and drafts, then two padding cells (as packed_rows gives them)
        real = [b * T + t for b in range(B) for t in range(verify[b] + 1)]
        pad = [c for c in range(B * T) if c not in real][:2]
        cells = np.asarray(rng.permutation(real + pad), np.int64)
        (got,) = packed.run(None, {"q": q, "k": k, "v": v, "bias": bias, "cells": cells})
        mask = np.zeros(B * T, bool)
        mask[cells] = True
        mask = mask.reshape(B, T)
        np.testing.assert_array_equal(got[mask], want[mask], err_msg=f"{isa} lengths {verify}")
        assert not got[~mask].any(), verify
    with pytest.raises(Exception, match="cells must index"):
        packed.run(None, {"q": q, "k": k, "v": v, "bias": bias, "cells": np.asarray([0, B * T], np.int64)})


def test_cache_attention_refuses_mixed_or_other_cache_types(ops_lib):
    node = helper.make_node("CacheAttention", ["q", "k", "v", "bias"], ["Y"], domain="specrt", scale=0.125)
    q, bias = np.zeros((1, 2, 4, 64), np.float32), np.zeros((1, 1, 1, 2, 10), np.float32)
    for kt, vt, k, v, want in ((TensorProto.FLOAT16, TensorProto.FLOAT, np.float16, np.float32, "one element type"),
                               (TensorProto.DOUBLE, TensorProto.DOUBLE, np.float64, np.float64, "float, float16 or")):
        f = lambda name, t=TensorProto.FLOAT: helper.make_tensor_value_info(name, t, None)  # noqa: E731
        graph = helper.make_graph([node], "attention", [f("q"), f("k", kt), f("v", vt), f("bias")], [f("Y")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("specrt", 1)])
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(ops_lib))
        session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        with pytest.raises(Exception, match=want):
            session.run(None, {"q": q, "k": np.zeros((1, 2, 10, 64), k), "v": np.zeros((1, 2, 10, 64), v),
                               "bias": bias})


def test_cache_attention_refuses_bad_shapes(ops_lib):
    session = _attention_session(ops_lib, "scalar", 0.125)
    q, k = np.zeros((1, 2, 4, 64), np.float32), np.zeros((1, 2, 10, 64), np.float32)
    with pytest.raises(Exception, match="L <= the cache length"):
        session.run(None, {"q": q, "k": k, "v": k, "bias": np.zeros((1, 1, 1, 2, 11), np.float32)})
    with pytest.raises(Exception, match="Hkv dividing H"):
        session.run(None, {"q": np.zeros((1, 2, 5, 64), np.float32), "k": k, "v": k,
                           "bias": np.zeros((1, 1, 1, 2, 10), np.float32)})
    with pytest.raises(Exception, match="multiple of 8"):
        q6, k6 = np.zeros((1, 2, 4, 6), np.float32), np.zeros((1, 2, 10, 6), np.float32)
        session.run(None, {"q": q6, "k": k6, "v": k6, "bias": np.zeros((1, 1, 1, 2, 10), np.float32)})


def _packed_session(lib, isa: str, H: int, Hkv: int, kv: str = "float32", norms: bool = False):
    """A session of one PackedAttention (rope, cache writes and attention of a packed call's rows); `norms`: with
    Qwen3's q and k norms (inputs q_norm, k_norm; epsilon 1e-5, the reference's)."""
    names = ["qkv", "cos", "sin", "slots", "bias", "cells", "past_k", "past_v"] + (["q_norm", "k_norm"] if norms else [])
    node = helper.make_node("PackedAttention", names, ["Y", "present_k", "present_v"], domain="specrt",
                            scale=0.125, heads=H, kv_heads=Hkv, **({"epsilon": 1e-5} if norms else {}))
    types = {"slots": TensorProto.INT64, "cells": TensorProto.INT64, "past_k": KV_TYPES[kv], "past_v": KV_TYPES[kv]}
    f = lambda name: helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT), None)  # noqa: E731
    graph = helper.make_graph([node], "packed_attention", [f(n) for n in names],
                              [f("Y"), helper.make_tensor_value_info("present_k", KV_TYPES[kv], None),
                               helper.make_tensor_value_info("present_v", KV_TYPES[kv], None)])
    return _open(lib, graph, isa)


def _bits(x: np.ndarray, kv: str) -> np.ndarray:
    """A cache as its stored bits (numpy has no bfloat16: uint16)."""
    if kv == "float32":
        return x.copy()
    if kv == "float16":
        return x.astype(np.float16)
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _ortvalue(bits: np.ndarray, kv: str):
    onnx_type = KV_TYPES[kv] if kv == "bfloat16" else None
    return (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx_type) if onnx_type else
            ort.OrtValue.ortvalue_from_numpy(bits))


def _run_packed(session, feeds: dict, past_k: np.ndarray, past_v: np.ndarray, kv: str, in_place: bool, heads: int):
    """Y and the present caches' bits; `in_place`: present bound to past's own buffers (as the runtimes bind them),
    else to buffers of their own (the op copies past first)."""
    binding = session.io_binding()
    head_dim = feeds["qkv"].shape[1] // (heads + 2 * past_k.shape[1])
    y = np.full((len(feeds["cells"]), heads * head_dim), np.nan, np.float32)
    binding.bind_ortvalue_output("Y", ort.OrtValue.ortvalue_from_numpy(y))
    for name, x in feeds.items():
        binding.bind_cpu_input(name, x)
    k, v = _bits(past_k, kv), _bits(past_v, kv)
    pk, pv = _ortvalue(k, kv), _ortvalue(v, kv)
    binding.bind_ortvalue_input("past_k", pk)
    binding.bind_ortvalue_input("past_v", pv)
    if in_place:
        out_k, out_v = k, v
        binding.bind_ortvalue_output("present_k", pk)
        binding.bind_ortvalue_output("present_v", pv)
    else:
        out_k, out_v = np.full_like(k, 7), np.full_like(v, 7)
        ok, ov = _ortvalue(out_k, kv), _ortvalue(out_v, kv)
        binding.bind_ortvalue_output("present_k", ok)
        binding.bind_ortvalue_output("present_v", ov)
    session.run_with_iobinding(binding)
    return y, out_k, out_v


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x·cos + rotate_half(x)·sin in float32, each product and the sum rounded apart (ONNX's Mul, Mul, Add)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos).astype(np.float32) + (rotated * sin).astype(np.float32)


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_packed_attention_is_rope_cache_writes_then_cache_attention(ops_lib, isa, kv):
    """One PackedAttention = rope of the packed rows' q and k (the bits of ONNX's Mul/Mul/Add), k and v written at
    their cells' slots (rounded to the cache's type as ONNX Runtime's Cast rounds: nearest even), then
    CacheAttention over the written cache for exactly those cells, packed: the same bits, with present bound to
    past's buffer (written in place) or to a buffer of its own (past copied first, every other position kept)."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(11)
    for B, T, H, Hkv, D, S in ((1, 1, 9, 3, 64, 40), (4, 8, 9, 3, 64, 80), (2, 3, 2, 2, 8, 12)):
        packed = _packed_session(ops_lib, isa, H, Hkv, kv)
        attention = _attention_session(ops_lib, isa, 0.125, kv, cells=True)
        starts = rng.integers(0, S - T + 1, size=B)
        slots = (starts[:, None] + np.arange(T)[None]).astype(np.int64)
        angles = slots[..., None, None] * rng.uniform(0.01, 1.0, size=D // 2).repeat(2)[None, None, None]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)  # [B, T, 1, D]
        bias = _causal_bias(B, T, int(slots.max()) + 1, starts)
        real = [b * T + t for b in range(B) for t in range(rng.integers(0, T) + 1)]  # each slot's tokens
        cells = rng.permutation(real).astype(np.int64)
        P = len(cells)
        qkv = rng.normal(size=(P, (H + 2 * Hkv) * D)).astype(np.float32)
        past_k = rng.normal(size=(B, Hkv, S, D)).astype(np.float32)
        past_v = rng.normal(size=(B, Hkv, S, D)).astype(np.float32)
        # the reference: rope, the writes, CacheAttention on the grid
        want_k, want_v, q = _bits(past_k, kv), _bits(past_v, kv), np.zeros((B, T, H, D), np.float32)
        for i, c in enumerate(cells):
            b, t = divmod(int(c), T)
            heads = qkv[i].reshape(H + 2 * Hkv, D)
            q[b, t] = _rope(heads[:H], cos[b, t], sin[b, t])
            want_k[b, :, slots[b, t]] = _bits(_rope(heads[H:H + Hkv], cos[b, t], sin[b, t]), kv)
            want_v[b, :, slots[b, t]] = _bits(heads[H + Hkv:], kv)
        (grid,) = attention.run(None, {"q": q, "k": _ortvalue(want_k, kv), "v": _ortvalue(want_v, kv),
                                       "bias": bias, "cells": cells})
        want = grid.reshape(B * T, H * D)[cells]
        feeds = {"qkv": qkv, "cos": cos, "sin": sin, "slots": slots, "bias": bias, "cells": cells}
        for in_place in (True, False):
            y, got_k, got_v = _run_packed(packed, feeds, past_k, past_v, kv, in_place, H)
            what = f"{isa} {kv} B={B} T={T} H={H}/{Hkv} D={D} in place={in_place}"
            np.testing.assert_array_equal(got_k, want_k, err_msg=what)
            np.testing.assert_array_equal(got_v, want_v, err_msg=what)
            np.testing.assert_array_equal(y, want, err_msg=what)


@pytest.mark.parametrize("isa", ISAS)
def test_packed_attention_with_qk_norms_norms_each_head_before_its_rope(ops_lib, isa):
    """Qwen3's layers: with q_norm and k_norm, each q and k head is RMS-normed (the bits of specrt::RMSNorm, the
    reference's arithmetic) before its rope; v is written as it is. Against the same reference as above."""
    if not _supported(ops_lib, isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    rng = np.random.default_rng(12)
    B, T, H, Hkv, D, S = 2, 4, 4, 2, 64, 16
    packed = _packed_session(ops_lib, isa, H, Hkv, norms=True)
    attention = _attention_session(ops_lib, isa, 0.125, "float32", cells=True)
    starts = rng.integers(0, S - T + 1, size=B)
    slots = (starts[:, None] + np.arange(T)[None]).astype(np.int64)
    angles = slots[..., None, None] * rng.uniform(0.01, 1.0, size=D // 2).repeat(2)[None, None, None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    bias = _causal_bias(B, T, int(slots.max()) + 1, starts)
    cells = rng.permutation(B * T).astype(np.int64)
    qkv = (rng.normal(size=(B * T, (H + 2 * Hkv) * D)) * 3).astype(np.float32)
    qn, kn = (1 + 0.2 * rng.normal(size=(2, D))).astype(np.float32)
    past_k, past_v = rng.normal(size=(2, B, Hkv, S, D)).astype(np.float32)
    want_k, want_v, q = past_k.copy(), past_v.copy(), np.zeros((B, T, H, D), np.float32)
    for i, c in enumerate(cells):
        b, t = divmod(int(c), T)
        heads = qkv[i].reshape(H + 2 * Hkv, D)
        q[b, t] = _rope(reference.rms_norm(heads[:H], qn), cos[b, t], sin[b, t])
        want_k[b, :, slots[b, t]] = _rope(reference.rms_norm(heads[H:H + Hkv], kn), cos[b, t], sin[b, t])
        want_v[b, :, slots[b, t]] = heads[H + Hkv:]
    (grid,) = attention.run(None, {"q": q, "k": want_k, "v": want_v, "bias": bias, "cells": cells})
    feeds = {"qkv": qkv, "cos": cos, "sin": sin, "slots": slots, "bias": bias, "cells": cells, "q_norm": qn,
             "k_norm": kn}
    y, got_k, got_v = _run_packed(packed, feeds, past_k, past_v, "float32", True, H)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(y, grid.reshape(B * T, H * D)[cells])
    with pytest.raises(Exception, match=r"q_norm and k_norm must be \[D\]"):
        _run_packed(packed, {**feeds, "k_norm": kn[:8].copy()}, past_k, past_v, "float32", True, H)


def test_packed_attention_refuses_bad_cells_slots_and_shapes(ops_lib):
    B, T, H, Hkv, D, S = 2, 2, 4, 2, 8, 6
    session = _packed_session(ops_lib, "scalar", H, Hkv)
    feeds = {"qkv": np.zeros((2, (H + 2 * Hkv) * D), np.float32), "cos": np.ones((B, T, 1, D), np.float32),
             "sin": np.zeros((B, T, 1, D), np.float32), "slots": np.asarray([[0, 1], [2, 3]], np.int64),
             "bias": np.zeros((B, 1, 1, T, S), np.float32), "cells": np.asarray([0, 2], np.int64),
             "past_k": np.zeros((B, Hkv, S, D), np.float32), "past_v": np.zeros((B, Hkv, S, D), np.float32)}
    session.run(None, feeds)
    for change, want in (({"cells": np.asarray([0, 0], np.int64)}, "must not repeat"),
                         ({"cells": np.asarray([0, 4], np.int64)}, "cells must index"),
                         ({"slots": np.asarray([[0, 1], [6, 3]], np.int64)}, "outside the cache"),
                         ({"cells": np.asarray([0], np.int64)}, "one per qkv row"),
                         ({"qkv": np.zeros((2, 7 * D + 1), np.float32)}, r"\[P, \(H \+ 2 Hkv\) D\]"),
                         ({"sin": np.zeros((B, T, D), np.float32)}, "cos and sin"),
                         ({"bias": np.zeros((B, 1, 1, T, S + 1), np.float32)}, "L <= the cache length")):
        with pytest.raises(Exception, match=want):
            session.run(None, {**feeds, **change})
