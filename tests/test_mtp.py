"""MTP head: both checkpoint forms, the torch reference against the formula, ONNX graph parity and contract."""
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
from safetensors.numpy import load_file, save_file

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.hf import load_hf_dir
from specrt.exporter.loaders.mtp import load_mtp, random_mtp_checkpoint, save_mtp_checkpoint
from specrt.models.mtp import MTP
from specrt.models.sampling import sample_draft
from specrt.exporter.onnx.builder import GraphBuilder, WeightStore
from specrt.exporter.onnx.mtp import build_mtp_graph, mtp_weights
from specrt.exporter.onnx.sampling import sample_draft as emit_sample_draft
from specrt.runtime.backends import bucket_of, infer, load_runner
from test_export import TRT_CONSTANT_INPUTS, TRT_OPS  # the TensorRT parser allowlist, kept in one place

FAMILIES = ("llama", "qwen2", "qwen3")
B, C, G, S = 2, 4, 3, 32  # slots, rows per call, chained draft steps, cache positions
ATOL = 1e-4


@dataclasses.dataclass
class Case:
    target_dir: Path
    mtp_dir: Path

    def __post_init__(self) -> None:
        self.target = load_hf_dir(self.target_dir)
        self.loaded = load_mtp(self.mtp_dir, self.target.config)

    def torch_model(self, feedback: str = "post") -> MTP:
        model = MTP.from_weights(self.loaded.config, self.loaded.weights, self.target.weights, feedback=feedback)
        model.setup_caches(B, S)
        return model


@pytest.fixture(scope="module")
def case(tiny_model_dir, tmp_path_factory):
    """case(kind, own_head=False) -> Case: a tiny target plus a random standalone MTP for it."""
    cache: dict[tuple, Case] = {}

    def get(kind: str, own_head: bool = False) -> Case:
        if (kind, own_head) not in cache:
            target_dir = tiny_model_dir(kind)
            mtp_dir = random_mtp_checkpoint(tmp_path_factory.mktemp(f"mtp_{kind}"), target_dir, seed=3,
                                            own_head=own_head)
            cache[kind, own_head] = Case(target_dir, mtp_dir)
        return cache[kind, own_head]

    return get


def build_graph(c: Case, out: Path, *, feedback: str = "post", dtype: str = "float32") -> Path:
    """Write weights.bin + mtp.onnx (axes B/C) for `c` into `out` (what the exporter does for a head)."""
    out.mkdir(parents=True, exist_ok=True)
    store = WeightStore(out / io.WEIGHTS_FILE)
    for name, array in sorted(mtp_weights(c.loaded.config, c.loaded.weights, c.target.weights).items()):
        store.add(name, array.astype(dtype))
    store.close()
    g = GraphBuilder(store)
    build_mtp_graph(g, c.loaded.config, c.target.config, steps=G, max_seq=S, dtype=dtype, feedback=feedback)
    onnx.save(g.model("mtp"), out / "mtp.onnx")
    return out / "mtp.onnx"


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def calls(vocab: int, d: int, temps: list[float]) -> list[dict[str, np.ndarray]]:
    """Two calls: rows with padding (garbage positions on purpose), then rows that overwrite the chain slots."""
    rng = np.random.default_rng(7)
    positions = [np.array([[0, 1, 2, 3], [0, 1, 0, 0]]),  # slot 1: rows 2,3 are padding
                 np.array([[4, 5, 6, 99], [2, 3, 4, 5]])]  # continue; chain slots of call 1 are rewritten
    last_rows = [np.array([3, 1]), np.array([2, 3])]
    return [{io.MTP_TOKENS: rng.integers(3, vocab, (B, C)), io.MTP_HIDDEN: rng.standard_normal((B, C, d), np.float32),
             io.MTP_POSITIONS: p.astype(np.int64), io.MTP_LAST_ROW: r.astype(np.int64),
             io.TEMPERATURE: np.asarray(temps, np.float32), io.NOISE: rng.random((B, G), np.float32)}
            for p, r in zip(positions, last_rows)]


