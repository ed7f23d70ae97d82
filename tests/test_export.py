"""Export of tiny random models: parity with transformers, generation, artifact structure, failure modes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.exporter import export as export_mod
from specrt.exporter.export import export_artifact
from specrt.runtime.backends.base import StepInputs
from specrt.runtime.backends.ort import OrtRunner
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams

SETTINGS = io.ExportSettings(batch=4, max_seq=128, prefill_chunk=16, verify_len=5)
# case id -> (conftest kind, tie); llama is exported both tied and untied
CASES = {"llama_tied": ("llama", True), "llama_untied": ("llama", False), "qwen2": ("qwen2", None),
         "qwen3": ("qwen3", None), "llama3_scaled": ("llama3_scaled", None), "mistral": ("mistral", None), "llama_bias": ("llama_bias", None)}
SEQ = 20  # tokens compared against transformers
ATOL = 1e-4

# Ops the TensorRT ONNX parser supports (onnx-tensorrt docs/operators.md, "Operator Support Matrix",
# rows marked Y). Deliberately only the plain-tensor subset a decoder graph can use; extend it from
# the same document when the exporter starts emitting another op.
TRT_OPS = frozenset("""
Abs Add And ArgMax ArgMin Cast Ceil Clip Concat Constant ConstantOfShape Cos CumSum Div Einsum Equal Erf
Exp Expand Flatten Floor Gather GatherElements GatherND Gemm Greater GreaterOrEqual Identity If IsNaN Less
LessOrEqual Log LogSoftmax MatMul Max Mean Min Mod Mul Neg NonZero Not OneHot Or Pad Pow Range Reciprocal
ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum
ReduceSumSquare Relu Reshape ScatterElements ScatterND Shape Sigmoid Sign Sin Size Slice Softmax Softplus
Split Sqrt Squeeze Sub Sum Tanh Tile TopK Transpose Trilu Unsqueeze Where Xor
""".split())


# -- fixtures ----------------------------------------------------------------------------------------


class Tiny:
    """One tiny model: its HF directory, exported artifact, manifest, and the transformers oracle."""

    def __init__(self, model_dir: Path, art: Path) -> None:
        self.model_dir, self.art = model_dir, art
        self.manifest = io.load_manifest(art)
        self._hf = None

    @property
    def hf(self):
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        return self._hf

    @property
    def vocab(self) -> int:
        return int(self.manifest.model["vocab_size"])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    """tiny(case_id) -> Tiny, exported once per module."""
    cache: dict[str, Tiny] = {}

    def get(case: str) -> Tiny:
        if case not in cache:
            kind, tie = CASES[case]
            model_dir = tiny_model_dir(kind, tie=tie)
            art = export_artifact(model_dir, tmp_path_factory.mktemp(f"art_{case}") / "art", SETTINGS,
                                  progress=False)
            cache[case] = Tiny(model_dir, art)
        return cache[case]

    return get


@pytest.fixture(scope="module")
def engines(tiny):
    cache: dict[str, Engine] = {}

    def get(case: str) -> Engine:
        if case not in cache:
            cache[case] = Engine(tiny(case).art, threads=1)
        return cache[case]

    return get


def _session(art: Path, file: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(art / file), so, providers=["CPUExecutionProvider"])


def _zero_cache(spec: io.GraphSpec) -> dict[str, np.ndarray]:
    return {t.name: np.zeros(t.shape, t.dtype) for t in spec.inputs if t.name.startswith("past.")}


def _run_plain(sess: ort.InferenceSession, spec: io.GraphSpec, cache: dict[str, np.ndarray], ids: np.ndarray,
               start: int, rows: np.ndarray) -> np.ndarray:
    """One call of a fixed-shape graph through plain onnxruntime; updates `cache` from present.*."""
    b, t = ids.shape
    feeds = {io.INPUT_IDS: ids, io.POSITION_IDS: np.broadcast_to(np.arange(start, start + t), (b, t)).copy(),
             io.WRITE_INDEX: np.full((b,), start, np.int64), io.LOGIT_ROWS: rows, **cache}
    names = [o.name for o in spec.outputs]
    out = dict(zip(names, sess.run(names, feeds)))
    for name in cache:
        cache[name] = out[name.replace("past.", "present.", 1)]
    return out[io.LOGITS]


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def _random_ids(vocab: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=shape, dtype=np.int64)


# -- numerical parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_verify_graph_logits_match_transformers(tiny, case):
    """4 different 20-token sequences, fed 5 tokens per call through the fixed-shape verify graph."""
    t = tiny(case)
    spec = t.manifest.graphs["verify"]
    sess = _session(t.art, spec.file)
    B, T = spec.dims["B"], spec.dims["T"]
    ids = _random_ids(t.vocab, (B, SEQ), seed=1)
    cache = _zero_cache(spec)
    rows = np.broadcast_to(np.arange(T), (B, T)).copy()
    got = np.concatenate([_run_plain(sess, spec, cache, ids[:, s:s + T], s, rows) for s in range(0, SEQ, T)],
                         axis=1)
    want = _hf_logits(t.hf, ids)
    assert got.shape == want.shape == (B, SEQ, t.vocab)
    assert np.abs(got - want).max() <= ATOL


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_then_decode_matches_transformers(tiny, case):
    """Prefill graph (full chunk, and a padded partial chunk) then decode-graph steps, plain onnxruntime."""
    t = tiny(case)
    prefill, decode = t.manifest.graphs["prefill"], t.manifest.graphs["decode"]
    sp, sd = _session(t.art, prefill.file), _session(t.art, decode.file)
    B, C = prefill.dims["B"], prefill.dims["T"]
    ids = _random_ids(t.vocab, (B, SEQ), seed=2)
    want = _hf_logits(t.hf, ids)
    for prompt_len in (C, 11):  # a whole chunk; a partial chunk padded with zeros
        cache = _zero_cache(prefill)
        chunk = np.zeros((B, C), np.int64)
        chunk[:, :prompt_len] = ids[:, :prompt_len]
        got = [_run_plain(sp, prefill, cache, chunk, 0, np.full((B, 1), prompt_len - 1, np.int64))[:, 0]]
        for pos in range(prompt_len, SEQ):
            got.append(_run_plain(sd, decode, cache, ids[:, pos:pos + 1], pos, np.zeros((B, 1), np.int64))[:, 0])
        got = np.stack(got, axis=1)
        np.testing.assert_allclose(got, want[:, prompt_len - 1:], rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", ["llama_tied", "qwen3"])
def test_ort_runner_serves_every_shape_from_one_session(tiny, case):
    """OrtRunner (symbolic B/T/R, one shared cache buffer): chunks of 16, then 1-token and 3-token steps."""
    t = tiny(case)
    runner = OrtRunner(t.art, t.manifest.graphs["prefill"], threads=1)
    runner.allocate(2)
    ids = _random_ids(t.vocab, (1, SEQ), seed=3)
    want = _hf_logits(t.hf, ids)[0]

    def run(slot: int, start: int, tokens: np.ndarray, rows: list[int]) -> np.ndarray:
        n = len(tokens)
        out = runner.run(slot, StepInputs(input_ids=tokens[None], position_ids=np.arange(start, start + n)[None],
                                          write_index=np.array([start]), logit_rows=np.array([rows])).feeds())
        return out[io.LOGITS][0].copy()

    for slot in (1, 0):  # the second slot first: the call must touch only its own cache rows
        got = run(slot, 0, ids[0, :16], [15])
        np.testing.assert_allclose(got[0], want[15], rtol=0, atol=ATOL)
        np.testing.assert_allclose(run(slot, 16, ids[0, 16:17], [0])[0], want[16], rtol=0, atol=ATOL)
        got = run(slot, 17, ids[0, 17:20], [0, 1, 2])
        np.testing.assert_allclose(got, want[17:20], rtol=0, atol=ATOL)


# -- generation ----------------------------------------------------------------------------------------


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches_transformers(tiny, engines, case):
    t = tiny(case)
    prompt = _random_ids(t.vocab, (23,), seed=4).tolist()  # two prefill chunks, the second partial
    outs, stats = engines(case).generate([Request(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True))])
    assert outs[0].output_ids == _hf_greedy(t.hf, prompt, 64)
    assert outs[0].finish_reason == "length"
    assert stats.generated_tokens == 64 and stats.method == "ar"


@pytest.mark.parametrize("case", ["llama_tied", "qwen2", "qwen3"])
def test_batch_equals_single(tiny, engines, case):
    """5 requests on 4 slots (the 5th refills a finished slot) give each request's solo output."""
    t = tiny(case)
    engine = engines(case)
    lengths, new_tokens = (3, 40, 16, 9, 32), (12, 30, 5, 20, 16)  # 16, 32: whole chunks
    requests = [Request(_random_ids(t.vocab, (n,), seed=10 + i).tolist(),
                        SamplingParams(max_new_tokens=m, ignore_eos=True), id=i)
                for i, (n, m) in enumerate(zip(lengths, new_tokens))]
    batched, stats = engine.generate(requests)
    assert [o.id for o in batched] == list(range(5))
    assert [len(o.output_ids) for o in batched] == list(new_tokens)
    for r, o in zip(requests, batched):
        assert o.output_ids == engine.generate([r])[0][0].output_ids, f"request {r.id}"
    assert stats.requests == 5 and stats.generated_tokens == sum(new_tokens)
    # the first finished request is refilled, so some steps run 4 slots: far fewer steps than solo
    assert stats.steps < sum(new_tokens) - 5


