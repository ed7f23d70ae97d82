"""DSpark draft head: DeepSpec fixture parity (torch and ONNX), ONNX vs torch on random heads, loader errors, I/O."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.numpy import load_file

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders import load_target
from specrt.model_config import DSparkConfig
from specrt.exporter.loaders.deepspec import load_dspark, random_dspark_checkpoint, save_deepspec_checkpoint
from specrt.models.dspark import DSparkDraft
from specrt.models.llama import Transformer
from specrt.exporter.onnx.builder import GraphBuilder, WeightStore
from specrt.plugins.confidence_truncate import truncate
from specrt.exporter.onnx.dspark import build_dspark_graph, dspark_signature, dspark_weights
from specrt.runtime.backends import bucket_of, infer, load_runner
from test_export import TRT_CONSTANT_INPUTS, TRT_OPS

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
ATOL = 1e-4


# -- helpers ---------------------------------------------------------------------------------------------


def export_draft(out: Path, cfg: DSparkConfig, target_cfg, draft_w, target_w, *, max_seq: int,
                 dtype: str = "float32") -> Path:
    """Write weights.bin + dspark.onnx (axes B/C) for one draft head into `out` (what the exporter does)."""
    out.mkdir(parents=True, exist_ok=True)
    store = WeightStore(out / io.WEIGHTS_FILE)
    tensors = dspark_weights(cfg, draft_w, target_w)
    for name in sorted(tensors):
        store.add(name, tensors[name].astype(dtype))
    store.close()
    g = GraphBuilder(store)
    build_dspark_graph(g, cfg, target_cfg, max_seq=max_seq, dtype=dtype)
    onnx.save(g.model("dspark"), out / "dspark.onnx")
    return out / "dspark.onnx"


class OnnxDraft:
    """One ORT session plus its cache buffers; each call feeds past.* and keeps present.*."""

    def __init__(self, path: Path, cfg: DSparkConfig, batch: int, max_seq: int, dtype: str = "float32") -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = 1, 3
        self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        shape = (batch, cfg.layers.num_kv_heads, max_seq, cfg.layers.head_dim)
        self.cache = {n: np.zeros(shape, dtype) for i in range(cfg.layers.num_layers) for n in io.past_names(i)}
        self.dtype = dtype

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = dict(feeds, **self.cache)
        feeds[io.CTX_FEATURES] = feeds[io.CTX_FEATURES].astype(self.dtype)
        if any(i.name == io.TRUNCATE_BUDGET for i in self.sess.get_inputs()):  # ConfidenceTruncate: keep all
            feeds.setdefault(io.TRUNCATE_THRESHOLD, np.array(0.0, np.float32))
            feeds.setdefault(io.TRUNCATE_BUDGET, np.array(-1, np.int64))
        names = [o.name for o in self.sess.get_outputs()]
        out = dict(zip(names, self.sess.run(names, feeds)))
        for name in self.cache:
            self.cache[name] = out[name.replace("past.", "present.", 1)]
        return out


class TorchDraft:
    """The torch reference behind the same call interface (outputs named as the graph's)."""

    def __init__(self, cfg: DSparkConfig, weights: dict[str, np.ndarray], batch: int, max_seq: int) -> None:
        self.model = DSparkDraft.from_weights(cfg, weights)
        self.model.setup_caches(batch, max_seq)
        self.temperatures = np.asarray(cfg.confidence_temperatures or [1.0] * cfg.block_size, np.float32)

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()}
        with torch.no_grad():
            o = self.model(t[io.CTX_FEATURES], t[io.CTX_POSITIONS], t[io.CTX_WRITE_INDEX], t[io.CTX_LEN],
                           t[io.ANCHOR_IDS], t[io.TEMPERATURE], t[io.NOISE])
        out = {io.DRAFT_TOKENS: o.tokens, io.DRAFT_LOGITS: o.logits, io.DRAFT_PROBS: o.probs}
        top = torch.softmax(o.logits[:, 0].float(), -1).topk(io.FIRST_TOP, -1)  # the first slot's alternatives
        out[io.DRAFT_FIRST_TOP], out[io.DRAFT_FIRST_PROBS] = top.indices, top.values
        if o.confidence_logits is not None:  # and specrt::ConfidenceTruncate's reference, keeping every draft
            out[io.CONFIDENCE_LOGITS] = o.confidence_logits
            a, lengths = truncate(o.confidence_logits.numpy(), self.temperatures, 0.0, -1)
            out[io.SURVIVAL], out[io.VERIFY_LENGTHS] = torch.from_numpy(a), torch.from_numpy(lengths)
        for i, layer in enumerate(self.model.layers):
            c = layer.self_attn.kv_cache
            out.update(zip(io.present_names(i), (c.k_cache, c.v_cache)))
        return {k: v.numpy().copy() for k, v in out.items()}


