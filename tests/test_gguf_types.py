"""Every GGUF block type specrt's kernels read, in the models GGUF users run: tiny random llama, qwen2 and qwen3 GGUF
files written here (each with Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K matrices, mixed as llama.cpp's
Q4_K_M mixes them: a layer's v in Q6_K beside its q and k in Q4_K), exported with no flags. Checked: the export takes
the file's own blocks onto specrt's kernels and says so, the weight file holds the file's bytes, nothing falls back to
Q8_0, the logits stay as close to the float model as the activations' rounding allows, and `ngram` gives `ar`'s
greedy tokens."""
from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from specrt import artifact as io
from specrt.runtime.config import EngineConfig
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams
from kquants import quantize_k
from test_cli import cli
from test_kernels_export import tiny_gguf_writer

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-quant rows: K a multiple of 256
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# per family: the embedding's and the LM head's types (None: tied), and per layer each matrix's
GLOBAL = {"llama": ("Q4_K", "Q6_K"), "qwen2": ("Q6_K", None), "qwen3": ("Q5_K", "Q8_0")}
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q5_0",
     "ffn_up": "Q5_1", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q5_K", "attn_output": "Q4_0", "ffn_gate": "Q4_K",
     "ffn_up": "Q4_K", "ffn_down": "Q4_1"},
]
SETTINGS = io.ExportSettings(batch=2, max_seq=256, prefill_chunk=16, verify_len=5)


def _blocks(x: np.ndarray, kind: str) -> np.ndarray:
    return quantize_k(x, kind) if kind in K_QUANTS else quantize(x, gguf.GGMLQuantizationType[kind])


def write_typed_gguf(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny random `family` GGUF with a byte-level BPE vocabulary and the block types of GLOBAL and LAYER_TYPES."""
    w, vocab = tiny_gguf_writer(path, family, layers=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS)
    head_dim = HIDDEN // HEADS
    rng = np.random.default_rng(seed)

    def add(name: str, kind: str, shape: tuple[int, int], std: float) -> None:
        x = (rng.standard_normal(shape) * std).astype(np.float32)
        x += 0.02 * rng.standard_normal(shape).astype(np.float32) if kind in ("Q4_1", "Q5_1") else 0
        w.add_tensor(name, _blocks(x, kind), raw_dtype=gguf.GGMLQuantizationType[kind])

    def vector(name: str, n: int, mean: float = 1.0) -> None:
        w.add_tensor(name, (mean + 0.1 * rng.standard_normal(n)).astype(np.float32))

    embed, head = GLOBAL[family]
    add("token_embd.weight", embed, (vocab, HIDDEN), 1.0)
    if head:
        add("output.weight", head, (vocab, HIDDEN), HIDDEN ** -0.5)
    vector("output_norm.weight", HIDDEN)
    for i, types in enumerate(LAYER_TYPES):
        for kind, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV_HEADS * head_dim, HIDDEN)),
                            ("attn_v", (KV_HEADS * head_dim, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            add(f"blk.{i}.{kind}.weight", types[kind], shape, shape[1] ** -0.5)
        vector(f"blk.{i}.attn_norm.weight", HIDDEN)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN)
        if family == "qwen2":
            for kind, n in (("attn_q", HIDDEN), ("attn_k", KV_HEADS * head_dim), ("attn_v", KV_HEADS * head_dim)):
                vector(f"blk.{i}.{kind}.bias", n, mean=0.0)
        if family == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", head_dim)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_test_quantizer_writes_what_gguf_reads():
    """tests/kquants.py's K-quant blocks, read back by gguf's own dequantization, are the weights to within the
    rounding of their codes (a layout error would give garbage)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    for kind, rel in (("Q4_K", 0.12), ("Q5_K", 0.06), ("Q6_K", 0.04)):
        back = gguf.quants.dequantize(quantize_k(w, kind), gguf.GGMLQuantizationType[kind])
        assert np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2)) < rel, kind


