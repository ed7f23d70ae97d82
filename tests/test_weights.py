"""Weight formats at export (`specrt export --weights float|int8|int4|gguf`): GGUF blocks go into the graph
exactly, every format runs and stays close to the float export, greedy speculative output equals AR."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q

from specrt import artifact as io
from specrt.cli import main
from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders import load_target
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint
from specrt.exporter.onnx.builder import GraphBuilder, WeightStore
from specrt.exporter.onnx.layers import embedding, linear
from specrt.blocks import BLOCK, Blocks
from specrt.exporter.onnx.quant import from_gguf, quantize
from specrt.runtime.backends import infer, load_runner
from test_export import TRT_OPS
from test_loaders import llama_cpp_permute
from test_speculative import copy_mtp

SETTINGS = io.ExportSettings(batch=4, max_seq=96, prefill_chunk=16, verify_len=5)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
# SmolLM2's mix: Q4_1 projections and a Q8_0 embedding; one Q4_0 matrix covers the third exact type
TYPES = {"token_embd": Q.Q8_0, "ffn_down": Q.Q4_0}
# max |logits - float logits| / max |float logits| per format (accuracy level 4: int8 activations)
REL_TOL = {"gguf0": 1e-5, "gguf": 0.05, "int8": 0.05, "int4": 0.25}


def write_gguf(model_dir: Path, out: Path, types: dict[str, Q]) -> Path:
    """The tiny HF model as a GGUF laid out like llama.cpp's converter, matrices quantized by gguf-py
    (`types`: GGUF short name -> type; Q4_1 otherwise), norms F32."""
    import gguf

    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    w = gguf.GGUFWriter(out, cfg.family)
    for add, value in ((w.add_block_count, cfg.num_layers), (w.add_context_length, cfg.max_position_embeddings),
                       (w.add_embedding_length, cfg.hidden_size), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_heads), (w.add_head_count_kv, cfg.num_kv_heads),
                       (w.add_key_length, cfg.head_dim), (w.add_value_length, cfg.head_dim),
                       (w.add_rope_dimension_count, cfg.head_dim), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_freq_base, cfg.rope_theta), (w.add_bos_token_id, 1), (w.add_eos_token_id, 2)):
        add(value)
    for name, t in load_target(model_dir).weights.items():
        if name == "model.embed_tokens.weight":
            short, gname = "token_embd", "token_embd.weight"
        elif name == "model.norm.weight":
            short, gname = "output_norm", "output_norm.weight"
        elif name == "lm_head.weight":
            short, gname = "output", "output.weight"
        else:
            i, mod, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name).groups()
            short, gname = GGUF_NAMES[mod], f"blk.{i}.{GGUF_NAMES[mod]}.{kind}"
            if mod in ("self_attn.q_proj", "self_attn.k_proj"):
                t = llama_cpp_permute(t, cfg.num_heads if "q_proj" in mod else cfg.num_kv_heads)
        qtype = types.get(short, Q.Q4_1) if t.ndim == 2 else Q.F32
        if qtype == Q.F16:
            w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float16))
        elif qtype == Q.F32:
            w.add_tensor(gname, np.ascontiguousarray(t))
        else:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    """A 3-layer tied llama as a quantized GGUF, with a random DSpark head and a copy-MTP head."""
    root = tmp_path_factory.mktemp("weights")
    model = tiny_model_dir("llama", tie=True, num_layers=3)
    return dict(model=model, gguf=write_gguf(model, root / "tiny.gguf", TYPES),
                draft=random_dspark_checkpoint(root / "draft", model, layers=1, block_size=4, markov_rank=16),
                mtp=copy_mtp(random_mtp_checkpoint(root / "mtp_random", model), root / "mtp", model))


@pytest.fixture(scope="module")
def arts(tiny, tmp_path_factory):
    """format -> artifact of the GGUF with both heads ("gguf0": gguf at accuracy level 0)."""
    made: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in made:
            weights, level = ("gguf", 0) if fmt == "gguf0" else (fmt, 4)
            s = dataclasses.replace(SETTINGS, weights=weights, accuracy_level=level)
            made[fmt] = export_artifact(tiny["gguf"], tmp_path_factory.mktemp(fmt) / "art", s, draft=tiny["draft"],
                                        mtp=tiny["mtp"], progress=False)
        return made[fmt]

    return get


def _logits(art: Path, ids: np.ndarray) -> np.ndarray:
    """Target logits of every token of `ids` [1, T] (a verify-bucket call from an empty cache)."""
    m = io.load_manifest(art)
    runner = load_runner("ort", art, m, io.TARGET, threads=1)
    runner.allocate(1)
    t = ids.shape[1]
    feeds = {io.INPUT_IDS: ids, io.POSITION_IDS: np.arange(t)[None], io.WRITE_INDEX: np.zeros(1, np.int64),
             io.TOKEN_ROWS: np.arange(t), io.LOGIT_ROWS: np.arange(t)}
    return infer(runner, 0, feeds)[io.LOGITS].copy()


# ---- the blocks themselves -------------------------------------------------------------------------

def _ref_matmul(x: np.ndarray, b: Blocks) -> np.ndarray:
    """A numpy MatMulNBits (+ the Q4_1 mins term), written from the op's spec, not from quant.py."""
    n, kb, blob = b.codes.shape
    raw = b.codes.reshape(n, kb * blob)
    codes = raw if b.bits == 8 else np.stack([raw & 15, raw >> 4], -1).reshape(n, -1)  # element 2i: low nibble
    if b.zeros is None:
        zeros = np.full((n, kb), 1 << (b.bits - 1))
    else:
        zeros = b.zeros if b.bits == 8 else np.stack([b.zeros & 15, b.zeros >> 4], -1).reshape(n, -1)[:, :kb]
    w = (codes.reshape(n, kb, BLOCK).astype(np.float64) - zeros[..., None]) * b.scales[..., None]
    y = x.astype(np.float64) @ w.reshape(n, -1).T
    if b.mins is not None:
        y += x.reshape(len(x), kb, BLOCK).sum(-1) @ b.mins.T.astype(np.float64)
    return y


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_are_exact(qtype, tmp_path):
    """MatMulNBits over the file's blocks (+ blocksum(x)·mins for Q4_1) == x @ dequant(W)ᵀ: numpy and ONNX
    Runtime (accuracy level 0); GatherBlockQuantized rows == the dequantized rows."""
    import gguf
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 128)).astype(np.float32) * 0.1
    raw = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    b = from_gguf(raw, qtype.name)
    assert np.array_equal(b.dequantize(), ref)  # the exact weights, fp16 scales/mins widened to fp32
    x = rng.standard_normal((5, 128)).astype(np.float32)
    np.testing.assert_allclose(_ref_matmul(x, b), x.astype(np.float64) @ ref.T, atol=1e-4)

    store = WeightStore(tmp_path / "w.bin")
    for name, t in b.tensors("w").items():
        store.add(name, t)
    store.close()
    g = GraphBuilder(store, accuracy_level=0)
    g.input("x", "float32", ["N", 128])
    g.input("ids", "int64", ["M"])
    g.output(linear(g, "x", g.weight("w")), "y", "float32", ["N", 96])
    g.output(embedding(g, g.weight("w"), "ids"), "rows", "float32", ["M", 128])
    model = g.model("blocks")
    assert {o.domain for o in model.opset_import} == {"", "com.microsoft"}
    onnx.save(model, store.path.parent / "m.onnx")
    sess = ort.InferenceSession(str(store.path.parent / "m.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([0, 5, 95], np.int64)
    y, rows = sess.run(None, {"x": x, "ids": ids})
    assert np.abs(y - x @ ref.T).max() < 1e-4
    np.testing.assert_array_equal(rows, ref[ids])


def test_loader_keeps_blocks_of_exact_types(tiny):
    loaded = load_target(tiny["gguf"])
    kinds = {b.kind for b in loaded.blocks.values()}
    assert kinds == {"Q4_0", "Q4_1", "Q8_0"}
    for name, b in loaded.blocks.items():  # Q/K rows are un-permuted like the float weights
        assert np.array_equal(b.dequantize(), loaded.weights[name]), name


def test_ort_quantizer_roundtrip():
    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    for bits, sym, tol in ((4, False, 0.2), (8, True, 0.02)):
        b = quantize(w, bits, symmetric=sym)
        assert b.codes.shape == (64, 3, BLOCK * bits // 8) and (b.zeros is None) == sym
        assert np.abs(b.dequantize() - w).max() < tol * np.abs(w).max()


# ---- exports -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["gguf0", "gguf", "int8", "int4"])
def test_format_matches_float_export(arts, fmt):
    ids = np.array([[1, 17, 42, 99, 200]], np.int64)
    ref = _logits(arts("float"), ids)
    diff = np.abs(_logits(arts(fmt), ids) - ref).max()
    print(f"{fmt}: max |logits - float| = {diff:.3g} (max |logits| {np.abs(ref).max():.3g})")
    assert diff <= REL_TOL[fmt] * np.abs(ref).max()


def test_manifest_and_inspect(arts):
    fl, gg = (io.load_manifest(arts(f)) for f in ("float", "gguf"))
    assert (fl.export.weights, gg.export.weights, gg.export.accuracy_level) == ("float", "gguf", 4)
    cfg = fl.model
    d, ff, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    params = cfg.num_layers * ((q + 2 * kv) * d + d * q + 2 * ff * d + d * ff) + cfg.vocab_size * d + d
    assert fl.weights.bytes_per_token == 4 * params  # fp32 matmuls + the tied head + one embedding row
    assert 0 < gg.weights.bytes_per_token < fl.weights.bytes_per_token / 4
    for g in gg.graphs.values():  # quantized graphs import ORT's contrib domain, float ones do not
        domains = {o.domain for o in onnx.load(str(arts("gguf") / g.file), load_external_data=False).opset_import}
        assert "com.microsoft" in domains
    for g in fl.graphs.values():  # float graphs stay TensorRT-parsable
        model = onnx.load(str(arts("float") / g.file), load_external_data=False)
        # specrt's own domain holds one node, ConfidenceTruncate, a TensorRT plugin (DSpark with a confidence head)
        assert {o.domain for o in model.opset_import} <= {"", "specrt"}
        assert {n.op_type for n in model.graph.node if n.domain != "specrt"} <= TRT_OPS
    out = CliRunner().invoke(main, ["inspect", str(arts("gguf"))]).output
    assert "gguf, accuracy level 4" in out and "read per decoded token" in out


@pytest.mark.parametrize("fmt", ["gguf", "int4"])
def test_greedy_speculative_equals_ar(arts, fmt):
    from specrt.runtime.engine import Engine, Request
    from specrt.runtime.sampling import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 256, n)) for n in (5, 19, 33)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = {}
    for method in ("ar", "ngram", "mtp", "dspark"):
        engine = Engine(arts(fmt), method=method, threads=1)
        got, _ = engine.generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
        outs[method] = [o.output_ids for o in got]
    assert outs["ngram"] == outs["ar"] and outs["mtp"] == outs["ar"] and outs["dspark"] == outs["ar"]


def test_torch_backend_reads_quantized_artifact(arts):
    from specrt.tools.compare import compare_artifact

    c = compare_artifact(arts("gguf0"), ("ort", "torch"), atol=1e-3, threads=1)
    bad = [d for d in c.diffs if not d.ok]
    assert not bad, bad[:3]


def test_unsupported_gguf_type_falls_back_with_a_warning(tiny, tiny_model_dir, tmp_path, capsys):
    path = write_gguf(tiny["model"], tmp_path / "mixed.gguf", {**TYPES, "ffn_up": Q.F16})
    s = io.ExportSettings(batch=1, max_seq=64, prefill_chunk=8, verify_len=2, weights="gguf")
    art = export_artifact(path, tmp_path / "art", s, progress=False)
    err = capsys.readouterr().err
    assert "warning" in err and "int8" in err and "gate_up_proj" in err
    assert np.isfinite(_logits(art, np.array([[1, 2]], np.int64))).all()
    with pytest.raises(SpecrtError, match="not a GGUF"):  # an HF directory has no blocks to keep
        export_artifact(tiny["model"], tmp_path / "hf", s, progress=False)
    with pytest.raises(SpecrtError, match="float32"):
        io.ExportSettings(batch=1, max_seq=64, prefill_chunk=8, verify_len=2, weights="int4", dtype="float16")