def make_feeds(features: list[np.ndarray], rows: list[tuple[int, int]], ctx_rows: int, anchors: list[int],
               block: int, *, temperature=None, noise=None, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for one call: slot b writes feature rows [start, end) at cache slots start.. (padding is garbage)."""
    rng = np.random.default_rng(seed)
    b = len(rows)
    feats = rng.standard_normal((b, ctx_rows, features[0].shape[-1])).astype(np.float32)  # padding must not matter
    pos = np.zeros((b, ctx_rows), np.int64)
    for i, (start, end) in enumerate(rows):
        feats[i, :end - start] = features[i][start:end]
        pos[i] = np.arange(start, start + ctx_rows)
    return {io.CTX_FEATURES: feats, io.CTX_POSITIONS: pos,
            io.CTX_WRITE_INDEX: np.array([s for s, _ in rows], np.int64),
            io.CTX_LEN: np.array([e for _, e in rows], np.int64), io.ANCHOR_IDS: np.array(anchors, np.int64),
            io.TEMPERATURE: np.asarray(np.zeros(b) if temperature is None else temperature, np.float32),
            io.NOISE: np.asarray(rng.random((b, block)) if noise is None else noise, np.float32)}


def target_features(target, ids: np.ndarray, layer_ids) -> np.ndarray:
    """Concatenated raw outputs of target layers `layer_ids` for every position of `ids`, by our own target."""
    model = Transformer.from_weights(target.config, target.weights)
    model.setup_caches(1, len(ids))
    t = torch.from_numpy(ids)[None]
    with torch.no_grad():
        _, _, caps = model(t, torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.long), capture_layers=layer_ids)
    return torch.cat(caps, dim=-1)[0].numpy()


def reference_rule(logits: np.ndarray, temperature: float, noise: float) -> int:
    """The sampling rule of artifact.py in numpy (what the runtime reproduces)."""
    x = logits.astype(np.float32)
    if temperature <= 0:
        return int(np.argmax(x))
    p = np.exp(x / temperature - (x / temperature).max())
    cdf = np.cumsum(p / p.sum(), dtype=np.float32)
    return int(min(np.count_nonzero(cdf <= noise * cdf[-1]), len(x) - 1))


# -- the DeepSpec fixture --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepspec():
    target = load_target(FIXTURE / "target")
    draft = load_dspark(FIXTURE / "draft", target.config)
    z = dict(np.load(FIXTURE / "expected.npz"))
    return target, draft, z, target_features(target, z["input_ids"], draft.config.target_layer_ids)


def test_fixture_loads(deepspec):
    target, draft, _, _ = deepspec
    cfg = draft.config
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id, cfg.markov_rank) == (4, (1, 3, 5), 500, 64)
    assert cfg.layers.family == "qwen3" and cfg.layers.num_layers == 2 and cfg.confidence_head_with_markov
    tensors = dspark_weights(cfg, draft.weights, target.weights)  # frozen copies alias the target's tensors
    assert "dspark.embed_tokens.weight" not in tensors and "dspark.lm_head.weight" not in tensors
    assert {"model.embed_tokens.weight", "lm_head.weight", "dspark.layers.1.self_attn.kv_proj.weight"} <= set(tensors)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_fixture_matches_deepspec(deepspec, backend, tmp_path):
    """Both anchors in one batch of 2, context fed in two chunks through the cache, greedy."""
    target, draft, z, feats = deepspec
    np.testing.assert_allclose(feats[:37], z["anchor1_context_features"], atol=ATOL)
    np.testing.assert_allclose(feats[:23], z["anchor0_context_features"], atol=ATOL)
    cfg, ids = draft.config, z["input_ids"]
    anchors = [int(z["anchor0_position"]), int(z["anchor1_position"])]
    C, S, K = 20, 64, cfg.block_size
    # the Markov/confidence-free variant of the same head outputs the base (pre-Markov) logits
    base_cfg = dataclasses.replace(cfg, markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    base_w = {k: v for k, v in draft.weights.items() if not k.startswith(("markov_head.", "confidence_head."))}
    results = []
    for c, w in ((cfg, draft.weights), (base_cfg, base_w)):
        if backend == "onnx":
            run = OnnxDraft(export_draft(tmp_path / str(len(results)), c, target.config, w, target.weights,
                                         max_seq=S), c, 2, S)
        else:
            run = TorchDraft(c, w, 2, S)
        split = [(p + 1) // 2 for p in anchors]
        run(make_feeds([feats, feats], [(0, n) for n in split], C, [ids[n] for n in split], K))
        results.append(run(make_feeds([feats, feats], list(zip(split, anchors)), C, [ids[p] for p in anchors], K,
                                      seed=1)))
    out, base = results
    for j in range(2):
        np.testing.assert_allclose(base[io.DRAFT_LOGITS][j], z[f"anchor{j}_base_logits"], atol=ATOL)
        np.testing.assert_allclose(out[io.DRAFT_LOGITS][j], z[f"anchor{j}_corrected_logits"], atol=ATOL)
        np.testing.assert_allclose(out[io.CONFIDENCE_LOGITS][j], z[f"anchor{j}_confidence_logits"], atol=ATOL)
        np.testing.assert_array_equal(out[io.DRAFT_TOKENS][j], z[f"anchor{j}_draft_tokens"])


def test_fixture_trace_replay(deepspec, tmp_path):
    """DeepSpec's greedy speculative loop with our ONNX draft + our torch target: every round's drafts,
    confidences and accepted counts, and the output, equal DeepSpec's (expected_trace.json)."""
    target, draft, _, _ = deepspec
    trace = json.loads((FIXTURE / "expected_trace.json").read_text())
    cfg, K, S, C = draft.config, trace["block_size"], 128, 32
    run = OnnxDraft(export_draft(tmp_path, cfg, target.config, draft.weights, target.weights, max_seq=S), cfg, 1, S)
    verifier = Transformer.from_weights(target.config, target.weights)
    verifier.setup_caches(1, S)

    def target_step(ids: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        with torch.no_grad():
            logits, _, caps = verifier(torch.tensor([ids]), torch.arange(start, start + len(ids))[None],
                                       torch.tensor([start]), capture_layers=cfg.target_layer_ids)
        return logits[0].argmax(-1).numpy(), torch.cat(caps, -1)[0].numpy()

    for sample in trace["samples"]:
        prompt = sample["prompt_ids"]
        feats = np.zeros((S, cfg.feature_dim), np.float32)  # target features by position
        best, feats[:len(prompt)] = target_step(prompt, 0)
        out, start, written = [int(best[-1])], len(prompt), 0  # start: position of the newest committed token
        for expected in sample["rounds"]:
            got = run(make_feeds([feats], [(written, start)], C, [out[-1]], K, noise=np.zeros((1, K))))
            drafts = got[io.DRAFT_TOKENS][0].tolist()
            assert drafts == expected["draft_tokens"]
            np.testing.assert_allclose(got[io.CONFIDENCE_LOGITS][0], expected["confidence_logits"], atol=ATOL)
            best, verified = target_step([out[-1], *drafts], start)
            accepted = next((k for k in range(K) if drafts[k] != best[k]), K)
            assert accepted == expected["accepted"]
            out += drafts[:accepted] + [int(best[accepted])]
            # next context: the verified rows of the committed tokens, at positions start..start+accepted
            feats[start:start + accepted + 1] = verified[:accepted + 1]
            written, start = start, start + accepted + 1
        assert out[:trace["max_new_tokens"]] == sample["output_ids"]


def test_fixture_through_exported_artifact(deepspec, tmp_path):
    """`specrt export` of DeepSpec's target with its draft, run through OrtRunner with the caches bound in place:
    the target's features (prefill bucket) and each slot's draft (the draft's prefill bucket) match DeepSpec's."""
    _, draft, z, _ = deepspec
    cfg, ids, K = draft.config, z["input_ids"], draft.config.block_size
    settings = io.ExportSettings(batch=2, max_seq=64, prefill_chunk=20, verify_len=K + 1)
    art = export_artifact(FIXTURE / "target", tmp_path / "art", settings, draft=FIXTURE / "draft", progress=False)
    m = io.load_manifest(art)
    assert m.features == tuple(cfg.target_layer_ids) and m.heads["dspark"].feature_dim == cfg.feature_dim
    target, drafter = (load_runner("ort", art, m, family, threads=1) for family in (io.TARGET, "dspark"))
    target.allocate(1)
    C = m.graphs[io.TARGET].bucket("prefill")["T"]
    feats = np.concatenate([infer(target, 0, {
        io.INPUT_IDS: ids[None, s:s + C], io.POSITION_IDS: np.arange(s, s + C)[None], io.WRITE_INDEX: np.array([s]),
        io.TOKEN_ROWS: np.arange(C), io.LOGIT_ROWS: np.array([C - 1])})[io.FEATURES][0].copy()
        for s in range(0, len(ids), C)])
    for j in range(2):
        n = int(z[f"anchor{j}_position"])
        np.testing.assert_allclose(feats[:n], z[f"anchor{j}_context_features"], atol=ATOL)
    drafter.allocate(2)
    bucket = m.graphs["dspark"].bucket("prefill")
    for j in (1, 0):  # the second slot first: a call must touch only its own cache rows
        anchor = int(z[f"anchor{j}_position"])
        split = (anchor + 1) // 2
        for rows in ((0, split), (split, anchor)):  # the context in two calls through the draft's cache
            feeds = make_feeds([feats], [rows], bucket["C"], [ids[rows[1]]], K)
            feeds.update({io.TRUNCATE_THRESHOLD: np.array(0.0, np.float32), io.TRUNCATE_BUDGET: np.array(-1)})
            assert bucket_of(m.graphs["dspark"], feeds) == bucket
            out = infer(drafter, j, feeds)
        np.testing.assert_allclose(out[io.DRAFT_LOGITS][0], z[f"anchor{j}_corrected_logits"], atol=ATOL)
        np.testing.assert_allclose(out[io.CONFIDENCE_LOGITS][0], z[f"anchor{j}_confidence_logits"], atol=ATOL)
        np.testing.assert_array_equal(out[io.DRAFT_TOKENS][0], z[f"anchor{j}_draft_tokens"])


# -- random heads: ONNX vs torch -------------------------------------------------------------------------

HEADS = {"vanilla": dict(head_type="vanilla"), "gated": dict(head_type="gated"), "rnn": dict(head_type="rnn"),
         "dflash": dict(markov_rank=0, confidence=False), "conf_no_markov": dict(markov_rank=0, confidence=True)}


def random_head(tmp: Path, target_src, head: str, **kw):
    """A random checkpoint for `target_src` (HF dir or ModelConfig), loaded back through load_dspark."""
    path = random_dspark_checkpoint(tmp / "ckpt", target_src, layers=2, init_std=0.2, **{**HEADS[head], **kw})
    tcfg = target_src if not isinstance(target_src, Path) else load_target(target_src).config
    return load_dspark(path, tcfg)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("family", ["qwen3", "llama", "llama_bias"])
def test_onnx_matches_torch(tiny_model_dir, tmp_path, family, head):
    """Three calls, 2 slots at different cache lengths, greedy and sampled slots, fixed noise."""
    if family == "llama_bias":  # q/k/v/o biases; no target weights, so the draft keeps its own embed/head
        tcfg = dataclasses.replace(load_target(tiny_model_dir("llama", num_layers=4)).config, attention_bias=True)
        target_w, draft = {}, random_head(tmp_path, tcfg, head)
    else:
        src = tiny_model_dir(family, num_layers=4)
        target = load_target(src)
        tcfg, target_w, draft = target.config, target.weights, random_head(tmp_path, src, head)
    cfg = draft.config
    assert cfg.architecture == ("Qwen3DSparkModel" if family == "qwen3" else "LlamaDSparkModel")
    B, C, S, K = 2, 6, 32, cfg.block_size
    onnx_run = OnnxDraft(export_draft(tmp_path / "art", cfg, tcfg, draft.weights, target_w, max_seq=S), cfg, B, S)
    torch_run = TorchDraft(cfg, draft.weights, B, S)
    rng = np.random.default_rng(3)
    feats = [rng.standard_normal((20, cfg.feature_dim)).astype(np.float32) for _ in range(B)]
    calls = [([(0, 5), (0, 6)], [0.0, 0.7]), ([(5, 8), (6, 12)], [1.0, 0.0]), ([(8, 14), (12, 13)], [1.5, 0.3])]
    for n, (rows, temps) in enumerate(calls):
        feeds = make_feeds(feats, rows, C, rng.integers(3, cfg.layers.vocab_size, B).tolist(), K, temperature=temps,
                           seed=n)
        got, want = onnx_run(feeds), torch_run(feeds)
        assert set(got) == set(want)
        np.testing.assert_array_equal(got[io.DRAFT_TOKENS], want[io.DRAFT_TOKENS])
        for name in want:
            if name != io.DRAFT_TOKENS:
                np.testing.assert_allclose(got[name], want[name], atol=1e-5 if name == io.DRAFT_PROBS else ATOL,
                                           err_msg=f"call {n}: {name}")
        for b in range(B):  # the runtime can reproduce every token from draft_logits, temperature and noise
            for k in range(K):
                assert got[io.DRAFT_TOKENS][b, k] == reference_rule(got[io.DRAFT_LOGITS][b, k], temps[b],
                                                                    feeds[io.NOISE][b, k])
            np.testing.assert_allclose(got[io.DRAFT_PROBS][b].sum(-1), 1.0, atol=1e-5)
            # the first slot's likeliest tokens at temperature 1, best first: the first is its greedy draft
            first = np.exp(got[io.DRAFT_LOGITS][b, 0] - got[io.DRAFT_LOGITS][b, 0].max())
            first /= first.sum()
            top = got[io.DRAFT_FIRST_TOP][b]
            assert top.tolist() == np.argsort(-first, kind="stable")[:io.FIRST_TOP].tolist()
            np.testing.assert_allclose(got[io.DRAFT_FIRST_PROBS][b], first[top], rtol=1e-5)
            if temps[b] == 0:
                assert top[0] == got[io.DRAFT_TOKENS][b, 0]


def test_embed_and_head_sharing(tiny_model_dir, tmp_path):
    """Equal copies alias the target's names (tied target: the head is the embedding); a changed copy is kept."""
    src = tiny_model_dir("llama", num_layers=4)  # tied embeddings
    target, draft = load_target(src), random_head(tmp_path, src, "vanilla")
    tensors = dspark_weights(draft.config, draft.weights, target.weights)
    assert not {"dspark.embed_tokens.weight", "dspark.lm_head.weight", "lm_head.weight"} & set(tensors)
    w = dict(draft.weights, **{"lm_head.weight": draft.weights["lm_head.weight"] + 1.0})
    assert "dspark.lm_head.weight" in dspark_weights(draft.config, w, target.weights)


def test_fp16_graph_runs_close_to_fp32(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3", num_layers=4)
    target, draft = load_target(src), random_head(tmp_path, src, "vanilla")
    cfg, B, C, S = draft.config, 2, 6, 32
    run = OnnxDraft(export_draft(tmp_path / "fp16", cfg, target.config, draft.weights, target.weights, max_seq=S,
                                 dtype="float16"), cfg, B, S, dtype="float16")
    feats = [np.random.default_rng(b).standard_normal((8, cfg.feature_dim)).astype(np.float32) for b in range(B)]
    feeds = make_feeds(feats, [(0, 4), (0, 6)], C, [5, 9], cfg.block_size)
    got, want = run(feeds), TorchDraft(cfg, draft.weights, B, S)(feeds)
    assert got[io.DRAFT_LOGITS].dtype == np.float16 and got[io.DRAFT_PROBS].dtype == np.float32
    assert np.isfinite(got[io.DRAFT_LOGITS]).all()
    np.testing.assert_allclose(got[io.DRAFT_LOGITS].astype(np.float32), want[io.DRAFT_LOGITS], atol=3e-2)


# -- graph structure ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["vanilla", "rnn", "dflash"])
def test_graph_signature_and_ops(tiny_model_dir, tmp_path, head):
    """The file declares `io.dspark_signature` over named axes B/C; path names; TensorRT parser ops only."""
    src = tiny_model_dir("qwen3", num_layers=4)
    target, draft = load_target(src), random_head(tmp_path, src, head)
    cfg, lc = draft.config, draft.config.layers
    path = export_draft(tmp_path / "art", cfg, target.config, draft.weights, target.weights, max_seq=24)
    onnx.checker.check_model(str(path), full_check=True)
    inputs, outputs = io.dspark_signature(
        num_layers=lc.num_layers, num_kv_heads=lc.num_kv_heads, head_dim=lc.head_dim, hidden_size=lc.hidden_size,
        vocab_size=lc.vocab_size, num_features=len(cfg.target_layer_ids), block=cfg.block_size, max_seq=24,
        dtype="float32", confidence=cfg.enable_confidence_head)
    assert dspark_signature(cfg, max_seq=24, dtype="float32") == (inputs, outputs)
    model = onnx.load(str(path), load_external_data=False)

    def declared(values):
        return [(v.name, onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                 tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)) for v in values]

    assert declared(model.graph.input) == [(t.name, t.dtype, t.shape) for t in inputs]
    assert declared(model.graph.output) == [(t.name, t.dtype, t.shape) for t in outputs]
    assert {a for t in (*inputs, *outputs) for a in t.axes} == {"B", "C"}
    names = [n.name for n in model.graph.node]
    assert all(n.startswith("/dspark/") for n in names) and len(set(names)) == len(names)
    assert any(n.startswith("/dspark/layers.1/attn/ctx/") for n in names)  # the context rows' k/v projection
    plugin = [n for n in model.graph.node if n.domain == "specrt"]  # a TensorRT plugin; ORT runs its function
    if cfg.enable_confidence_head:
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 23), ("specrt", 1)]
        assert [n.op_type for n in plugin] == ["ConfidenceTruncate"]
        assert [(f.domain, f.name) for f in model.functions] == [("specrt", "ConfidenceTruncate")]
        assert {a.name: a.s for a in plugin[0].attribute} == {"plugin_namespace": b"specrt", "plugin_version": b"1"}
    else:
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 23)] and not plugin
    used = {n.op_type for n in model.graph.node if n.domain != "specrt"}
    assert used <= TRT_OPS, f"ops outside the TensorRT parser allowlist: {sorted(used - TRT_OPS)}"
    constants = {i.name for i in model.graph.initializer}
    for n in model.graph.node:
        for op, index in TRT_CONSTANT_INPUTS:
            if n.op_type == op and len(n.input) > index and n.input[index]:
                assert n.input[index] in constants, f"{n.name} input {index} is not an initializer"


