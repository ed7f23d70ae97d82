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
from specrt.model_config import DSparkConfig
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint
from specrt.exporter.onnx.dspark import dspark_signature
from specrt.runtime.backends import bucket_of, infer
from specrt.runtime.backends.ort import OrtRunner

SETTINGS = io.ExportSettings(batch=4, max_seq=128, prefill_chunk=16, verify_len=5)
# case id -> (conftest kind, tie); llama is exported both tied and untied
CASES = {"llama_tied": ("llama", True), "llama_untied": ("llama", False), "qwen2": ("qwen2", None),
         "qwen3": ("qwen3", None), "llama3_scaled": ("llama3_scaled", None), "mistral": ("mistral", None),
         "llama_bias": ("llama_bias", None)}
HEADED = "headed"  # a 4-layer llama with a tokenizer, exported with a DSpark and an MTP head
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
        return self.manifest.model.vocab_size


def _write_tokenizer(model_dir: Path, vocab: int) -> None:
    """A word-level tokenizer.json over the tiny vocabulary, so the export copies a tokenizer/ too."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(
        str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    """tiny(case_id) -> Tiny, exported once per module; HEADED has a tokenizer and both draft heads."""
    cache: dict[str, Tiny] = {}

    def get(case: str) -> Tiny:
        if case not in cache:
            work = tmp_path_factory.mktemp(f"art_{case}")
            if case == HEADED:
                model_dir = Path(shutil.copytree(tiny_model_dir("llama", num_layers=4), work / "model"))
                _write_tokenizer(model_dir, 256)
                heads = dict(draft=random_dspark_checkpoint(work / "dspark", model_dir, block_size=4),
                             mtp=random_mtp_checkpoint(work / "mtp", model_dir, seed=1))
            else:
                kind, tie = CASES[case]
                model_dir, heads = tiny_model_dir(kind, tie=tie), {}
            art = export_artifact(model_dir, work / "art", SETTINGS, progress=False, **heads)
            cache[case] = Tiny(model_dir, art)
        return cache[case]

    return get


def _request(prompt, *, id: int = 0, **params):
    """An engine request. The engine is imported only by the tests that use it, so the graph tests here (and
    test_dspark / test_mtp, which import this module's TensorRT allowlist) never depend on it."""
    from specrt.runtime.engine import Request
    from specrt.runtime.sampling import SamplingParams

    return Request(list(prompt), SamplingParams(**params), id=id)


@pytest.fixture(scope="module")
def engines(tiny):
    from specrt.runtime.engine import Engine

    cache: dict = {}

    def get(case: str):
        if case not in cache:
            cache[case] = Engine(tiny(case).art, threads=1)
        return cache[case]

    return get


def _session(art: Path, file: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(art / file), so, providers=["CPUExecutionProvider"])


def _zero_cache(spec: io.GraphSpec, slots: int) -> dict[str, np.ndarray]:
    return {t.name: np.zeros(t.resolve({"B": slots}), t.dtype) for t in spec.cache_inputs()}


def _run_plain(sess: ort.InferenceSession, spec: io.GraphSpec, cache: dict[str, np.ndarray], ids: np.ndarray,
               start: int, rows: np.ndarray) -> np.ndarray:
    """One dense call of target.onnx through plain onnxruntime at the shape of `ids`, logits of the rows [B,R]
    of each slot as [B,R,V]; updates `cache` from present.*."""
    b, t = ids.shape
    feeds = {io.INPUT_IDS: ids, io.POSITION_IDS: np.broadcast_to(np.arange(start, start + t), (b, t)).copy(),
             io.WRITE_INDEX: np.full((b,), start, np.int64), io.TOKEN_ROWS: np.arange(b * t),
             io.LOGIT_ROWS: (np.arange(b)[:, None] * t + rows).ravel(), io.TREE_MASK: np.zeros((b, t, t), np.int64),
             **cache}
    names = [o.name for o in spec.outputs]
    out = dict(zip(names, sess.run(names, feeds)))
    for name in cache:
        cache[name] = out[name.replace("past.", "present.", 1)]
    return out[io.LOGITS].reshape(*rows.shape, -1)


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def _random_ids(vocab: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=shape, dtype=np.int64)


# -- numerical parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_verify_bucket_logits_match_transformers(tiny, case):
    """4 different 20-token sequences, fed 5 tokens per call at the largest verify bucket of target.onnx."""
    t = tiny(case)
    spec = t.manifest.graphs[io.TARGET]
    sess = _session(t.art, spec.file)
    bucket = spec.bucket("verify", B=SETTINGS.batch, T=SETTINGS.verify_len)
    B, T = bucket["B"], bucket["T"]
    ids = _random_ids(t.vocab, (B, SEQ), seed=1)
    cache = _zero_cache(spec, B)
    rows = np.broadcast_to(np.arange(T), (B, T)).copy()
    got = np.concatenate([_run_plain(sess, spec, cache, ids[:, s:s + T], s, rows) for s in range(0, SEQ, T)],
                         axis=1)
    want = _hf_logits(t.hf, ids)
    assert got.shape == want.shape == (B, SEQ, t.vocab)
    assert np.abs(got - want).max() <= ATOL


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_then_decode_matches_transformers(tiny, case):
    """Each slot prefilled alone at the prefill bucket (a whole chunk; a partial chunk padded with zeros), then
    decode-bucket steps for all 4 slots at once: the runtime's pattern, through plain onnxruntime."""
    t = tiny(case)
    spec = t.manifest.graphs[io.TARGET]
    sess = _session(t.art, spec.file)
    prefill, decode = spec.bucket("prefill"), spec.bucket("decode", B=SETTINGS.batch)
    B, C = decode["B"], prefill["T"]
    assert prefill["B"] == 1 and decode["T"] == 1
    ids = _random_ids(t.vocab, (B, SEQ), seed=2)
    want = _hf_logits(t.hf, ids)
    for prompt_len in (C, 11):
        cache = _zero_cache(spec, B)
        first = []
        for b in range(B):
            own = {name: buf[b:b + 1] for name, buf in cache.items()}
            chunk = np.zeros((1, C), np.int64)
            chunk[0, :prompt_len] = ids[b, :prompt_len]
            first.append(_run_plain(sess, spec, own, chunk, 0, np.array([[prompt_len - 1]]))[0, 0])
            for name, buf in cache.items():
                buf[b:b + 1] = own[name]
        got = [np.stack(first)]
        for pos in range(prompt_len, SEQ):
            got.append(_run_plain(sess, spec, cache, ids[:, pos:pos + 1], pos, np.zeros((B, 1), np.int64))[:, 0])
        np.testing.assert_allclose(np.stack(got, axis=1), want[:, prompt_len - 1:], rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", ["llama_tied", "qwen3"])
def test_ort_runner_serves_every_bucket_from_one_session(tiny, case):
    """OrtRunner (one session, one cache buffer bound in place): the prefill, decode and verify buckets."""
    t = tiny(case)
    spec = t.manifest.graphs[io.TARGET]
    runner = OrtRunner(t.art, spec, threads=1)
    runner.allocate(2)
    ids = _random_ids(t.vocab, (1, SEQ), seed=3)
    want = _hf_logits(t.hf, ids)[0]

    def run(use: str, slot: int, start: int, tokens: np.ndarray, rows: list[int]) -> np.ndarray:
        n = len(tokens)
        feeds = {io.INPUT_IDS: tokens[None], io.POSITION_IDS: np.arange(start, start + n)[None],
                 io.WRITE_INDEX: np.array([start]), io.TOKEN_ROWS: np.arange(n), io.LOGIT_ROWS: np.array(rows)}
        assert bucket_of(spec, feeds) == spec.bucket(use, T=n)  # each call is exactly an exported bucket
        return infer(runner, slot, feeds)[io.LOGITS].copy()

    for slot in (1, 0):  # the second slot first: the call must touch only its own cache rows
        np.testing.assert_allclose(run("prefill", slot, 0, ids[0, :16], [15])[0], want[15], rtol=0, atol=ATOL)
        np.testing.assert_allclose(run("decode", slot, 16, ids[0, 16:17], [0])[0], want[16], rtol=0, atol=ATOL)
        got = run("verify", slot, 17, ids[0, 17:20], [0, 1, 2])
        np.testing.assert_allclose(got, want[17:20], rtol=0, atol=ATOL)
    bucket = spec.bucket("decode")  # host buffers are allocated once per bucket and reused
    assert all(a is b for a, b in zip(runner.inputs(0, bucket).values(), runner.inputs(0, bucket).values()))


@pytest.mark.parametrize("case", ["llama_tied", "qwen2"])
def test_packed_verify_equals_per_request_verify(tiny, case):
    """Slots verifying different lengths in one packed call (only their tokens computed, in a token budget
    smaller than the grid, one slot idle) get the logits each gets verifying alone, and transformers' logits;
    the cells not computed leave nothing a later call sees."""
    t = tiny(case)
    spec = t.manifest.graphs[io.TARGET]
    B, T = SETTINGS.batch, SETTINGS.verify_len
    ids = _random_ids(t.vocab, (B, SEQ), seed=4)
    want = _hf_logits(t.hf, ids)
    packed, alone = OrtRunner(t.art, spec, threads=1), OrtRunner(t.art, spec, threads=1)
    packed.allocate(B)
    alone.allocate(B)
    prompt = 8
    for runner in (packed, alone):
        for b in range(B):
            infer(runner, b, {io.INPUT_IDS: ids[b:b + 1, :prompt], io.POSITION_IDS: np.arange(prompt)[None],
                              io.WRITE_INDEX: np.array([0]), io.TOKEN_ROWS: np.arange(prompt),
                              io.LOGIT_ROWS: np.array([prompt - 1])})
    lengths = {0: 2, 1: 5, 3: 2}  # tokens verified per slot (anchor + drafts); slot 2 idle
    starts = np.full(B, prompt)
    for call in range(2):
        grid = np.zeros((B, T), np.int64)
        cells = []
        for b, n in lengths.items():
            grid[b, :n] = ids[b, starts[b]:starts[b] + n]
            cells += [b * T + i for i in range(n)]
        p = next(bb["P"] for bb in spec.buckets["verify"] if (bb["B"], bb["T"]) == (B, T) and bb["P"] >= len(cells))
        assert len(cells) <= p < B * T  # a budget between the tokens and the grid: padding cells are computed
        rows = np.array(cells + sorted(set(range(B * T)) - set(cells))[:p - len(cells)])
        out = infer(packed, 0, {io.INPUT_IDS: grid, io.POSITION_IDS: starts[:, None] + np.arange(T),
                                io.WRITE_INDEX: starts, io.TOKEN_ROWS: rows, io.LOGIT_ROWS: np.arange(p)})
        got = out[io.LOGITS].copy()
        k = 0
        for b, n in lengths.items():
            s = int(starts[b])
            single = infer(alone, b, {io.INPUT_IDS: ids[b:b + 1, s:s + n], io.POSITION_IDS: np.arange(s, s + n)[None],
                                      io.WRITE_INDEX: np.array([s]), io.TOKEN_ROWS: np.arange(n),
                                      io.LOGIT_ROWS: np.arange(n)})[io.LOGITS]
            np.testing.assert_allclose(got[k:k + n], single, rtol=0, atol=ATOL)
            np.testing.assert_allclose(got[k:k + n], want[b, s:s + n], rtol=0, atol=ATOL)
            k += n
            starts[b] += n - 1  # as after a round that accepted n - 2 drafts: the last row is rewritten next
        lengths = {0: 3, 1: 1, 3: 2}


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
    outs, stats = engines(case).generate([_request(prompt, max_new_tokens=64, ignore_eos=True)])
    assert outs[0].output_ids == _hf_greedy(t.hf, prompt, 64)
    assert outs[0].finish_reason == "length"
    assert stats.generated_tokens == 64 and stats.method == "ar"


@pytest.mark.parametrize("case", ["llama_tied", "qwen2", "qwen3"])
def test_batch_equals_single(tiny, engines, case):
    """5 requests on 4 slots (the 5th refills a finished slot) give each request's solo output."""
    t = tiny(case)
    engine = engines(case)
    lengths, new_tokens = (3, 40, 16, 9, 32), (12, 30, 5, 20, 16)  # 16, 32: whole chunks
    requests = [_request(_random_ids(t.vocab, (n,), seed=10 + i), id=i, max_new_tokens=m, ignore_eos=True)
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
    params = dict(temperature=1.0, top_k=50, top_p=0.95, seed=7, max_new_tokens=16, ignore_eos=True)
    requests = [_request(_random_ids(t.vocab, (5 + 7 * i,), seed=20 + i), id=i, **params) for i in range(5)]
    batched, _ = engine.generate(requests)
    for r, o in zip(requests, batched):
        assert o.output_ids == engine.generate([r])[0][0].output_ids
    assert len({tuple(o.output_ids) for o in batched}) == 5


def test_duplicate_request_ids_rejected(engines):
    """Outputs are keyed by request id: two requests with the default id 0 must not silently share one."""
    engine = engines("llama_tied")
    params = dict(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(SpecrtError, match="unique"):
        engine.generate([_request([5, 6, 7], **params), _request([9, 10, 11, 12], **params)])
    outs, _ = engine.generate([_request([5, 6, 7], id=0, **params), _request([9, 10, 11, 12], id=1, **params)])
    assert [o.prompt_tokens for o in outs] == [3, 4]


def test_edge_lengths_match_transformers(tiny, engines):
    """max_new_tokens 1 (the prefill token only), and a request filling every usable cache position."""
    t = tiny("qwen2")
    engine = engines("qwen2")
    prompt = _random_ids(t.vocab, (32,), seed=40).tolist()  # exactly two prefill chunks
    one, _ = engine.generate([_request(prompt, max_new_tokens=1, ignore_eos=True)])
    assert one[0].output_ids == _hf_greedy(t.hf, prompt, 1)
    capacity = SETTINGS.max_seq - 1
    prompt = _random_ids(t.vocab, (100,), seed=41).tolist()
    full, _ = engine.generate([_request(prompt, max_new_tokens=capacity - 100, ignore_eos=True)])
    assert full[0].output_ids == _hf_greedy(t.hf, prompt, capacity - 100)
    with pytest.raises(SpecrtError, match="exceeds"):
        engine.generate([_request(prompt, max_new_tokens=capacity - 99, ignore_eos=True)])


def test_generation_stops_at_eos(tiny, engines):
    t = tiny("llama_tied")
    eos = sorted(engines("llama_tied").eos_ids)
    assert eos == [2]
    prompt = _random_ids(t.vocab, (8,), seed=30).tolist()
    free, _ = engines("llama_tied").generate([_request(prompt, max_new_tokens=64, ignore_eos=True)])
    ids = free[0].output_ids
    stop, _ = engines("llama_tied").generate([_request(prompt, max_new_tokens=64)])
    if 2 in ids:
        assert stop[0].output_ids == ids[:ids.index(2) + 1] and stop[0].finish_reason == "eos"
    else:
        assert stop[0].output_ids == ids and stop[0].finish_reason == "length"


# -- artifact structure ------------------------------------------------------------------------------

STRUCTURE_CASES = ["llama_tied", "llama_untied", "qwen2", "qwen3", HEADED]


def test_manifest_fields(tiny):
    t = tiny("llama_untied")
    m = t.manifest
    d = json.loads((t.art / io.MANIFEST).read_text())
    assert d["format_version"] == io.FORMAT_VERSION == m.format_version
    assert m.specrt_version and m.name
    assert m.export == SETTINGS
    assert m.model.family == "llama" and m.model.vocab_size == 256 and m.model.num_layers == 2
    assert m.model.tie_word_embeddings is False and list(m.model.eos_token_ids) == [2]
    assert set(m.graphs) == {io.TARGET} and m.heads == {} and m.features == ()
    spec = m.graphs[io.TARGET]
    assert (spec.name, spec.file, spec.max_seq) == ("target", "target.onnx", 128)
    assert spec.buckets == io.target_buckets(SETTINGS)
    assert d["graphs"]["target"]["buckets"]["decode"] == [{"B": 1, "T": 1, "P": 1, "R": 1},
                                                          {"B": 2, "T": 1, "P": 2, "R": 2},
                                                          {"B": 4, "T": 1, "P": 4, "R": 4}]
    assert m.weights.file == io.WEIGHTS_FILE and m.weights.bytes == (t.art / io.WEIGHTS_FILE).stat().st_size
    assert m.tokenizer is None  # the tiny directories ship no tokenizer
    assert len(m.sources) >= 1 and all(len(s.sha256) == 64 and s.size > 0 for s in m.sources)


def test_manifest_records_heads_and_their_buckets(tiny):
    m = tiny(HEADED).manifest
    assert set(m.graphs) == {"target", "dspark", "mtp"} == {g.name for g in m.graphs.values()}
    assert m.graphs["target"].buckets == io.target_buckets(SETTINGS)
    assert m.graphs["dspark"].buckets == m.graphs["mtp"].buckets == io.head_buckets(SETTINGS)
    dspark, mtp = m.heads["dspark"], m.heads["mtp"]
    layers = tuple(DSparkConfig.from_dict(dspark.config).target_layer_ids)
    assert m.features == (*layers, "final")  # the DSpark layers, then the final-normed hidden for MTP
    assert (dspark.kind, dspark.steps, dspark.confidence, dspark.feature_offset, dspark.feature_dim) == (
        "dspark", 4, True, 0, 64 * len(layers))
    assert (mtp.kind, mtp.steps, mtp.feedback, mtp.feature_offset, mtp.feature_dim) == (
        "mtp", SETTINGS.verify_len - 1, "post", 64 * len(layers), 64)


def test_bucket_rounds_up(tiny):
    """A call is rounded up to the smallest exported bucket that holds it; an impossible one is an error."""
    m = tiny(HEADED).manifest
    target, dspark = m.graphs["target"], m.graphs["dspark"]
    assert target.bucket("verify", T=3) == {"B": 1, "T": 3, "P": 3, "R": 3}
    assert target.bucket("verify", B=3, T=3) == {"B": 4, "T": 3, "P": 4, "R": 4}  # packed: the smallest budget
    assert target.bucket("verify", B=3, T=3, P=5) == {"B": 4, "T": 3, "P": 8, "R": 8}
    assert target.bucket("verify", B=3, T=3, P=9) == {"B": 4, "T": 3, "P": 12, "R": 12}
    assert target.bucket("decode", B=3) == {"B": 4, "T": 1, "P": 4, "R": 4}
    assert target.bucket("decode", B=2) == {"B": 2, "T": 1, "P": 2, "R": 2}
    assert target.bucket("prefill", T=5) == {"B": 1, "T": 16, "P": 16, "R": 1}
    assert dspark.bucket("propose", B=3, C=2) == {"B": 4, "C": 2}
    assert dspark.bucket("prefill") == {"B": 1, "C": 16}
    for spec, use, need in ((target, "verify", {"T": 6}), (target, "decode", {"B": 5}), (target, "prefill", {"B": 2}),
                            (target, "propose", {}), (dspark, "propose", {"C": 6})):
        with pytest.raises(SpecrtError, match=f"graph {spec.name}: no {use} bucket holds"):
            spec.bucket(use, **need)


@pytest.mark.parametrize("case", ["llama_untied", HEADED])
def test_no_unused_files_exported(tiny, case):
    """The artifact holds the manifest, the weights, tokenizer/ when the model has one, one .onnx per family, a
    greedy variant per draft family, and the marker listing them (what `--force` may replace)."""
    from specrt.outdir import MARKER

    t = tiny(case)
    m = t.manifest
    assert all(g.file == f"{family}.onnx" for family, g in m.graphs.items())
    assert all(g.greedy_file == (f"{family}.greedy.onnx" if family in m.heads else "")
               for family, g in m.graphs.items())
    want = [MARKER, io.MANIFEST, io.WEIGHTS_FILE, *(f for g in m.graphs.values() for f in (g.file, g.greedy_file) if f)]
    if m.tokenizer:
        want.append(io.TOKENIZER_DIR)
        assert sorted(p.name for p in (t.art / io.TOKENIZER_DIR).iterdir()) == m.tokenizer["files"]
    assert sorted(p.name for p in t.art.iterdir()) == sorted(want)
    assert (m.tokenizer is not None) == (case == HEADED)


@pytest.mark.parametrize("case", ["llama_tied", "qwen2", "qwen3", HEADED])
def test_graphs_pass_full_onnx_check(tiny, case):
    t = tiny(case)
    for g in t.manifest.graphs.values():
        for file in filter(None, (g.file, g.greedy_file)):
            onnx.checker.check_model(str(t.art / file), full_check=True)


def _declared_io(model: onnx.ModelProto) -> tuple[list, list]:
    """A graph file's inputs and outputs as TensorSpecs: symbolic dims by their axis name."""
    def spec(vi):
        tt = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        return io.TensorSpec(vi.name, dtype, tuple(d.dim_param or d.dim_value for d in tt.shape.dim))

    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]


def _signature(m: io.Manifest, family: str) -> tuple:
    """The I/O signature `family` must have, from the contract functions in specrt/artifact.py."""
    c, s = m.model, m.export
    if family == io.TARGET:
        return io.target_signature(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                   vocab_size=c.vocab_size, max_seq=s.max_seq, dtype=s.dtype,
                                   feature_dim=c.hidden_size * len(m.features))
    if family == "dspark":
        return dspark_signature(DSparkConfig.from_dict(m.heads["dspark"].config), max_seq=s.max_seq, dtype=s.dtype)
    return io.mtp_signature(num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
                            vocab_size=c.vocab_size, steps=m.heads["mtp"].steps, max_seq=s.max_seq, dtype=s.dtype)


@pytest.mark.parametrize("case", [*CASES, HEADED])
def test_graph_io_matches_contract(tiny, case):
    """Every family's file declares exactly its contract signature, B/T/R/C as named axes, as the manifest says."""
    t = tiny(case)
    for family, g in t.manifest.graphs.items():
        want = _signature(t.manifest, family)
        assert (g.inputs, g.outputs) == want, family
        ins, outs = _declared_io(onnx.load(str(t.art / g.file), load_external_data=False))
        assert (tuple(ins), tuple(outs)) == want, family
        axes = {a for spec in (*ins, *outs) for a in spec.axes}
        assert axes == ({"B", "T", "P", "R"} if family == io.TARGET else {"B", "C"}), family
        assert all(set(b) == axes for bs in g.buckets.values() for b in bs), family


def test_golden_io_signatures():
    """The contract itself, written out once: a change here is a format change (bump FORMAT_VERSION)."""
    def rows(specs):
        return [(t.name, t.dtype, t.shape) for t in specs]

    ins, outs = io.target_signature(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=256, max_seq=128,
                                    dtype="float32", feature_dim=128)
    cache = ("float32", ("B", 2, 128, 16))
    assert rows(ins) == [
        ("input_ids", "int64", ("B", "T")), ("position_ids", "int64", ("B", "T")), ("write_index", "int64", ("B",)),
        ("token_rows", "int64", ("P",)), ("logit_rows", "int64", ("R",)), ("tree_mask", "int64", ("B", "T", "T")),
        ("past.0.key", *cache), ("past.0.value", *cache), ("past.1.key", *cache), ("past.1.value", *cache)]
    assert rows(outs) == [
        ("logits", "float32", ("R", 256)), ("features", "float32", ("B", "T", 128)),
        ("present.0.key", *cache), ("present.0.value", *cache), ("present.1.key", *cache),
        ("present.1.value", *cache)]

    ins, outs = io.dspark_signature(num_layers=1, num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=256,
                                    num_features=3, block=4, max_seq=128, dtype="float32", confidence=True)
    assert rows(ins) == [
        ("ctx_features", "float32", ("B", "C", 192)), ("ctx_positions", "int64", ("B", "C")),
        ("ctx_write_index", "int64", ("B",)), ("ctx_len", "int64", ("B",)), ("anchor_ids", "int64", ("B",)),
        ("temperature", "float32", ("B",)), ("noise", "float32", ("B", 4)),
        ("truncate_threshold", "float32", ()), ("truncate_budget", "int64", ()),
        ("past.0.key", *cache), ("past.0.value", *cache)]
    assert rows(outs) == [
        ("draft_tokens", "int64", ("B", 4)), ("draft_logits", "float32", ("B", 4, 256)),
        ("draft_probs", "float32", ("B", 4, 256)), ("draft_first_top", "int64", ("B", 4)),
        ("draft_first_probs", "float32", ("B", 4)), ("confidence_logits", "float32", ("B", 4)),
        ("survival", "float32", ("B", 4)), ("verify_lengths", "int64", ("B",)),
        ("present.0.key", *cache), ("present.0.value", *cache)]

    ins, outs = io.mtp_signature(num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=256, steps=3, max_seq=128,
                                 dtype="float16")
    half = ("float16", ("B", 2, 128, 16))
    assert rows(ins) == [
        ("tokens", "int64", ("B", "C")), ("hidden", "float16", ("B", "C", 64)), ("positions", "int64", ("B", "C")),
        ("last_row", "int64", ("B",)), ("temperature", "float32", ("B",)), ("noise", "float32", ("B", 3)),
        ("past.0.key", *half), ("past.0.value", *half)]
    assert rows(outs) == [
        ("draft_tokens", "int64", ("B", 3)), ("draft_logits", "float16", ("B", 3, 256)),
        ("draft_probs", "float32", ("B", 3, 256)), ("present.0.key", *half), ("present.0.value", *half)]


def test_golden_buckets():
    """The fixed shapes each family is run at, written out once (batch 4: slot counts 1, 2, 4)."""
    s = io.ExportSettings(batch=4, max_seq=128, prefill_chunk=16, verify_len=3)
    assert io.batch_sizes(1) == [1] and io.batch_sizes(4) == [1, 2, 4] and io.batch_sizes(6) == [1, 2, 4, 6]
    assert io.target_buckets(s) == {
        "prefill": ({"B": 1, "T": 16, "P": 16, "R": 1},),
        "decode": ({"B": 1, "T": 1, "P": 1, "R": 1}, {"B": 2, "T": 1, "P": 2, "R": 2}, {"B": 4, "T": 1, "P": 4, "R": 4}),
        "verify": ({"B": 1, "T": 2, "P": 2, "R": 2}, {"B": 1, "T": 3, "P": 3, "R": 3},
                   {"B": 2, "T": 2, "P": 2, "R": 2}, {"B": 2, "T": 2, "P": 4, "R": 4},
                   {"B": 2, "T": 3, "P": 2, "R": 2}, {"B": 2, "T": 3, "P": 4, "R": 4}, {"B": 2, "T": 3, "P": 6, "R": 6},
                   {"B": 4, "T": 2, "P": 4, "R": 4}, {"B": 4, "T": 2, "P": 8, "R": 8},
                   {"B": 4, "T": 3, "P": 4, "R": 4}, {"B": 4, "T": 3, "P": 8, "R": 8},
                   {"B": 4, "T": 3, "P": 12, "R": 12})}
    assert io.head_buckets(s) == {
        "prefill": ({"B": 1, "C": 16},),
        "propose": ({"B": 1, "C": 1}, {"B": 1, "C": 2}, {"B": 1, "C": 3}, {"B": 2, "C": 1}, {"B": 2, "C": 2},
                    {"B": 2, "C": 3}, {"B": 4, "C": 1}, {"B": 4, "C": 2}, {"B": 4, "C": 3})}


@pytest.mark.parametrize("case", STRUCTURE_CASES)
def test_weights_stored_once_as_external_data(tiny, case):
    t = tiny(case)
    weights = t.art / io.WEIGHTS_FILE
    size = weights.stat().st_size
    ranges: dict[str, tuple[int, int]] = {}  # every graph that reads a tensor reads the same bytes
    for family, g in t.manifest.graphs.items():
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
                assert ranges.setdefault(init.name, (offset, length)) == (offset, length), init.name
            else:
                assert not init.name.startswith(("model.", "lm_head", "dspark.", "mtp.")), f"{init.name} inline"
                inline_bytes += len(init.raw_data) + 8 * len(init.int64_data) + 4 * len(init.float_data)
        assert "model.embed_tokens.weight" in external  # the heads read the target's embedding, not a copy
        if family == io.TARGET:
            assert ("lm_head.weight" in external) == (not t.manifest.model.tie_word_embeddings)
        assert inline_bytes < 16 * 1024  # shape constants and rope frequencies only
        assert path.stat().st_size < 128 * 1024 < size
    spans = sorted(ranges.values())
    assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:])), "weight ranges overlap"
    assert sum(length for _, length in spans) <= size