def test_batch_equals_single_sampled(tiny, engines):
    """Seeded sampling depends only on (seed + request id), not on which slot or batch a request runs in."""
    t = tiny("llama_untied")
    engine = engines("llama_untied")
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7, max_new_tokens=16, ignore_eos=True)
    requests = [Request(_random_ids(t.vocab, (5 + 7 * i,), seed=20 + i).tolist(), params, id=i) for i in range(5)]
    batched, _ = engine.generate(requests)
    for r, o in zip(requests, batched):
        assert o.output_ids == engine.generate([r])[0][0].output_ids
    assert len({tuple(o.output_ids) for o in batched}) == 5


def test_duplicate_request_ids_rejected(engines):
    """Outputs are keyed by request id: two requests with the default id 0 must not silently share one."""
    engine = engines("llama_tied")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(SpecrtError, match="unique"):
        engine.generate([Request([5, 6, 7], params), Request([9, 10, 11, 12], params)])
    outs, _ = engine.generate([Request([5, 6, 7], params, id=0), Request([9, 10, 11, 12], params, id=1)])
    assert [o.prompt_tokens for o in outs] == [3, 4]


def test_edge_lengths_match_transformers(tiny, engines):
    """max_new_tokens 1 (the prefill token only), and a request filling every usable cache position."""
    t = tiny("qwen2")
    engine = engines("qwen2")
    prompt = _random_ids(t.vocab, (32,), seed=40).tolist()  # exactly two prefill chunks
    one, _ = engine.generate([Request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))])
    assert one[0].output_ids == _hf_greedy(t.hf, prompt, 1)
    capacity = SETTINGS.max_seq - 1
    prompt = _random_ids(t.vocab, (100,), seed=41).tolist()
    full, _ = engine.generate([Request(prompt, SamplingParams(max_new_tokens=capacity - 100, ignore_eos=True))])
    assert full[0].output_ids == _hf_greedy(t.hf, prompt, capacity - 100)
    with pytest.raises(SpecrtError, match="exceeds"):
        engine.generate([Request(prompt, SamplingParams(max_new_tokens=capacity - 99, ignore_eos=True))])