@pytest.fixture(scope="module")
def arts(cpp_build, tmp_path_factory):
    """{family: (the GGUF, its artifact exported by `specrt export FILE.gguf` with no format flags, its float
    artifact)}."""
    from specrt.exporter.export import export_artifact

    mp = pytest.MonkeyPatch()
    mp.setenv("SPECRT_OPS_LIB", str(cpp_build / "libspecrt_ops.so"))
    root = tmp_path_factory.mktemp("gguf_types")
    out = {}
    for family in GLOBAL:
        path = write_typed_gguf(root / f"{family}.gguf", family)
        result = cli("export", path, "--out", root / family, "--max-seq-len", 256, "--batch", 2, "--no-profile",
                     "--quiet")
        assert result.exit_code == 0, result.output + result.stderr
        assert "warning" not in result.stderr, result.stderr  # nothing fell back
        out[family] = (path, root / family, result.stderr,
                       export_artifact(path, root / f"{family}-float", dataclasses.replace(SETTINGS, weights="float"),
                                       progress=False))
    yield out
    mp.undo()


@pytest.mark.parametrize("family", list(GLOBAL))
def test_a_gguf_exports_onto_the_kernels_with_every_block_type_as_the_files_bytes(arts, family):
    path, art, stderr, _ = arts[family]
    m = io.load_manifest(art)
    assert (m.export.weights, m.export.attention, m.export.kernels) == ("gguf", "cpu", "specrt")
    graph = onnx.load(str(art / "target.onnx"), load_external_data=False).graph
    formats = collections.Counter(next(a.s.decode() for a in n.attribute if a.name == "format")
                                  for n in graph.node if n.op_type in ("MatMulGGUF", "GatherGGUF"))
    embed, head = GLOBAL[family]
    want = collections.Counter(t for types in LAYER_TYPES for t in types.values())
    want.update([embed, head or embed])
    # runs of one type in a stack are one product: layer 0's q/k (Q4_K), layer 1's q/k/v (Q5_K) and gate/up (Q4_K)
    want.subtract({"Q5_K": 2, "Q4_K": 2})
    assert formats == +want, formats
    assert not [n for n in graph.node if n.op_type == "MatMulNBits"]
    # layer 0's q/k (Q4_K) and v (Q6_K): a product per type, concatenated; its gate (Q5_0) and up (Q5_1) too
    names = {i.name for i in graph.initializer}
    for stacked, parts in (("self_attn.qkv_proj", ("Q4_K", "Q6_K")), ("mlp.gate_up_proj", ("Q5_0", "Q5_1"))):
        assert {f"model.layers.0.{stacked}.weight.part{i}.gguf.{t}" for i, t in enumerate(parts)} <= names
    # the file's bytes, unchanged
    raw = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    init = next(i for i in graph.initializer if i.name == "model.layers.0.mlp.down_proj.weight.gguf.Q6_K")
    entry = {e.key: e.value for e in init.external_data}
    data = (art / entry["location"]).read_bytes()[int(entry["offset"]):][:int(entry["length"])]
    assert data == np.asarray(raw.data).tobytes()
    # the export says what it chose and what a token reads
    assert "specrt's kernels" in stderr and "Q6_K" in stderr and "MiB read per decoded token" in stderr