@pytest.mark.parametrize("case", STRUCTURE_CASES)
def test_node_names_are_paths(tiny, case):
    t = tiny(case)
    for family, g in t.manifest.graphs.items():
        names = [n.name for n in onnx.load(str(t.art / g.file), load_external_data=False).graph.node]
        assert all(n.startswith(f"/{family}/") for n in names), [n for n in names if f"/{family}/" not in n][:5]
        assert len(set(names)) == len(names)
    names = [n.name for n in onnx.load(str(t.art / "target.onnx"), load_external_data=False).graph.node]
    assert any(n.startswith("/target/layers.1/attn/") for n in names)


@pytest.mark.parametrize("case", [*CASES, HEADED])
def test_standard_graphs_use_only_tensorrt_parser_ops(tiny, case):
    t = tiny(case)
    assert t.manifest.export.attention == "standard"
    for g in t.manifest.graphs.values():
        model = onnx.load(str(t.art / g.file), load_external_data=False)
        # the one non-standard node: specrt::ConfidenceTruncate, a TensorRT plugin (its ONNX function is for ORT)
        plugins = [n.op_type for n in model.graph.node if n.domain == "specrt"]
        assert plugins == (["ConfidenceTruncate"] if g.name == "dspark" and t.manifest.heads["dspark"].confidence
                           else [])
        assert [f.name for f in model.functions] == plugins
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 23)] + [("specrt", 1)] * bool(plugins)
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx", "specrt"}
        used = {n.op_type for n in model.graph.node if n.domain != "specrt"}
        assert used <= TRT_OPS, f"{g.file}: ops outside the TensorRT parser allowlist: {sorted(used - TRT_OPS)}"