def test_generation_stops_at_eos(tiny, engines):
    t = tiny("llama_tied")
    eos = sorted(engines("llama_tied").eos_ids)
    assert eos == [2]
    prompt = _random_ids(t.vocab, (8,), seed=30).tolist()
    free, _ = engines("llama_tied").generate([Request(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True))])
    ids = free[0].output_ids
    stop, _ = engines("llama_tied").generate([Request(prompt, SamplingParams(max_new_tokens=64))])
    if 2 in ids:
        assert stop[0].output_ids == ids[:ids.index(2) + 1] and stop[0].finish_reason == "eos"
    else:
        assert stop[0].output_ids == ids and stop[0].finish_reason == "length"


# -- artifact structure ------------------------------------------------------------------------------


def test_manifest_fields(tiny):
    t = tiny("llama_untied")
    m = t.manifest
    d = json.loads((t.art / io.MANIFEST).read_text())
    assert d["format_version"] == io.FORMAT_VERSION == m.format_version
    assert m.specrt_version and m.name
    assert m.export == SETTINGS
    assert m.model["family"] == "llama" and m.model["vocab_size"] == 256 and m.model["num_layers"] == 2
    assert m.model["tie_word_embeddings"] is False and list(m.model["eos_token_ids"]) == [2]
    assert set(m.graphs) == {"prefill", "decode", "verify"}
    dims = {k: g.dims for k, g in m.graphs.items()}
    assert dims == {"prefill": {"B": 4, "T": 16, "R": 1, "S": 128}, "decode": {"B": 4, "T": 1, "R": 1, "S": 128},
                    "verify": {"B": 4, "T": 5, "R": 5, "S": 128}}
    assert {g.family for g in m.graphs.values()} == {"target"}
    assert m.weights["file"] == io.WEIGHTS_FILE and m.weights["bytes"] == (t.art / io.WEIGHTS_FILE).stat().st_size
    assert m.tokenizer is None  # the tiny directories ship no tokenizer
    assert len(m.sources) >= 1 and all(len(s["sha256"]) == 64 and s["size"] > 0 for s in m.sources)
    assert sorted(p.name for p in t.art.iterdir()) == sorted(
        [io.MANIFEST, io.WEIGHTS_FILE, *(g.file for g in m.graphs.values())])