@pytest.mark.parametrize("family", list(GLOBAL))
def test_logits_stay_close_to_the_float_model(arts, family):
    """Teacher-forced logits of the kernel artifact against the same file's float model (weights dequantized by
    gguf, activations unrounded): off only by the activations' int8 rounding."""
    from specrt.tools.parity import _specrt_logits

    _, art, _, float_art = arts[family]
    ids = [1, *np.random.default_rng(1).integers(3, 250, size=31).tolist()]
    logits = {}
    for name, a in (("kernels", art), ("float", float_art)):
        with Engine(a, EngineConfig(threads=2)) as engine:
            logits[name] = _specrt_logits(engine, ids)
    scale = np.abs(logits["float"]).max()
    off = np.abs(logits["kernels"] - logits["float"])
    assert off.max() < 0.05 * scale and off.mean() < 0.01 * scale, (off.max(), off.mean(), scale)
    # the argmax agrees wherever the float model is not near a tie
    top2 = np.sort(logits["float"], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 4 * off.max()
    assert (logits["kernels"].argmax(-1) == logits["float"].argmax(-1))[clear].all()


@pytest.mark.parametrize("family", list(GLOBAL))
def test_ngram_gives_ar_tokens(arts, family):
    _, art, _, _ = arts[family]
    prompts = [[1, 70, 71, 72, 73, 74, 70, 71, 72], [1, *range(100, 130)]]
    reqs = [Request(p, SamplingParams(max_new_tokens=32, ignore_eos=True), id=i) for i, p in enumerate(prompts)]
    with Engine(art, EngineConfig(threads=2)) as engine:
        want = [o.output_ids for o in engine.generate(reqs)[0]]
    with Engine.open(art, EngineConfig(method="ngram", threads=2)) as engine:
        got, _ = engine.generate(reqs)
    assert [o.output_ids for o in got] == want


def test_without_the_kernels_a_gguf_falls_back_and_says_which_matrices(arts, tmp_path):
    """`--kernels stock`: ONNX Runtime's MatMulNBits holds Q4_0 / Q4_1 / Q8_0 exactly; the other types fall back to
    int8 blocks, named with their types in one warning line."""
    path = arts["llama"][0]
    result = cli("export", path, "--out", tmp_path / "stock", "--kernels", "stock", "--no-profile", "--quiet",
                 "--max-seq-len", 256, "--batch", 2)
    assert result.exit_code == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "stored as int8" in warning[0], result.stderr
    # every one, by type and place: layer 0's down (Q6_K), its q/k/v (Q4_K+Q6_K) and gate/up (Q5_0+Q5_1), ...
    for kind, name in (("Q6_K", "model.layers.0.mlp.down_proj.weight"), ("Q6_K", "lm_head.weight"),
                       ("Q4_K+Q6_K", "model.layers.0.self_attn.qkv_proj.weight"),
                       ("Q5_K", "model.layers.1.self_attn.qkv_proj.weight")):
        assert re.search(rf"(^|; |: ){re.escape(kind)}: [^;]*{re.escape(name)}", warning[0]), (kind, name, warning[0])
    assert json.loads((tmp_path / "stock" / "manifest.json").read_text())["export"]["kernels"] == "stock"


@pytest.mark.parametrize("family", list(GLOBAL))
def test_cpp_runtime_gives_python_tokens(arts, cpp_build, family):
    """The C++ runtime runs the same artifact (the kernels found beside libspecrt) to the Python engine's tokens."""
    import os
    import subprocess

    _, art, _, _ = arts[family]
    prompts = [[1, 70, 71, 72, 73, 74, 70, 71, 72], [1, *range(100, 130)]]
    with Engine(art, EngineConfig(threads=2)) as engine:
        reqs = [Request(p, SamplingParams(max_new_tokens=24, ignore_eos=True), id=i) for i, p in enumerate(prompts)]
        want = [o.output_ids for o in engine.generate(reqs)[0]]
    env = {k: v for k, v in os.environ.items() if k != "SPECRT_OPS_LIB"}
    args = [str(cpp_build / "specrt-cpp"), str(art), "--method", "ngram", "--max-new-tokens", "24", "--ignore-eos",
            "--threads", "2", "--json"]
    for p in prompts:
        args += ["--input-ids", ",".join(map(str, p))]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["outputs"] == want


def test_packed_weights_leave_the_files_pages(arts):
    """Once a MatMulGGUF has packed its weight, the pages of weights.bin that held it leave the process's resident
    memory (the weights are in memory once: peak RSS about the weights plus the cache); $SPECRT_OPS_KEEP_PAGES=1
    keeps them. Measured in a process of its own, from /proc/self/smaps, after the engine is made and has decoded."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from specrt.runtime.config import EngineConfig\n"
        "from specrt.runtime.engine import Engine, Request\n"
        "from specrt.runtime.sampling import SamplingParams\n"
        "e = Engine(sys.argv[1], EngineConfig(threads=2))\n"
        "e.generate([Request([1, 70, 71], SamplingParams(max_new_tokens=4, ignore_eos=True), id=0)])\n"
        "rss, inside = 0, False\n"
        "for line in open('/proc/self/smaps'):\n"
        "    if '-' in line.split(' ', 1)[0]:\n"
        "        inside = line.rstrip().endswith('weights.bin')\n"
        "    elif inside and line.startswith('Rss:'):\n"
        "        rss += int(line.split()[1])\n"
        "print(rss)\n")
    art = arts["llama"][1]
    size_kb = (art / "weights.bin").stat().st_size // 1024
    kept = {}
    for keep in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", script, str(art)], capture_output=True, text=True, timeout=300,
                           env={**__import__("os").environ, "SPECRT_OPS_KEEP_PAGES": keep})
        assert r.returncode == 0, r.stderr
        kept[keep] = int(r.stdout.strip().splitlines()[-1])
    assert kept["1"] > 0.6 * size_kb, kept  # the packing read every matrix's pages
    assert kept["0"] < 0.5 * kept["1"], kept  # and they were given back
