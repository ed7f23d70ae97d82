"""`specrt export --kernels specrt`: a GGUF's blocks kept as the file's bytes and attention fused, run by specrt's
ONNX Runtime kernels (libspecrt_ops, built by the C++ build fixture), on a tiny random Llama GGUF whose matrices are
Q4_0, Q4_1 and Q8_0 blocks (one layer's q/k/v of two formats: a product per format, concatenated), with random DSpark
and MTP heads (tests/test_gguf_types.py: the other block types). Checked: the graphs use the library's operators, the weight file holds the GGUF's bytes, the logits agree with
the stock-op artifact of the same file, every method under every scheduler gives `ar`'s greedy tokens, and a missing
library or an impossible combination of flags is one clear error."""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.runtime.config import EngineConfig
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.engine import Engine
from test_cli import assert_one_line_error, cli
from test_llama_cpp import MERGES, TEMPLATE, byte_tokens

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
Q = gguf.GGMLQuantizationType
# per tensor: its block format (layer 1's q and k differ: stacked q/k/v of two formats, one product per format)
TYPES = {"token_embd": Q.Q8_0, "output": Q.Q4_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1,
         "attn_output": Q.Q4_0, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1}
SETTINGS = io.ExportSettings(batch=3, max_seq=256, prefill_chunk=16, verify_len=5, weights="gguf", attention="cpu")
KERNELS = dataclasses.replace(SETTINGS, kernels="specrt")
HALF_CACHES = ("float16", "bfloat16")


def tiny_gguf_writer(path: Path, arch: str, *, layers: int, hidden: int, ffn: int, heads: int,
                     kv_heads: int) -> "tuple[gguf.GGUFWriter, int]":
    """(a GGUFWriter with a tiny model's header and a byte-level BPE vocabulary (test_llama_cpp's merges, a chat
    template), the vocabulary's size): the tensors are the caller's."""
    tokens = ["<pad>", "<s>", "</s>", *byte_tokens(), *("".join(m) for m in MERGES)]
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, arch)
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 512), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_key_length, head_dim), (w.add_value_length, head_dim),
                       (w.add_rope_dimension_count, head_dim), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_rope_freq_base, 10000.0), (w.add_tokenizer_model, "gpt2"), (w.add_token_list, tokens),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_pad_token_id, 0),
                       (w.add_add_bos_token, False), (w.add_chat_template, TEMPLATE)):
        add(value)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges([" ".join(m) for m in MERGES])
    return w, len(tokens)