@pytest.mark.parametrize("case", ["llama_tied", "qwen2", "qwen3"])
def test_graphs_pass_full_onnx_check(tiny, case):
    t = tiny(case)
    for g in t.manifest.graphs.values():
        onnx.checker.check_model(str(t.art / g.file), full_check=True)


def _declared_io(model: onnx.ModelProto) -> tuple[list, list]:
    def spec(vi):
        tt = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        return io.TensorSpec(vi.name, dtype, tuple(d.dim_value for d in tt.shape.dim))

    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]


@pytest.mark.parametrize("case", list(CASES))
def test_graph_io_matches_contract(tiny, case):
    t = tiny(case)
    cfg = t.manifest.model
    for g in t.manifest.graphs.values():
        want = io.target_signature(num_layers=cfg["num_layers"], num_kv_heads=cfg["num_kv_heads"],
                                   head_dim=cfg["head_dim"], vocab_size=cfg["vocab_size"], batch=g.dims["B"],
                                   tokens=g.dims["T"], rows=g.dims["R"], max_seq=g.dims["S"], dtype="float32")
        ins, outs = _declared_io(onnx.load(str(t.art / g.file), load_external_data=False))
        assert want == (g.inputs, g.outputs), g.name
        declared = [(t.name, t.dtype, t.shape) for t in (*ins, *outs)]  # ONNX files carry no axis names
        assert declared == [(t.name, t.dtype, t.shape) for t in (*want[0], *want[1])], g.name


def test_golden_io_signature():
    """The contract itself, written out once: a change here is a format change (bump FORMAT_VERSION)."""
    ins, outs = io.target_signature(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=256, batch=4, tokens=5,
                                    rows=5, max_seq=128, dtype="float32")
    cache = ("float32", (4, 2, 128, 16))
    assert [(t.name, t.dtype, t.shape) for t in ins] == [
        ("input_ids", "int64", (4, 5)), ("position_ids", "int64", (4, 5)), ("write_index", "int64", (4,)),
        ("logit_rows", "int64", (4, 5)),
        ("past.0.key", *cache), ("past.0.value", *cache), ("past.1.key", *cache), ("past.1.value", *cache)]
    assert [(t.name, t.dtype, t.shape) for t in outs] == [
        ("logits", "float32", (4, 5, 256)),
        ("present.0.key", *cache), ("present.0.value", *cache), ("present.1.key", *cache),
        ("present.1.value", *cache)]