# Inputs the same support matrix requires to be initializers (constants): (op, input index).
TRT_CONSTANT_INPUTS = {("Slice", 3), ("Squeeze", 1), ("Unsqueeze", 1), ("TopK", 1), ("CumSum", 1)}


@pytest.mark.parametrize("case", ["llama_tied", "qwen2", "qwen3", HEADED])
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
    assert m.export.dtype == "float16" and set(m.graphs) == {io.TARGET}
    for family, g in m.graphs.items():
        model = onnx.load(str(fp16_art / g.file), load_external_data=False)
        weights = [i for i in model.graph.initializer if i.name.startswith("model.")]
        assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)
        ins, outs = _declared_io(model)
        assert {s.dtype for s in ins if s.name.startswith("past.")} == {"float16"}
        assert {s.dtype for s in outs} == {"float16"}
        assert all(s.dtype == "float16" for s in g.cache_inputs())
        full = onnx.load(str(fp32.art / fp32.manifest.graphs[family].file), load_external_data=False)
        assert 2 * _external_bytes(model) == _external_bytes(full)


def test_fp16_logits_close_to_fp32(tiny, fp16_art):
    t = tiny("qwen3")
    spec = io.load_manifest(fp16_art).graphs[io.TARGET]
    sess = _session(fp16_art, spec.file)
    bucket = spec.bucket("verify", B=SETTINGS.batch, T=SETTINGS.verify_len)
    B, T = bucket["B"], bucket["T"]
    ids = _random_ids(t.vocab, (B, SEQ), seed=5)
    cache = _zero_cache(spec, B)
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
    from specrt.runtime.engine import Engine

    engine = Engine(fp16_art, threads=1)
    outs, _ = engine.generate([_request([5, 6, 7], max_new_tokens=8, ignore_eos=True)])
    assert len(outs[0].output_ids) == 8


# -- atomic export and manifest validation ---------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize("step", ["_write_target", "_write_head", "_check_graphs"])
def test_interrupted_export_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch, step):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, step, interrupt)
    model, out = tiny_model_dir("llama"), tmp_path / "art"
    heads = {"mtp": random_mtp_checkpoint(tmp_path / "mtp", model)} if step == "_write_head" else {}
    with pytest.raises(KeyboardInterrupt):
        export_artifact(model, out, SETTINGS, progress=False, **heads)
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
    """A directory of the user's is never replaced, --force or not; an earlier export is, with --force."""
    t = tiny("llama_tied")
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(SpecrtError, match="already exists.*--force"):
        export_artifact(t.model_dir, out, SETTINGS, progress=False)
    with pytest.raises(SpecrtError, match="not written by specrt"):
        export_artifact(t.model_dir, out, SETTINGS, progress=False, force=True)
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    export_artifact(t.model_dir, out, SETTINGS, progress=False, force=True)  # empty: fine
    export_artifact(t.model_dir, out, SETTINGS, progress=False, force=True)  # an earlier export: replaced
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
    (art_copy / "target.onnx").unlink()
    with pytest.raises(SpecrtError, match="incomplete.*target.onnx is missing"):
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