def write_quantized_gguf(path: Path, seed: int = 0) -> Path:
    w, vocab = tiny_gguf_writer(path, "llama", layers=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS)
    head_dim = HIDDEN // HEADS
    rng = np.random.default_rng(seed)

    def add(name: str, kind: str, shape: tuple[int, int], std: float, qtype=None) -> None:
        x = (rng.standard_normal(shape) * std).astype(np.float32)
        x += 0.02 * rng.standard_normal(shape).astype(np.float32) if (qtype or TYPES[kind]) == Q.Q4_1 else 0
        qtype = qtype or TYPES[kind]
        w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", "token_embd", (vocab, HIDDEN), 1.0)
    add("output.weight", "output", (vocab, HIDDEN), 1.0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        for kind, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV_HEADS * head_dim, HIDDEN)),
                            ("attn_v", (KV_HEADS * head_dim, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            add(f"blk.{i}.{kind}.weight", kind, shape, shape[1] ** -0.5,
                Q.Q4_0 if (i, kind) == (1, "attn_q") else None)
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(the GGUF, a random DSpark checkpoint, a random MTP checkpoint)."""
    from specrt.exporter.loaders import load_target
    from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
    from specrt.exporter.loaders.mtp import random_mtp_checkpoint

    root = tmp_path_factory.mktemp("kernels")
    path = write_quantized_gguf(root / "tiny.gguf")
    target = load_target(path)
    draft = random_dspark_checkpoint(root / "dspark", target, layers=1, block_size=4, markov_rank=16)
    (root / "target_config").mkdir()
    (root / "target_config" / "config.json").write_text(json.dumps(target.config.to_hf()))
    return path, draft, random_mtp_checkpoint(root / "mtp", root / "target_config")


@pytest.fixture(scope="module")
def arts(sources, cpp_build, tmp_path_factory, monkeypatch_module):
    """{kernels: artifact} of the same GGUF and heads."""
    monkeypatch_module.setenv("SPECRT_OPS_LIB", str(cpp_build / "libspecrt_ops.so"))
    path, draft, mtp = sources
    root = tmp_path_factory.mktemp("kernels_arts")
    arts = {s.kernels: export_artifact(path, root / s.kernels, s, draft=draft, mtp=mtp, progress=False)
            for s in (SETTINGS, KERNELS)}
    from specrt.runtime.profile import save_profile
    from specrt.runtime.measure import measure

    save_profile(arts["specrt"], measure(arts["specrt"], threads=2, progress=False))  # what the C++ hybrids plan on
    arts["float"] = export_artifact(path, root / "float", dataclasses.replace(SETTINGS, weights="float"),
                                    progress=False)  # the GGUF's weights dequantized: no activation rounding
    for kv in HALF_CACHES:  # `--kv-dtype`: the target's cache in 16 bits
        arts[kv] = export_artifact(path, root / kv, dataclasses.replace(KERNELS, kv_dtype=kv), draft=draft, mtp=mtp,
                                   progress=False)
        save_profile(arts[kv], measure(arts[kv], threads=2, progress=False))
    return arts


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def target_nodes(art):
    return onnx.load(str(art / "target.onnx"), load_external_data=False).graph.node


def test_graphs_run_on_the_library_and_store_the_files_bytes(arts, sources):
    art = arts["specrt"]
    m = io.load_manifest(art)
    assert m.export.kernels == "specrt"
    ops = collections.Counter(n.op_type for n in onnx.load(str(art / "target.onnx"), load_external_data=False)
                              .graph.node if n.domain == "specrt")
    # every matrix of the target (2 layers x qkv, o, gate_up, down; the head; layer 1's q apart from its k/v), its
    # embedding, its attention (rope, cache writes and attention in one node), its norms (each layer's input norm and
    # the final one; the residual add and norm after attention)
    assert ops == {"MatMulGGUF": 2 * 4 + 1 + 1, "GatherGGUF": 1, "PackedAttention": 2, "RMSNorm": 2 + 1, "SkipRMSNorm": 2}
    # each MLP's SiLU and product are its gate/up node's: no Split, Sigmoid or stock norm left
    assert sum(n.op_type == "MatMulGGUF" and any(a.name == "activation" and a.s == b"swiglu" for a in n.attribute)
               for n in target_nodes(art)) == 2
    assert not {"Split", "Sigmoid", "RMSNormalization", "SkipSimplifiedLayerNormalization"} & {
        n.op_type for n in target_nodes(art)}
    target = onnx.load(str(art / "target.onnx"), load_external_data=False)
    assert not [n for n in target.graph.node if n.domain == "com.microsoft" and n.op_type == "MatMulNBits"]
    # ffn_down of layer 0 is the file's bytes, unchanged
    reader = gguf.GGUFReader(sources[0])
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    init = next(i for i in target.graph.initializer if i.name == "model.layers.0.mlp.down_proj.weight.gguf.Q4_1")
    entry = {e.key: e.value for e in init.external_data}
    data = (art / entry["location"]).read_bytes()[int(entry["offset"]):][:int(entry["length"])]
    assert data == np.asarray(raw.data).tobytes()
    # layer 1's q (Q4_0) and k/v (Q4_1) stack into one matrix of two formats: each run kept as the file has it
    names = {i.name for i in target.graph.initializer}
    assert {"model.layers.1.self_attn.qkv_proj.weight.part0.gguf.Q4_0",
            "model.layers.1.self_attn.qkv_proj.weight.part1.gguf.Q4_1"} <= names
    assert "model.layers.1.self_attn.qkv_proj.weight.gguf.Q8_0" not in names  # not the Q8_0 fallback
    # the draft heads' own matrices (trained in float) take Q4_1 blocks: every product of every graph on the library
    assert set(m.heads) == {"dspark", "mtp"}
    for name in m.heads:
        head = onnx.load(str(art / m.graphs[name].file), load_external_data=False)
        assert not [n.op_type for n in head.graph.node if n.domain == "com.microsoft" and n.op_type in
                    ("MatMulNBits", "GatherBlockQuantized")], name
        assert any(n.op_type == "MatMulGGUF" for n in head.graph.node), name
        assert any(i.name.startswith(name + ".") and i.name.endswith(".gguf.Q4_1") for i in head.graph.initializer)


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_fused_attention_is_the_unfused_graph_bit_for_bit(arts, sources, kv, monkeypatch, tmp_path):
    """A target layer's attention is one specrt::PackedAttention (rope, cache writes, attention of the packed rows);
    exported without it (rope, Cast and ScatterND nodes around a CacheAttention), the same GGUF gives the same logits
    bit for bit, at prefill, decoding and verify, with a float32 or a float16 cache."""
    from specrt.exporter.onnx import target
    from specrt.runtime.backends import infer

    monkeypatch.setattr(target, "fuses_attention", lambda *args: False)
    unfused = export_artifact(sources[0], tmp_path / "unfused", dataclasses.replace(KERNELS, kv_dtype=kv),
                              progress=False)
    ops = collections.Counter(n.op_type for n in onnx.load(str(unfused / "target.onnx"), load_external_data=False)
                              .graph.node if n.domain == "specrt")
    assert ops["CacheAttention"] == LAYERS and not ops["PackedAttention"]
    ids = [1, *np.random.default_rng(3).integers(3, 250, size=47).tolist()]
    calls = [16, 1, 1, 5, 3, 1, 4, 16, 1]  # a prefill chunk, decoding steps, verifies (sum: len(ids))
    logits = {}
    for name, art in (("fused", arts["specrt" if kv == "float32" else kv]), ("unfused", unfused)):
        with Engine(art, EngineConfig(threads=2)) as engine:
            runner = engine.target
            runner.allocate(max(runner.slots, 1))
            rows, start = [], 0
            for n in calls:
                feeds = {io.INPUT_IDS: np.asarray([ids[start:start + n]], np.int64),
                         io.POSITION_IDS: np.arange(start, start + n, dtype=np.int64)[None],
                         io.WRITE_INDEX: np.array([start], np.int64),
                         io.TOKEN_ROWS: np.arange(n, dtype=np.int64), io.LOGIT_ROWS: np.arange(n, dtype=np.int64)}
                rows.append(infer(runner, 0, feeds)[io.LOGITS].copy())
                start += n
            logits[name] = np.concatenate(rows)
    assert start == len(ids)
    np.testing.assert_array_equal(logits["fused"], logits["unfused"])


def test_logits_as_close_to_the_float_model_as_the_stock_ops(arts):
    """Teacher-forced logits against the same GGUF's float model (weights dequantized, activations unrounded): no
    further off than ONNX Runtime's int8-activation path (accuracy level 4) on the same blocks, which also
    quantizes activations per 32-block (its Q4_1 minimums as a second product; layer 1's fallback its int8)."""
    from specrt.tools.parity import _specrt_logits

    ids = [1, *np.random.default_rng(1).integers(3, 250, size=47).tolist()]
    logits = {}
    for name, art in arts.items():
        with Engine(art, EngineConfig(threads=2)) as engine:
            logits[name] = _specrt_logits(engine, ids)
    off = {name: np.abs(logits[name] - logits["float"]) for name in ("specrt", "stock")}
    assert off["specrt"].mean() <= 1.2 * off["stock"].mean(), {k: v.mean() for k, v in off.items()}
    assert off["specrt"].max() <= 1.2 * off["stock"].max(), {k: v.max() for k, v in off.items()}
    assert off["specrt"].max() < 0.05 * np.abs(logits["float"]).max()


METHODS = ("ngram", "dspark", "mtp", "dspark+ngram", "mtp+ngram")


@pytest.mark.parametrize("scheduler", ["fixed", "threshold", "sps", "sps-async"])
def test_every_method_gives_ar_tokens(arts, scheduler):
    art = arts["specrt"]
    prompts = [[1, 70, 71, 72, 73, 74, 70, 71, 72], [1, *range(100, 140)], [1, 5, 9, 200, 3, 5, 9]]
    reqs = [Request(p, SamplingParams(max_new_tokens=40, ignore_eos=True), id=i) for i, p in enumerate(prompts)]
    with Engine(art, EngineConfig(threads=2)) as engine:
        want = [o.output_ids for o in engine.generate(reqs)[0]]
    for method in METHODS:
        with Engine.open(art, EngineConfig(method=method, scheduler=scheduler, threads=2)) as engine:
            got, stats = engine.generate(reqs)
        assert [o.output_ids for o in got] == want, f"{method} / {scheduler}"
        assert stats.to_dict()["rounds"] > 0


def test_missing_library_is_one_clear_error(arts, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRT_OPS_LIB", str(tmp_path / "nowhere.so"))
    with pytest.raises(SpecrtError, match="SPECRT_OPS_LIB names .*nowhere.so, which is not a file"):
        Engine(arts["specrt"])
    assert_one_line_error(cli("run", arts["specrt"], "--input-ids", "1,70,71", "--max-new-tokens", "2"),
                          "nowhere.so, which is not a file")
    Engine(arts["stock"]).close()  # stock-op artifacts need no library


@pytest.mark.parametrize("which", ["text file", "libc"])
def test_a_library_that_is_not_the_kernels_is_one_clear_error(arts, monkeypatch, tmp_path, which):
    """$SPECRT_OPS_LIB naming a file that is not libspecrt_ops: one line, not ONNX Runtime's traceback."""
    import ctypes.util

    if which == "text file":
        lib = tmp_path / "passwd"
        lib.write_text("root:x:0:0:root:/root:/bin/bash\n")
    else:
        found = ctypes.util.find_library("c")
        lib = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libc.so.6") if Path(p).is_file()), None)
        if lib is None:
            pytest.skip(f"no libc file to name here ({found})")
    monkeypatch.setenv("SPECRT_OPS_LIB", str(lib))
    assert_one_line_error(cli("run", arts["specrt"], "--input-ids", "1,70,71", "--max-new-tokens", "2"),
                          "is not specrt's kernels library (libspecrt_ops.so)")


def test_the_cpp_runtime_refuses_a_library_that_is_not_the_kernels(arts, cpp_build, tmp_path):
    """$SPECRT_OPS_LIB naming a text file, libc or libspecrt itself: one line from specrt-cpp too."""
    import os
    import subprocess

    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libc.so.6") if Path(p).is_file()), None)
    for lib in filter(None, (text, libc, cpp_build / "libspecrt.so")):
        r = subprocess.run([str(cpp_build / "specrt-cpp"), str(arts["specrt"]), "--input-ids", "1,70,71",
                            "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "SPECRT_OPS_LIB": str(lib)})
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "which is not specrt's kernels library (libspecrt_ops.so)" in r.stderr, r.stderr


def test_a_triton_repository_declares_the_kernels_library(arts, tmp_path):
    """`specrt triton` on an artifact on specrt's kernels: each graph model's config names the library it copied
    (model_operations), as Triton's ONNX Runtime backend needs to load the graph; `--check` finds a config that
    does not, or names another file. The graph loads in ONNX Runtime with the library the config names, as the
    backend loads it."""
    import onnxruntime as ort
    from google.protobuf import text_format

    from specrt.serve.triton.check import _model_config_pb2, check_repository
    from specrt.serve.triton.repository import write_repository

    repo = tmp_path / "repo"
    write_repository(arts["specrt"], repo, max_tokens=4, threads=1)
    cfg = text_format.Parse((repo / "specrt_target" / "config.pbtxt").read_text(), _model_config_pb2().ModelConfig())
    (library,) = cfg.model_operations.op_library_filename
    assert Path(library) == (repo / "specrt_target" / "libspecrt_ops.so").resolve() and Path(library).is_file()
    assert check_repository(repo)["problems"] == []
    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    ort.InferenceSession(str(repo / "specrt_target" / "1" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    config = repo / "specrt_target" / "config.pbtxt"
    text = config.read_text()
    config.write_text(text[:text.index("model_operations")])
    problems = "\n".join(check_repository(repo)["problems"])
    assert "specrt_target/1/model.onnx: runs on specrt's kernels" in problems and "names no op library" in problems
    config.write_text(text.replace(library, "/etc/passwd"))
    problems = "\n".join(check_repository(repo)["problems"])
    assert "specrt_target/1/model.onnx: its op library: /etc/passwd is not specrt's kernels library" in problems


def test_kernels_need_gguf_blocks_on_the_cpu(sources, tmp_path):
    assert_one_line_error(cli("export", sources[0], "--out", tmp_path / "a", "--weights", "int4", "--attention", "cpu",
                              "--kernels", "specrt", "--no-profile", "--quiet"),
                          "--kernels specrt runs a GGUF's own blocks on the CPU: it needs --weights gguf and "
                          "--attention cpu (got --weights int4 --attention cpu)")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("method", ["ar", "dspark+ngram", "mtp"])
def test_cpp_runtime_loads_the_library_and_gives_python_tokens(arts, cpp_build, method):
    """libspecrt finds libspecrt_ops beside itself (no $SPECRT_OPS_LIB) and gives the Python engine's tokens."""
    import os
    import subprocess

    prompts = [[1, 70, 71, 72, 73, 74, 70, 71, 72], [1, *range(100, 140)]]
    with Engine(arts["specrt"], EngineConfig(threads=2)) as engine:
        reqs = [Request(p, SamplingParams(max_new_tokens=32, ignore_eos=True), id=i) for i, p in enumerate(prompts)]
        want = [o.output_ids for o in engine.generate(reqs)[0]]
    env = {k: v for k, v in os.environ.items() if k != "SPECRT_OPS_LIB"}
    args = [str(cpp_build / "specrt-cpp"), str(arts["specrt"]), "--method", method, "--scheduler", "sps",
            "--max-new-tokens", "32", "--ignore-eos", "--threads", "2", "--json"]
    for p in prompts:
        args += ["--input-ids", ",".join(map(str, p))]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["outputs"] == want


@pytest.mark.parametrize("kv", HALF_CACHES)
def test_half_caches_keep_every_method_exact(arts, cpp_build, kv):
    """`--kv-dtype float16 / bfloat16`: the target's cache is declared and stored in 16 bits (keys and values cast
    once, when written); logits stay near the float32 cache's; every method gives `ar`'s tokens, and the C++ runtime
    gives Python's."""
    import os
    import subprocess

    from specrt.tools.parity import _specrt_logits

    art = arts[kv]
    m = io.load_manifest(art)
    assert m.export.kv_dtype == kv
    target = onnx.load(str(art / "target.onnx"), load_external_data=False)
    want_type = onnx.TensorProto.FLOAT16 if kv == "float16" else onnx.TensorProto.BFLOAT16
    caches = [vi for vi in (*target.graph.input, *target.graph.output) if vi.name.startswith(("past.", "present."))]
    assert len(caches) == 4 * LAYERS and all(vi.type.tensor_type.elem_type == want_type for vi in caches)
    ids = [1, *np.random.default_rng(1).integers(3, 250, size=47).tolist()]
    logits = {}
    for name in ("specrt", kv):
        with Engine(arts[name], EngineConfig(threads=2)) as engine:
            logits[name] = _specrt_logits(engine, ids)
    assert not np.array_equal(logits[kv], logits["specrt"])  # the cache really is rounded
    assert np.abs(logits[kv] - logits["specrt"]).max() < 0.02 * np.abs(logits["specrt"]).max()

    prompts = [[1, 70, 71, 72, 73, 74, 70, 71, 72], [1, *range(100, 140)], [1, 5, 9, 200, 3, 5, 9]]
    reqs = [Request(p, SamplingParams(max_new_tokens=40, ignore_eos=True), id=i) for i, p in enumerate(prompts)]
    with Engine(art, EngineConfig(threads=2)) as engine:
        want = [o.output_ids for o in engine.generate(reqs)[0]]
    for method in METHODS:
        for scheduler in ("fixed", "sps"):
            with Engine.open(art, EngineConfig(method=method, scheduler=scheduler, threads=2)) as engine:
                got, _ = engine.generate(reqs)
            assert [o.output_ids for o in got] == want, f"{kv}: {method} / {scheduler}"
    env = {k: v for k, v in os.environ.items() if k != "SPECRT_OPS_LIB"}
    for method in ("ar", "dspark+ngram"):
        args = [str(cpp_build / "specrt-cpp"), str(art), "--method", method, "--max-new-tokens", "40", "--ignore-eos",
                "--threads", "2", "--json"]
        for p in prompts:
            args += ["--input-ids", ",".join(map(str, p))]
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1])["outputs"] == want, f"{kv}: C++ {method}"


def test_half_caches_need_the_kernels(sources, tmp_path):
    assert_one_line_error(cli("export", sources[0], "--out", tmp_path / "a", "--weights", "gguf", "--attention", "cpu",
                              "--kernels", "stock", "--kv-dtype", "float16", "--no-profile", "--quiet"),
                          "--kv-dtype float16 is a cache that specrt's CacheAttention reads: it needs --kernels "
                          "specrt (got --kernels stock)")
    assert not (tmp_path / "a").exists()