@pytest.mark.parametrize("case", ["llama_tied", "llama_untied", "qwen3"])
def test_weights_stored_once_as_external_data(tiny, case):
    t = tiny(case)
    weights = t.art / io.WEIGHTS_FILE
    size = weights.stat().st_size
    per_graph = {}
    for g in t.manifest.graphs.values():
        path = t.art / g.file
        model = onnx.load(str(path), load_external_data=False)
        external = {}
        inline_bytes = 0
        for init in model.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in init.external_data}
                assert info["location"] == io.WEIGHTS_FILE
                offset, length = int(info["offset"]), int(info["length"])
                assert offset % 4096 == 0 and offset + length <= size
                external[init.name] = (offset, length)
            else:
                assert not init.name.startswith(("model.", "lm_head")), f"{init.name} stored inline"
                inline_bytes += len(init.raw_data) + 8 * len(init.int64_data) + 4 * len(init.float_data)
        assert "model.embed_tokens.weight" in external
        assert ("lm_head.weight" in external) == (not t.manifest.model["tie_word_embeddings"])
        assert inline_bytes < 16 * 1024  # shape constants and rope frequencies only
        assert path.stat().st_size < 128 * 1024 < size
        per_graph[g.name] = external
    first = next(iter(per_graph.values()))
    assert all(ext == first for ext in per_graph.values()), "graphs must reference the same weight ranges"
    assert sum(length for _, length in first.values()) <= size


@pytest.mark.parametrize("case", ["llama_untied", "qwen2", "qwen3"])
def test_node_names_are_paths(tiny, case):
    t = tiny(case)
    for g in t.manifest.graphs.values():
        nodes = onnx.load(str(t.art / g.file), load_external_data=False).graph.node
        names = [n.name for n in nodes]
        assert all(n.startswith("/target/") for n in names), [n for n in names if not n.startswith("/target/")][:5]
        assert len(set(names)) == len(names)
        assert any(n.startswith("/target/layers.1/attn/") for n in names)


@pytest.mark.parametrize("case", list(CASES))
def test_standard_graphs_use_only_tensorrt_parser_ops(tiny, case):
    t = tiny(case)
    assert t.manifest.export.attention == "standard"
    for g in t.manifest.graphs.values():
        model = onnx.load(str(t.art / g.file), load_external_data=False)
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 23)]
        assert not model.functions
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
        used = {n.op_type for n in model.graph.node}
        assert used <= TRT_OPS, f"{g.file}: ops outside the TensorRT parser allowlist: {sorted(used - TRT_OPS)}"


# Inputs the same support matrix requires to be initializers (constants): (op, input index).
TRT_CONSTANT_INPUTS = {("Slice", 3), ("Squeeze", 1), ("Unsqueeze", 1), ("TopK", 1), ("CumSum", 1)}


@pytest.mark.parametrize("case", ["llama_tied", "qwen2", "qwen3"])
def test_tensorrt_parser_constant_inputs(tiny, case):
    t = tiny(case)
    for g in t.manifest.graphs.values():
        model = onnx.load(str(t.art / g.file), load_external_data=False)
        constants = {i.name for i in model.graph.initializer}
        constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
        for n in model.graph.node:
            for op, index in TRT_CONSTANT_INPUTS:
                if n.op_type == op and len(n.input) > index and n.input[index]:
                    assert n.input[index] in constants, f"{g.file}: {n.name} input {index} is not an initializer"


# -- float16 -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_art(tiny, tmp_path_factory):
    t = tiny("qwen3")
    settings = io.ExportSettings(batch=4, max_seq=128, prefill_chunk=16, verify_len=5, dtype="float16")
    return export_artifact(t.model_dir, tmp_path_factory.mktemp("fp16") / "art", settings, progress=False)


def _external_bytes(model: onnx.ModelProto) -> int:
    return sum(int({e.key: e.value for e in i.external_data}["length"]) for i in model.graph.initializer
               if i.data_location == onnx.TensorProto.EXTERNAL)


def test_fp16_export_types(tiny, fp16_art):
    m = io.load_manifest(fp16_art)
    fp32 = tiny("qwen3")
    assert m.export.dtype == "float16"
    for g in m.graphs.values():
        model = onnx.load(str(fp16_art / g.file), load_external_data=False)
        weights = [i for i in model.graph.initializer if i.name.startswith("model.")]
        assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)
        ins, outs = _declared_io(model)
        assert {s.dtype for s in ins if s.name.startswith("past.")} == {"float16"}
        assert {s.dtype for s in outs} == {"float16"}
        assert all(s.dtype == "float16" for s in g.inputs if s.name.startswith("past."))
        full = onnx.load(str(fp32.art / fp32.manifest.graphs[g.name].file), load_external_data=False)
        assert 2 * _external_bytes(model) == _external_bytes(full)


