"""Distillation: loss pieces, the teacher-forced DSpark path against the eval path, training, resume, export, STS."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.distill import losses, train_dspark as td
from specrt.distill.cache import CacheWriter, TargetCache
from specrt.distill.calibrate import ECE_TIE, calibrate_dspark, ece, sts_temperatures
from specrt.distill.train_mtp import train_mtp
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders import expected_shapes, load_target
from specrt.model_config import DSparkConfig
from specrt.exporter.loaders.deepspec import load_dspark
from specrt.exporter.loaders.mtp import load_mtp
from specrt.models.dspark import DSparkDraft
from specrt.models.llama import Transformer
from specrt.models.mtp import MTP
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams

# untied, with a sharp random head: greedy continuations fall into short cycles ("35 0 40 35 0 40 ...")
TARGET = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=256,
                     bos_token_id=1, eos_token_ids=(2,))
LAYER_IDS, PROMPT, RESPONSE, SAMPLES = (0, 1), 8, 24, 64
DSPARK = dict(block=4, markov_rank=8, batch_anchors=32, batch_seqs=4, lr=3e-3, head_dtype="float32", progress=False)
SETTINGS = io.ExportSettings(batch=1, max_seq=64, prefill_chunk=8, verify_len=4)


# -- a tiny target and its cache ---------------------------------------------------------------------------------


def write_target(out: Path, cfg: ModelConfig = TARGET, seed: int = 0, head_scale: float = 6.0) -> Path:
    """A random HF-layout target directory; the lm_head is scaled so that its distributions are sharp."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = np.ones(shape, np.float32)
        elif name == "model.embed_tokens.weight":
            weights[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            scale = head_scale if name == "lm_head.weight" else 1.0
            weights[name] = (scale * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_hf()))
    return out