# -- ONNX graph vs torch module -------------------------------------------------------------------


@pytest.mark.parametrize("temps", [[0.0, 0.0], [0.05, 1.5]], ids=["greedy", "sampled"])
@pytest.mark.parametrize("feedback", ["post", "pre"])
@pytest.mark.parametrize("kind", [*FAMILIES, "qwen3_own_head"])
def test_graph_matches_torch_incrementally(case, kind, feedback, temps, tmp_path):
    c = case(kind.removesuffix("_own_head"), own_head=kind.endswith("_own_head"))
    sess = session(build_graph(c, tmp_path, feedback=feedback))
    model = c.torch_model(feedback)
    cfg = c.target.config
    cache = {n: np.zeros((B, cfg.num_kv_heads, S, cfg.head_dim), np.float32) for n in io.past_names(0)}
    for feeds in calls(cfg.vocab_size, cfg.hidden_size, temps):
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **cache})))
        ref = model(*(torch.from_numpy(feeds[n]) for n in (io.MTP_TOKENS, io.MTP_HIDDEN, io.MTP_POSITIONS,
                                                           io.MTP_LAST_ROW, io.TEMPERATURE, io.NOISE)))
        np.testing.assert_allclose(out[io.DRAFT_LOGITS], ref.logits.numpy(), atol=ATOL, rtol=0)
        np.testing.assert_allclose(out[io.DRAFT_PROBS], ref.probs.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(out[io.DRAFT_TOKENS], ref.tokens.numpy())
        cache = {p: out[p.replace("past.", "present.", 1)] for p in cache}
        kv = model.self_attn.kv_cache
        np.testing.assert_allclose(cache["past.0.key"], kv.k_cache.numpy(), atol=ATOL, rtol=0)
        np.testing.assert_allclose(cache["past.0.value"], kv.v_cache.numpy(), atol=ATOL, rtol=0)
    if temps[0] == 0:  # greedy: every draft is its logits' argmax
        np.testing.assert_array_equal(out[io.DRAFT_TOKENS], out[io.DRAFT_LOGITS].argmax(-1))


@pytest.mark.parametrize("temps", [[0.0, 0.0], [0.05, 1.5]], ids=["greedy", "sampled"])
def test_exported_family_through_ort_runner(case, temps, tmp_path):
    """`specrt export --mtp`: the mtp family through OrtRunner, its cache bound in place, at a propose bucket."""
    c = case("qwen3")
    settings = io.ExportSettings(batch=B, max_seq=S, prefill_chunk=C, verify_len=G + 1)
    art = export_artifact(c.target_dir, tmp_path / "art", settings, mtp=c.mtp_dir, progress=False)
    m = io.load_manifest(art)
    runner = load_runner("ort", art, m, "mtp", threads=1)
    runner.allocate(B)
    model = c.torch_model()
    cfg = c.target.config
    for feeds in calls(cfg.vocab_size, cfg.hidden_size, temps):
        assert bucket_of(m.graphs["mtp"], feeds) == m.graphs["mtp"].bucket("propose", B=B, C=C) == {"B": B, "C": C}
        out = infer(runner, 0, feeds)
        ref = model(*(torch.from_numpy(feeds[n]) for n in (io.MTP_TOKENS, io.MTP_HIDDEN, io.MTP_POSITIONS,
                                                           io.MTP_LAST_ROW, io.TEMPERATURE, io.NOISE)))
        np.testing.assert_allclose(out[io.DRAFT_LOGITS], ref.logits.numpy(), atol=ATOL, rtol=0)
        np.testing.assert_allclose(out[io.DRAFT_PROBS], ref.probs.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(out[io.DRAFT_TOKENS], ref.tokens.numpy())


# -- torch module vs the formula ------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: np.ndarray, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * torch.from_numpy(w)


@pytest.mark.parametrize("kind", FAMILIES)
def test_first_step_matches_hand_computation(case, kind):
    """u = eh_proj([enorm(emb x) ; hnorm(h)]) by hand; block + shared_head.norm + head = a 1-layer HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = case(kind)
    cfg, w, tw = c.target.config, c.loaded.weights, c.target.weights
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(3, cfg.vocab_size, (1, 6)))
    hidden = torch.from_numpy(rng.standard_normal((1, 6, cfg.hidden_size), np.float32))
    model = c.torch_model()
    model.setup_caches(1, S)
    draft = model(tokens, hidden, torch.arange(6).unsqueeze(0), torch.tensor([5]), torch.zeros(1), torch.zeros(1, 1))

    e = _rms(torch.from_numpy(tw["model.embed_tokens.weight"])[tokens], w["enorm.weight"], cfg.rms_norm_eps)
    u = torch.cat([e, _rms(hidden, w["hnorm.weight"], cfg.rms_norm_eps)], -1) @ torch.from_numpy(w["eh_proj.weight"]).T
    hf_dict = json.loads((c.target_dir / "config.json").read_text())
    hf_dict.pop("layer_types", None)
    hf_cfg = AutoConfig.for_model(**{**hf_dict, "num_hidden_layers": 1, "tie_word_embeddings": False})
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    head = tw["model.embed_tokens.weight"] if cfg.tie_word_embeddings else tw["lm_head.weight"]
    mtp_only = ("enorm", "hnorm", "eh_proj", "shared_head")
    state = {f"model.layers.0.{k}": v for k, v in w.items() if not k.startswith(mtp_only)}
    state.update({"model.norm.weight": w["shared_head.norm.weight"], "lm_head.weight": head,
                  "model.embed_tokens.weight": tw["model.embed_tokens.weight"]})
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    with torch.no_grad():
        want = hf(inputs_embeds=u).logits[:, -1]
    torch.testing.assert_close(draft.logits[:, 0], want, atol=ATOL, rtol=0)
    assert draft.tokens[0, 0].item() == want.argmax(-1).item()


@pytest.mark.parametrize("feedback", ["post", "pre"])
def test_chain_step_feeds_back_the_chosen_hidden(case, feedback):
    """Step 2 = one row (draft 1, h' or shared_head.norm(h'), position P+1) through the same block."""
    c = case("llama")
    rows = {k: torch.from_numpy(v)[:1] for k, v in calls(256, 64, [0.0, 0.0])[0].items()}
    args = [rows[n] for n in (io.MTP_TOKENS, io.MTP_HIDDEN, io.MTP_POSITIONS, io.MTP_LAST_ROW, io.TEMPERATURE,
                              io.NOISE)]
    chained, manual = c.torch_model(feedback), c.torch_model(feedback)
    chained.setup_caches(1, S)
    manual.setup_caches(1, S)
    draft = chained(*args)
    with torch.no_grad():
        h = manual.step(args[0], args[1], args[2])[:, 3]  # last_row = 3 at position 3
        fed = manual.shared_head.norm(h) if feedback == "post" else h
        h2 = manual.step(draft.tokens[:, :1], fed.unsqueeze(1), torch.tensor([[4]]))[:, 0]
        logits2 = manual.shared_head.head(manual.shared_head.norm(h2))
    torch.testing.assert_close(draft.logits[:, 1], logits2, atol=1e-5, rtol=0)
    other = c.torch_model("pre" if feedback == "post" else "post")
    other.setup_caches(1, S)
    assert not torch.allclose(other(*args).logits[:, 1], draft.logits[:, 1], atol=1e-3)


def test_sampling_rule():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.1, 0.2, 0.7], [0.5, 0.3, 0.2]]))
    tokens, probs = sample_draft(logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.25, 0.9999999, 0.99]))
    assert tokens.tolist() == [1, 2, 0]  # cdf [.1,.3,1]: #(cdf <= .25) = 1; u near 1 -> last; T=0 -> argmax
    torch.testing.assert_close(probs[0], torch.tensor([0.1, 0.2, 0.7]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sampling_emitter_equals_torch_rule(dtype, tmp_path):
    """The one ONNX emitter both draft graphs use equals the one torch rule, over [B,V] (a chained step) and
    [B,K,V] (DFlash's whole block), with ties (first argmax) and noise at both ends."""
    rng = np.random.default_rng(0)
    V = 50
    logits = rng.standard_normal((3, 4, V)).astype(dtype)
    logits[0, 0, [7, 9]] = logits[0, 0].max() + 1  # a tie: greedy takes the first
    temperature = np.array([0.0, 0.6, 1.7], np.float32)
    noise = rng.random((3, 4)).astype(np.float32)
    noise[1, 0], noise[2, 1] = 0.0, np.nextafter(np.float32(1), np.float32(0))
    g = GraphBuilder(WeightStore(tmp_path / io.WEIGHTS_FILE))
    for name, shape in (("logits", ("B", "K", V)), ("temperature", ("B", 1, 1)), ("noise", ("B", "K", 1))):
        g.input(name, dtype if name == "logits" else "float32", shape)
    token, probs = emit_sample_draft(g, "logits", "temperature", "noise", V, dtype)
    g.output(token, "token", "int64", ("B", "K"))
    g.output(probs, "probs", "float32", ("B", "K", V))
    g.store.close()
    onnx.save(g.model("sample"), tmp_path / "sample.onnx")
    got_token, got_probs = session(tmp_path / "sample.onnx").run(
        ["token", "probs"], {"logits": logits, "temperature": temperature[:, None, None], "noise": noise[..., None]})
    want_token, want_probs = sample_draft(torch.from_numpy(logits), torch.from_numpy(temperature)[:, None].expand(3, 4),
                                          torch.from_numpy(noise))
    np.testing.assert_array_equal(got_token, want_token.numpy())
    np.testing.assert_allclose(got_probs, want_probs.numpy(), atol=1e-6, rtol=0)
    assert got_token[0, 0] == 7 and got_token[1, 0] == 0 and got_probs.dtype == np.float32


# -- checkpoints ---------------------------------------------------------------------------------------


def _inside_target(c: Case, out: Path) -> Path:
    """The DeepSeek form: a copy of the target dir whose safetensors also hold layer N."""
    shutil.copytree(c.target_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors.update(load_file(c.mtp_dir / "model.safetensors"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    return out


@pytest.mark.parametrize("own_head", [False, True])
def test_both_checkpoint_forms_load_the_same(case, own_head, tmp_path):
    c = case("qwen2", own_head=own_head)
    inside = _inside_target(c, tmp_path / "target_with_mtp")
    a, b = c.loaded, load_mtp(inside, c.target.config)
    assert a.config == b.config and a.config.layer_index == c.target.config.num_layers == 2
    assert (a.config.has_own_head, a.config.has_own_embed) == (own_head, False)
    assert sorted(a.weights) == sorted(b.weights) and "eh_proj.weight" in a.weights
    assert all(np.array_equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert load_hf_dir(inside).config == c.target.config  # the target still loads, layer N ignored
    assert json.loads((c.mtp_dir / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLMMTP"]


def test_equal_copies_are_stored_once(case):
    c = case("llama")  # tied target: its head is the embedding
    w = dict(c.loaded.weights, **{"embed_tokens.weight": c.target.weights["model.embed_tokens.weight"],
                                  "shared_head.head.weight": c.target.weights["model.embed_tokens.weight"]})
    cfg = dataclasses.replace(c.loaded.config, has_own_head=True, has_own_embed=True)
    names = set(mtp_weights(cfg, w, c.target.weights))
    assert "model.embed_tokens.weight" in names and not {n for n in names if "embed" in n or "head.head" in n} - {
        "model.embed_tokens.weight"}
    assert "mtp.self_attn.qkv_proj.weight" in names and "mtp.mlp.gate_up_proj.weight" in names
    own = case("qwen3", own_head=True)
    assert "mtp.shared_head.head.weight" in mtp_weights(own.loaded.config, own.loaded.weights, own.target.weights)


def _broken(c: Case, out: Path, edit) -> Path:
    weights = dict(c.loaded.weights)
    edit(weights)
    return save_mtp_checkpoint(out, json.loads((c.target_dir / "config.json").read_text()), weights)


def test_checkpoint_errors(case, tmp_path):
    c = case("llama")
    t = c.target.config
    with pytest.raises(SpecrtError, match="MTP checkpoint not found"):
        load_mtp(tmp_path / "nope", t)
    with pytest.raises(SpecrtError, match=r"no MTP tensors found \(expected model\.layers\.2\.enorm"):
        load_mtp(c.target_dir, t)
    with pytest.raises(SpecrtError, match=r"missing MTP tensor hnorm\.weight \(expected shape \[64\]\)"):
        load_mtp(_broken(c, tmp_path / "a", lambda w: w.pop("hnorm.weight")), t)
    bad = _broken(c, tmp_path / "b", lambda w: w.update({"eh_proj.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(SpecrtError, match=r"eh_proj\.weight has shape \[64, 64\], expected \[64, 128\]"):
        load_mtp(bad, t)
    with pytest.raises(SpecrtError, match="MTP hidden_size 64 does not match the target's hidden_size 32"):
        load_mtp(c.mtp_dir, dataclasses.replace(t, hidden_size=32))
    with pytest.raises(SpecrtError, match="MTP vocab_size 256 does not match the target's vocab_size 300"):
        load_mtp(c.mtp_dir, dataclasses.replace(t, vocab_size=300))
    no_cfg = _broken(c, tmp_path / "c", lambda w: None)
    (no_cfg / "config.json").unlink()  # without a config, the tensors themselves tell
    with pytest.raises(SpecrtError, match="MTP hidden size 64 does not match the target's hidden size 32"):
        load_mtp(no_cfg, dataclasses.replace(t, hidden_size=32))
    with pytest.raises(SpecrtError, match="does not match the target family 'qwen3'"):
        load_mtp(c.mtp_dir, dataclasses.replace(t, family="qwen3", qk_norm=True))


# -- graph contract -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graph_contract(case, dtype, tmp_path):
    c = case("qwen3")
    path = build_graph(c, tmp_path, dtype=dtype)
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    t = c.target.config
    want_in, want_out = io.mtp_signature(num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, hidden_size=t.hidden_size,
                                         vocab_size=t.vocab_size, steps=G, max_seq=S, dtype=dtype)
    assert {a for spec in (*want_in, *want_out) for a in spec.axes} == {"B", "C"}

    def declared(values) -> list[tuple]:
        return [(v.name, onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                 tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)) for v in values]

    assert declared(model.graph.input) == [(s.name, s.dtype, s.shape) for s in want_in]
    assert declared(model.graph.output) == [(s.name, s.dtype, s.shape) for s in want_out]
    names = [n.name for n in model.graph.node]
    assert all(n.startswith("/mtp/") for n in names) and len(set(names)) == len(names)
    assert {n.op_type for n in model.graph.node} <= TRT_OPS and {n.domain for n in model.graph.node} <= {""}
    constants = {i.name for i in model.graph.initializer}
    for n in model.graph.node:
        for op, index in TRT_CONSTANT_INPUTS:
            if n.op_type == op and len(n.input) > index and n.input[index]:
                assert n.input[index] in constants, f"{n.name} input {index} is not an initializer"
    assert "model.embed_tokens.weight" in constants and "mtp.embed_tokens.weight" not in constants
    if dtype == "float16":  # runs, and its first draft step tracks the fp32 graph
        feeds = calls(t.vocab_size, t.hidden_size, [0.0, 0.0])[0]
        past = {n: np.zeros((B, t.num_kv_heads, S, t.head_dim), np.float32) for n in io.past_names(0)}
        want = session(build_graph(c, tmp_path / "fp32")).run([io.DRAFT_LOGITS], {**feeds, **past})[0]
        half = {k: v.astype(np.float16) if v.dtype == np.float32 and k != io.TEMPERATURE and k != io.NOISE else v
                for k, v in {**feeds, **past}.items()}
        got = session(path).run([io.DRAFT_LOGITS], half)[0]
        np.testing.assert_allclose(got[:, 0].astype(np.float32), want[:, 0], atol=5e-3, rtol=0)