def test_fp16_logits_close_to_fp32(tiny, fp16_art):
    t = tiny("qwen3")
    m = io.load_manifest(fp16_art)
    spec = m.graphs["verify"]
    sess = _session(fp16_art, spec.file)
    B, T = spec.dims["B"], spec.dims["T"]
    ids = _random_ids(t.vocab, (B, SEQ), seed=5)
    cache = _zero_cache(spec)
    assert all(v.dtype == np.float16 for v in cache.values())
    rows = np.broadcast_to(np.arange(T), (B, T)).copy()
    got = np.concatenate([_run_plain(sess, spec, cache, ids[:, s:s + T], s, rows) for s in range(0, SEQ, T)],
                         axis=1)
    assert got.dtype == np.float16 and np.isfinite(got).all()
    want = _hf_logits(t.hf, ids)
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    assert agree >= 0.9, f"top-1 agreement {agree:.2f}"
    assert np.abs(got.astype(np.float32) - want).max() < 0.05 * np.abs(want).max() + 0.05


def test_fp16_engine_generates(fp16_art):
    engine = Engine(fp16_art, threads=1)
    outs, _ = engine.generate([Request([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True))])
    assert len(outs[0].output_ids) == 8


# -- atomic export and manifest validation ---------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize("step", ["_write_target", "_check_graphs"])
def test_interrupted_export_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch, step):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, step, interrupt)
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        export_artifact(tiny_model_dir("llama"), out, SETTINGS, progress=False)
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_interrupted_forced_export_keeps_old_artifact(tiny, tmp_path, monkeypatch):
    t = tiny("llama_tied")
    out = tmp_path / "art"
    shutil.copytree(t.art, out)
    before = (out / io.MANIFEST).read_text()

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, "_check_graphs", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export_artifact(t.model_dir, out, SETTINGS, progress=False, force=True)
    assert (out / io.MANIFEST).read_text() == before
    io.load_manifest(out)
    assert _leftovers(tmp_path) == []


def test_export_onto_existing_dir(tiny, tmp_path):
    t = tiny("llama_tied")
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(SpecrtError, match="already exists.*--force"):
        export_artifact(t.model_dir, out, SETTINGS, progress=False)
    assert (out / "keep.txt").exists()
    export_artifact(t.model_dir, out, SETTINGS, progress=False, force=True)
    assert not (out / "keep.txt").exists()
    assert io.load_manifest(out).export == SETTINGS
    assert _leftovers(tmp_path) == []


@pytest.fixture
def art_copy(tiny, tmp_path) -> Path:
    return Path(shutil.copytree(tiny("llama_tied").art, tmp_path / "art"))


def _edit_manifest(art: Path, edit) -> None:
    d = json.loads((art / io.MANIFEST).read_text())
    edit(d)
    (art / io.MANIFEST).write_text(json.dumps(d))


def test_other_format_version_rejected(art_copy):
    _edit_manifest(art_copy, lambda d: d.update(format_version=io.FORMAT_VERSION + 98))
    with pytest.raises(SpecrtError, match=rf"format version {io.FORMAT_VERSION + 98}.*re-export") as e:
        io.load_manifest(art_copy)
    assert "\n" not in str(e.value)


def test_missing_graph_file_rejected(art_copy):
    (art_copy / "target_verify.onnx").unlink()
    with pytest.raises(SpecrtError, match="incomplete.*target_verify.onnx is missing"):
        io.load_manifest(art_copy)


def test_broken_manifests_rejected(art_copy, tmp_path):
    with pytest.raises(SpecrtError, match="artifact not found"):
        io.load_manifest(tmp_path / "nope")
    with pytest.raises(SpecrtError, match="not a specrt artifact"):
        io.load_manifest(tmp_path)
    _edit_manifest(art_copy, lambda d: d.pop("graphs"))
    with pytest.raises(SpecrtError, match="malformed"):
        io.load_manifest(art_copy)
    (art_copy / io.MANIFEST).write_text("{not json")
    with pytest.raises(SpecrtError, match="not valid JSON"):
        io.load_manifest(art_copy)