# -- loading ------------------------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tiny_model_dir, tmp_path):
    """(qwen3 target config, a valid random DSpark checkpoint dir) for a 4-layer vocab-256 target."""
    src = tiny_model_dir("qwen3", num_layers=4)
    return load_target(src).config, random_dspark_checkpoint(tmp_path / "good", src, target_layer_ids=(0, 2))


def mutate(src: Path, dst: Path, *, config: dict | None = None, drop: tuple[str, ...] = (),
           reshape: dict[str, tuple[int, ...]] | None = None) -> Path:
    hf = json.loads((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    for name in drop:
        weights.pop(name)
    for name, shape in (reshape or {}).items():
        weights[name] = np.zeros(shape, np.float32)
    return save_deepspec_checkpoint(dst, {**hf, **(config or {})}, weights)


BAD = {
    "missing tensor": (dict(drop=("fc.weight",)), {}, r"missing tensor fc\.weight \(expected shape \[64, 128\]\)"),
    "wrong shape": (dict(reshape={"hidden_norm.weight": (65,)}), {},
                    r"hidden_norm\.weight has shape \[65\], expected \[64\]"),
    "architecture": (dict(config={"architectures": ["Qwen2DSparkModel"]}), {},
                     r"'Qwen2DSparkModel'; accepted: Qwen3DSparkModel, LlamaDSparkModel"),
    "hidden size": ({}, dict(hidden_size=128), r"hidden_size 64 does not match the target's hidden_size 128"),
    "vocab size": ({}, dict(vocab_size=300), r"vocab_size 256 does not match the target's vocab_size 300"),
    "head_dim": ({}, dict(head_dim=32), r"head_dim 16 does not match the target's head_dim 32"),
    "layer out of range": (dict(config={"target_layer_ids": [0, 9]}), {}, r"\[0, 9\]: \[9\] outside -1\.\.2"),
    "last layer": (dict(config={"target_layer_ids": [0, 3]}), {}, r"\[3\] outside -1\.\.2 .*last layer 3"),
    "not increasing": (dict(config={"target_layer_ids": [2, 0]}), {}, r"\[2, 0\] must be .*strictly increasing"),
    "mask token": (dict(config={"mask_token_id": 256}), {}, r"mask_token_id 256 .*vocab_size 256"),
    "head type": (dict(config={"markov_head_type": "lstm"}), {}, r"'lstm' is not one of vanilla, gated, rnn"),
    "unexpected": (dict(config={"markov_rank": 0, "enable_confidence_head": False}), {},
                   r"unexpected tensors \['confidence_head\.proj\.bias', .*markov_rank=0"),
    "trained target": (dict(config={"num_target_layers": 36}), {}, r"36-layer target, this target has 4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints(ckpt, tmp_path, case):
    tcfg, good = ckpt
    change, target_change, message = BAD[case]
    path = mutate(good, tmp_path / "bad", **change)
    with pytest.raises(SpecrtError, match=message):
        load_dspark(path, dataclasses.replace(tcfg, **target_change))


def test_missing_files(ckpt, tmp_path):
    tcfg, good = ckpt
    with pytest.raises(SpecrtError, match="draft checkpoint not found"):
        load_dspark(tmp_path / "nope", tcfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecrtError, match="no config.json"):
        load_dspark(tmp_path / "empty", tcfg)
    shutil.copy(good / "config.json", tmp_path / "empty")
    with pytest.raises(SpecrtError, match="no model.safetensors"):
        load_dspark(tmp_path / "empty", tcfg)


def test_bf16_and_dflash_without_keys(ckpt, tiny_model_dir, tmp_path):
    tcfg, good = ckpt
    src = tiny_model_dir("qwen3", num_layers=4)
    bf16_dir = random_dspark_checkpoint(tmp_path / "bf16", src, target_layer_ids=(0, 2), dtype="bfloat16")
    bf16 = load_dspark(bf16_dir, tcfg)
    fp32 = load_dspark(good, tcfg)
    for name, w in fp32.weights.items():
        assert bf16.weights[name].dtype == np.float32
        np.testing.assert_array_equal(bf16.weights[name], torch.from_numpy(w).bfloat16().float().numpy())
    # a DFlash checkpoint that omits the Markov / confidence keys altogether
    path = random_dspark_checkpoint(tmp_path / "dflash", src, markov_rank=0, confidence=False)
    hf = json.loads((path / "config.json").read_text())
    for key in ("markov_rank", "enable_confidence_head"):
        hf.pop(key)
    (path / "config.json").write_text(json.dumps(hf))
    cfg = load_dspark(path, tcfg).config
    assert (cfg.markov_rank, cfg.enable_confidence_head) == (0, False)
    assert DSparkConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