def write_cache(path: Path, weights: dict[str, np.ndarray], cfg: ModelConfig, seed: int = 0) -> TargetCache:
    """Random prompts + the target's greedy continuation; features = layer outputs LAYER_IDS, then the final hidden."""
    model, rng, total = Transformer.from_weights(cfg, weights), np.random.default_rng(seed), PROMPT + RESPONSE
    writer = CacheWriter(path, (len(LAYER_IDS) + 1) * cfg.hidden_size)
    with torch.no_grad():
        for _ in range(SAMPLES):
            ids = [int(t) for t in rng.integers(3, cfg.vocab_size, PROMPT)]
            model.setup_caches(1, total)
            x, pos = torch.tensor([ids]), 0
            while len(ids) < total:
                logits, _, _ = model(x, torch.arange(pos, pos + x.shape[1])[None], torch.tensor([pos]))
                pos += x.shape[1]
                ids.append(int(logits[0, -1].argmax()))
                x = torch.tensor([[ids[-1]]])
            model.setup_caches(1, total)
            _, final, layers = model(torch.tensor([ids]), torch.arange(total)[None], torch.tensor([0]),
                                     capture_layers=LAYER_IDS)
            writer.add(np.array(ids), PROMPT, torch.cat([*layers, final], -1)[0].numpy())
    idx = list(range(SAMPLES))
    splits = {"train": idx[:-12], "val": idx[-12:-6], "calib": idx[-6:]}
    return TargetCache(writer.finish({"hidden_size": cfg.hidden_size, "feature_sources": [*LAYER_IDS, "final"],
                                      "splits": splits, "target": cfg.to_dict()}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target_dir = write_target(root / "target")
    target = load_target(target_dir)
    return target_dir, target, write_cache(root / "cache", target.weights, target.config)


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A DSpark head trained for 300 steps on the tiny cache."""
    _, target, cache = tiny
    out = tmp_path_factory.mktemp("head") / "dspark"
    return td.train_dspark(cache, target.weights, target.config, out, steps=300, **DSPARK)


def make_draft(target, kind: str = "vanilla", layers: int = 2) -> DSparkDraft:
    hf = td.dspark_hf_config(target.config, layers=layers, block=4, target_layer_ids=list(LAYER_IDS),
                             mask_token_id=63, markov_rank=8, head_type=kind, confidence=True, num_anchors=8)
    torch.manual_seed(0)
    model = DSparkDraft(DSparkConfig.from_hf(hf))
    model.embed_tokens.weight = td.frozen_param(target.weights["model.embed_tokens.weight"])
    model.lm_head.weight = td.frozen_param(target.weights["lm_head.weight"])
    return model


def tiny_batch(cache: TargetCache, samples=(0, 5), anchors: int = 6) -> td.DSparkBatch:
    return td.make_batch(cache, list(samples), anchors, 4, np.random.default_rng(0),
                         cache.feature_slice(list(LAYER_IDS)), cache.feature_slice(["final"]))


# -- loss pieces ---------------------------------------------------------------------------------------------------


def test_anchors_masks_weights():
    loss_mask = np.array([0, 0, 1, 1, 1, 1, 0, 1, 1], np.uint8)
    assert losses.anchor_candidates(loss_mask).tolist() == [2, 3, 4, 7]
    anchors, keep = losses.sample_anchors(loss_mask, 6, np.random.default_rng(0))
    assert sorted(anchors[keep].tolist()) == [2, 3, 4, 7] and anchors[keep].tolist() == sorted(anchors[keep].tolist())
    assert keep.tolist() == [True] * 4 + [False] * 2 and anchors[~keep].tolist() == [0, 0]
    valid = losses.block_eval_mask(np.array([2, 7, 0]), np.array([True, True, False]), loss_mask, block=4)
    # anchor 2: labels 3,4,5 are loss tokens, 6 is not -> prefix of 3; anchor 7: label 8 exists, 9 does not
    assert valid.tolist() == [[True, True, True, False], [True, False, False, False], [False] * 4]
    weights = torch.tensor([1.0, np.exp(-0.25), np.exp(-0.5)], dtype=torch.float32)
    assert torch.allclose(losses.position_weights(3), weights)
    assert losses.acceptance_target(torch.tensor([0.0, 1.0, 2.5])).tolist() == [1.0, 0.5, 0.0]
    assert losses.warmup_cosine(0, 100, 0.04) == 0.25 and losses.warmup_cosine(3, 100, 0.04) == 1.0
    assert losses.warmup_cosine(100, 100, 0.04) == 0.0


def test_fused_losses_match_autograd():
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 40, dtype=torch.float64)).requires_grad_()
    labels, p_t = torch.randint(0, 40, (5,)), torch.softmax(3 * torch.randn(5, 40, dtype=torch.float64), -1)
    w1, w2 = torch.rand(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64)
    ce, l1 = losses.SoftCE_L1.apply(logits, labels, p_t)
    (g_fused,) = torch.autograd.grad((w1 * ce + w2 * l1).sum(), logits)
    logp = torch.log_softmax(logits, -1)
    ce_ref, l1_ref = -logp.gather(-1, labels[:, None])[:, 0], losses.l1_distance(logp, p_t)
    (g_ref,) = torch.autograd.grad((w1 * ce_ref + w2 * l1_ref).sum(), logits)
    assert torch.allclose(ce, ce_ref) and torch.allclose(l1, l1_ref) and torch.allclose(g_fused, g_ref)

    ce, kl, l1 = losses.SoftCE_KL.apply(logits, labels, p_t.log())
    (g_fused,) = torch.autograd.grad((w1 * ce + w2 * kl).sum(), logits)
    logp = torch.log_softmax(logits, -1)
    ce_ref, kl_ref = -logp.gather(-1, labels[:, None])[:, 0], (p_t * (p_t.log() - logp)).sum(-1)
    (g_ref,) = torch.autograd.grad((w1 * ce_ref + w2 * kl_ref).sum(), logits)
    assert torch.allclose(kl, kl_ref) and torch.allclose(l1, l1_ref) and torch.allclose(g_fused, g_ref)


def test_tau_probabilistic():
    acc = torch.tensor([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0]])
    valid = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert losses.tau_probabilistic(acc, valid).tolist() == [1 + 0.5 + 0.25 + 0.25, 2.0]


# -- the teacher-forced path is the eval path -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_train_forward_matches_eval_path(tiny, kind):
    """Dense-mask training forward of many anchors = the incremental eval forward run per anchor (§1.5)."""
    _, target, cache = tiny
    model, batch = make_draft(target, kind), tiny_batch(cache)
    anchor_ids = batch.ids.gather(1, batch.anchors)
    hidden: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda mod, inp, out: hidden.append(out))
    model.setup_caches(1, 64)
    mk = model.markov_head
    with torch.no_grad():
        h = model.forward_train(batch.ctx, batch.anchors, anchor_ids)
        hidden.clear()
        for b, s in enumerate((0, 5)):
            feats = torch.from_numpy(np.asarray(cache[s].features[:, :64], np.float32))
            for j, p in enumerate(batch.anchors[b].tolist()):
                out = model(feats[None, :p], torch.arange(p)[None], torch.tensor([0]), torch.tensor([p]),
                            anchor_ids[b, j:j + 1])
                torch.testing.assert_close(hidden[-1][0], h[b, j], atol=2e-5, rtol=1e-4)
                prev_emb = mk.markov_w1(torch.cat([anchor_ids[b, j:j + 1], out.tokens[0, :-1]]))
                logits = model.lm_head(h[b, j]) + mk.markov_w2(mk.features(prev_emb, h[b, j]))
                torch.testing.assert_close(logits, out.logits[0], atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(model.confidence_logits(h[b, j], prev_emb), out.confidence_logits[0],
                                           atol=2e-5, rtol=1e-4)
    hook.remove()


def test_dspark_loss_matches_direct_recomputation(tiny):
    """block_loss = 0.1·CE + 0.9·L1 + BCE(conf, acc*) weighted by exp(-k/4), recomputed anchor by anchor."""
    _, target, cache = tiny
    model, batch = make_draft(target, layers=1), tiny_batch(cache, samples=(0, 5, 9), anchors=20)
    head = td.FrozenHead(model.lm_head.weight, torch.float32)
    with torch.no_grad():
        parts, _ = td.block_loss(model, head, batch)
    model.setup_caches(1, 64)
    mk, lm_head, sums = model.markov_head, model.lm_head.weight, np.zeros(4)
    with torch.no_grad():
        for b, s in enumerate((0, 5, 9)):
            sample = cache[s]
            feats = torch.from_numpy(np.asarray(sample.features, np.float32))
            ids = torch.from_numpy(sample.ids.astype(np.int64))
            hidden = []
            hook = model.norm.register_forward_hook(lambda mod, inp, out: hidden.append(out[0]))
            for j, p in enumerate(batch.anchors[b].tolist()):
                model(feats[None, :p, :64], torch.arange(p)[None], torch.tensor([0]), torch.tensor([p]), ids[p:p + 1])
                for k in range(4):
                    if not batch.valid[b, j, k]:
                        continue
                    prev = mk.markov_w1(ids[p + k])  # teacher forcing: prev_k = x_{p+k}
                    logp = torch.log_softmax(hidden[-1][k] @ lm_head.T + mk.markov_w2(prev), -1)
                    p_t = torch.softmax(feats[p + k, 64:] @ lm_head.T, -1)
                    acc = (1 - 0.5 * (logp.exp() - p_t).abs().sum()).clamp(0, 1)
                    c = model.confidence_head.proj(torch.cat([hidden[-1][k], prev]))[0]
                    bce = -(acc * torch.log(torch.sigmoid(c)) + (1 - acc) * torch.log(1 - torch.sigmoid(c)))
                    w = np.exp(-k / 4)
                    sums += w * np.array([-logp[ids[p + k + 1]].item(), (logp.exp() - p_t).abs().sum().item(),
                                          bce.item(), 1.0])
            hook.remove()
    ce, l1, conf = sums[:3] / sums[3]
    assert parts.ce.item() == pytest.approx(ce, rel=1e-5) and parts.dist.item() == pytest.approx(l1, rel=1e-5)
    assert parts.conf.item() == pytest.approx(conf, rel=1e-5)
    assert parts.total.item() == pytest.approx(0.1 * ce + 0.9 * l1 + conf, rel=1e-5)


def test_greedy_objective_trains_on_the_targets_argmax(tiny):
    """objective="greedy": CE against argmax p_t (not the response's token), L1 at 0.5, and the confidence head's
    target is whether the draft's argmax is the target's; evaluation counts the same matches."""
    _, target, cache = tiny
    model, batch = make_draft(target, layers=1), tiny_batch(cache, samples=(0, 5, 9), anchors=20)
    head = td.FrozenHead(model.lm_head.weight, torch.float32)
    # responses whose tokens are not the target's argmax, as sampled responses are: the labels must not be used
    batch = td.DSparkBatch(*(batch.labels.roll(1, -1) if f == "labels" else getattr(batch, f)
                             for f in td.DSparkBatch.__dataclass_fields__))
    with torch.no_grad():
        parts, _ = td.block_loss(model, head, batch, "greedy")
        r = td.block_rows(model, head, batch)
    best = r.p_target.argmax(-1)
    assert (best != r.labels).any()
    logp = torch.log_softmax(r.logits.float(), -1)
    ce = -logp.gather(-1, best[:, None])[:, 0]
    l1 = (logp.exp() - r.p_target).abs().sum(-1)
    match = (r.logits.argmax(-1) == best).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(r.conf.float(), match, reduction="none")
    w = r.weights / r.weights.sum()
    assert torch.equal(parts.acc, match)
    assert parts.ce.item() == pytest.approx((w * ce).sum().item(), rel=1e-5)
    assert parts.total.item() == pytest.approx((w * (ce + 0.5 * l1 + bce)).sum().item(), rel=1e-5)
    evals = td.evaluate_blocks(model, head, [batch], "greedy")
    slot_match = [match[r.slot == k].mean().item() for k in range(4)]
    assert evals["acc"] == pytest.approx(slot_match)
    with pytest.raises(ValueError, match="objective"):
        losses.dspark_loss(r.logits, r.labels, r.p_target, r.conf, r.weights, "argmax")


# -- training ----------------------------------------------------------------------------------------------------


def test_training_lowers_loss_and_raises_tau(trained):
    first, last = trained.evals[0], trained.evals[-1]
    assert last["loss"] < 0.6 * first["loss"]
    assert trained.tau_initial < 1.5 and trained.tau > trained.tau_initial + 1.0  # out of 1 + block = 5
    assert np.mean([h["loss"] for h in trained.history[-30:]]) < np.mean([h["loss"] for h in trained.history[:30]])
    log = json.loads((trained.out_dir / td.LOG_FILE).read_text())
    assert log["evals"][-1]["tau"] == pytest.approx(trained.tau) and len(log["history"]) == 300


def test_resume_matches_uninterrupted(tiny, tmp_path, monkeypatch):
    _, target, cache = tiny
    kw = dict(DSPARK, steps=40, save_every=10, eval_every=20)
    full = td.train_dspark(cache, target.weights, target.config, tmp_path / "full", **kw)

    def crash_at_25(step: int, total: int, warmup: float) -> float:
        if step == 25:
            raise KeyboardInterrupt
        return losses.warmup_cosine(step, total, warmup)

    with monkeypatch.context() as m:
        m.setattr(td, "warmup_cosine", crash_at_25)
        with pytest.raises(KeyboardInterrupt):
            td.train_dspark(cache, target.weights, target.config, tmp_path / "resumed", **kw)
    assert torch.load(tmp_path / "resumed" / td.STATE_FILE, weights_only=True)["step"] == 20
    resumed = td.train_dspark(cache, target.weights, target.config, tmp_path / "resumed", **kw)
    assert resumed.history == full.history and resumed.evals == full.evals
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(SpecrtError, match="lr"):
        td.train_dspark(cache, target.weights, target.config, tmp_path / "resumed", **dict(kw, lr=1e-3))


def test_trained_dspark_loads_exports_and_drafts(tiny, trained, tmp_path):
    target_dir, target, cache = tiny
    loaded = load_dspark(trained.out_dir, target.config)
    cfg = loaded.config
    assert cfg.architecture == "LlamaDSparkModel" and cfg.block_size == 4 and cfg.target_layer_ids == LAYER_IDS
    assert cfg.mask_token_id == trained.config["mask_token_id"] and cfg.markov_rank == 8
    unused = np.setdiff1d(np.arange(64), np.asarray(cache.tokens))  # the largest id the cache never uses
    assert cfg.mask_token_id == (unused[-1] if len(unused) else 63)
    np.testing.assert_array_equal(loaded.weights["lm_head.weight"], target.weights["lm_head.weight"])
    np.testing.assert_array_equal(loaded.weights["embed_tokens.weight"], target.weights["model.embed_tokens.weight"])
    art = export_artifact(target_dir, tmp_path / "art", SETTINGS, draft=trained.out_dir, progress=False)
    assert io.load_manifest(art).heads["dspark"].steps == 4
    # the runtime drafts with it: greedy τ about 1.7 on fresh prompts (a random head of this shape: about 1.1)
    rng = np.random.default_rng(1)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    requests = [Request(prompt_ids=[int(t) for t in rng.integers(3, 64, PROMPT)], params=params, id=i)
                for i in range(8)]
    _, stats = Engine(art, method="dspark", scheduler="fixed", threads=1).generate(requests)  # τ of every draft
    assert stats.to_dict()["tau"] > 1.4


# -- MTP ---------------------------------------------------------------------------------------------------------


def test_mtp_forward_train_matches_cached_step(tiny):
    _, target, _ = tiny
    from specrt.model_config import MTPConfig

    cfg = MTPConfig(layer=target.config, layer_index=3, has_own_head=False, has_own_embed=False)
    torch.manual_seed(0)
    model = MTP(cfg)
    tokens, hidden = torch.randint(0, 64, (2, 10)), torch.randn(2, 10, 32)
    positions = torch.arange(10).expand(2, -1)
    model.setup_caches(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_train(tokens, hidden, positions),
                                   model.step(tokens, hidden, positions), atol=1e-5, rtol=1e-4)


def test_mtp_trains_loads_and_exports(tiny, tmp_path):
    target_dir, target, cache = tiny
    result = train_mtp(cache, target.weights, target.config, tmp_path / "mtp", steps=200, batch_tokens=64, lr=3e-3,
                       head_dtype="float32", progress=False)
    assert result.evals[-1]["loss"] < 0.7 * result.evals[0]["loss"]
    assert result.tau > result.tau_initial + 0.5 and result.evals[-1]["acc"] > result.evals[0]["acc"]
    loaded = load_mtp(result.out_dir, target.config)
    assert not loaded.config.has_own_embed and not loaded.config.has_own_head  # aliases of the target's
    art = export_artifact(target_dir, tmp_path / "art", SETTINGS, mtp=result.out_dir, progress=False)
    assert "mtp" in io.load_manifest(art).heads


# -- STS -----------------------------------------------------------------------------------------------------------


def test_ece_definition():
    pred, label = np.array([0.05, 0.15, 0.95, 0.99]), np.array([0.0, 1.0, 1.0, 1.0])
    # bins [0,.05) empty, [.05,.1): |.05-0|, [.1,.15)... : |.15-1|, [.95,1]: |1.94-2|
    assert ece(pred, label)[0] == pytest.approx((0.05 + 0.85 + 0.06) / 4)


def test_sts_lowers_ece_of_an_overconfident_head():
    rng = np.random.default_rng(0)
    n, k = 20000, 5
    true_logit = rng.normal(1.0, 1.5, (n, k))
    accepted = rng.random((n, k)) < 1 / (1 + np.exp(-true_logit))
    valid = np.cumprod(rng.random((n, k)) < 0.95, axis=1).astype(bool)
    cal = sts_temperatures(3.0 * true_logit, accepted, valid)  # logits 3x too large: over-confident
    assert all(2.4 < t < 3.6 for t in cal.temperatures)
    assert all(a < 0.5 * b for a, b in zip(cal.ece_after, cal.ece_before))
    assert cal.counts == valid.sum(0).tolist()


def test_sts_keeps_temperature_one_where_no_temperature_calibrates_better():
    """Where prefix survivals are near 0 every temperature's ECE is tiny: the lowest used to sit at a grid end (0.05
    here, for an ECE 2e-5 lower); a temperature other than 1 is chosen only for a gain above ECE_TIE."""
    rng = np.random.default_rng(1)
    logit = rng.normal(-4.0, 1.0, (4000, 3))  # rarely accepted, and calibrated as it is
    accepted = rng.random(logit.shape) < 1 / (1 + np.exp(-logit))
    cal = sts_temperatures(logit, accepted, np.ones(logit.shape, bool))
    assert cal.temperatures == [1.0, 1.0, 1.0]
    assert all(a <= b + ECE_TIE for a, b in zip(cal.ece_after, cal.ece_before))
    valid = np.ones(logit.shape, bool)
    valid[:, 2] = False  # a position no block reaches: temperature 1, nothing counted
    cal = sts_temperatures(logit, accepted, valid)
    assert cal.temperatures[2] == 1.0 and cal.counts[2] == 0 and cal.ece_after[2] == 0.0


@pytest.mark.parametrize("acceptance", ["sampled", "greedy"])
def test_calibrate_trained_head(tiny, trained, acceptance):
    _, target, cache = tiny
    cal = calibrate_dspark(cache, trained.out_dir, target.config, acceptance=acceptance, anchors_per_seq=16)
    assert len(cal.temperatures) == 4 and cal.acceptance == acceptance and min(cal.counts) > 0
    assert sum(cal.ece_after) <= sum(cal.ece_before) + 1e-9


def test_calibrate_reads_at_most_max_seqs_spread_over_the_split(tiny, trained, monkeypatch):
    import specrt.distill.calibrate as calibrate
    _, target, cache = tiny
    read, make = [], calibrate.make_batch
    monkeypatch.setattr(calibrate, "make_batch", lambda c, samples, *a: read.extend(samples) or make(c, samples, *a))
    split = cache.manifest["splits"]["calib"]
    calibrate_dspark(cache, trained.out_dir, target.config, anchors_per_seq=16, max_seqs=3)
    assert len(read) == 3 and read[0] == split[0] and read[-1] == split[-1]  # not the split's first three
