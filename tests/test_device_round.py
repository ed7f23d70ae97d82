"""Device-resident rounds (runtime/device_round.py) on the torch backend, here on the CPU: round-for-round identical
to ONNX Runtime's host loop where the host's choices are deterministic (fixed and threshold lengths, across
admissions, mixed greedy/sampled batches with seeded draws, and budgets); AR's tokens under every scheduler and both
hybrids, whose cost-aware choices the host loop makes on online timings; one synchronisation per round; static
state never reallocated."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint
from specrt.runtime.costs import CostTable
from specrt.runtime.engine import Engine, Request
from specrt.runtime import hybrid
from specrt.runtime.hybrid import HEAD, LOOKUP
from specrt.runtime.profile import Profile
from specrt.runtime.sampling import SamplingParams

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def art(tiny_model_dir, tmp_path_factory):
    """A tiny Llama with a DSpark head (confidence head) and an MTP head, 4 slots."""
    root = tmp_path_factory.mktemp("device_round")
    target = tiny_model_dir("llama", num_layers=2)
    draft = random_dspark_checkpoint(root / "draft", target, layers=1, block_size=4, markov_rank=16, confidence=True)
    mtp = random_mtp_checkpoint(root / "mtp", target)
    settings = ExportSettings(batch=4, max_seq=96, prefill_chunk=8, verify_len=4)
    return export_artifact(target, root / "art", settings, draft=draft, mtp=mtp, progress=False)


@pytest.fixture(scope="module")
def fixture_art(tmp_path_factory):
    """DeepSpec's own tiny checkpoint (Qwen3 target, DSpark draft)."""
    settings = ExportSettings(batch=2, max_seq=64, prefill_chunk=8, verify_len=5)
    return export_artifact(FIXTURE / "target", tmp_path_factory.mktemp("device_fixture") / "art", settings,
                           draft=FIXTURE / "draft", progress=False)


def _requests(vocab: int, n: int, seed: int = 0, **params) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        # repeated pieces so n-gram lookups find matches
        piece = rng.integers(3, vocab, int(rng.integers(2, 6))).tolist()
        prompt = (piece * 4 + rng.integers(3, vocab, int(rng.integers(1, 9))).tolist())[:int(rng.integers(5, 30))]
        p = SamplingParams(max_new_tokens=int(rng.integers(5, 24)), ignore_eos=True, **params)
        out.append(Request(prompt, p, id=i))
    return out


class Records(list):
    """An observer that keeps every round's record."""

    def on_round(self, record) -> None:
        self.append(record)

    def close(self) -> None:
        pass


def _generate(art, requests, **kw) -> tuple[list[list[int]], Engine]:
    with Engine(art, threads=1, **kw) as engine:
        outs, _ = engine.generate(requests)
    return [o.output_ids for o in outs], engine


@pytest.mark.parametrize("method,scheduler", [("ar", "fixed"), ("ngram", "fixed"), ("dspark", "fixed"),
                                              ("dspark", "threshold"), ("mtp", "fixed"), ("mtp", "threshold"),
                                              ("ngram", "threshold")])
def test_device_rounds_match_the_host_loop(art, method, scheduler):
    """7 requests through 4 slots (admissions between rounds): the torch backend's device rounds give ONNX Runtime's
    host-loop tokens, which are AR's; one synchronisation per round."""
    requests = _requests(256, 7)
    ref, _ = _generate(art, requests, method="ar", backend="ort")
    kw = dict(method=method, scheduler=scheduler, threshold=0.1)
    host_records, dev_records = Records(), Records()
    host, _ = _generate(art, requests, backend="ort", observers=[host_records], **kw)
    dev, engine = _generate(art, requests, backend="torch", observers=[dev_records], **kw)
    assert engine.device_rounds is not None, engine.device_note
    assert host == ref
    assert dev == ref
    assert engine.device_rounds.syncs == engine.stats.steps > 0  # every step was a device round, one sync each
    # the same rounds: every slot's drafts (so the head saw the same context rows), lengths and acceptance
    assert len(dev_records) == len(host_records) == len(engine.stats.rounds)
    for d, h in zip(dev_records, host_records):
        assert (d.request, d.position, d.draft_tokens, d.verify_len, d.accepted, d.committed) == \
               (h.request, h.position, h.draft_tokens, h.verify_len, h.accepted, h.committed)
        if h.confidence_logits is not None:
            np.testing.assert_allclose(d.confidence_logits, h.confidence_logits, atol=1e-4)
    if method == "ngram":
        assert sum(r.accepted for r in dev_records) > 0  # lookups in the repeated prompts hit
    if scheduler == "threshold":  # the survivals (confidence, or acceptance so far) cut some rounds short
        assert any(r.verify_len < engine.gamma for r in dev_records)


def test_fixture_dspark_on_the_device(fixture_art):
    requests = _requests(512, 3, seed=4)
    ref, _ = _generate(fixture_art, requests, method="ar", backend="ort")
    dev, engine = _generate(fixture_art, requests, method="dspark", backend="torch")
    assert engine.device_rounds is not None and dev == ref


@pytest.mark.parametrize("method,scheduler", [("dspark", "fixed"), ("ngram", "fixed"), ("ar", "fixed"),
                                              ("dspark+ngram", "sps"), ("mtp", "sps-async")])
def test_mixed_batches_stay_on_the_device(art, method, scheduler, monkeypatch):
    """Greedy and sampled requests in one batch: every round runs on the device (one synchronisation each). Greedy
    requests keep AR's tokens; sampled ones draw exactly the host loop's tokens with the same seeds (the same
    acceptance rule, uniforms drawn from each request's rng in the same order; the cost table held at the profile
    on the host, as above)."""
    for name in ("observe_verify", "observe_draft"):
        monkeypatch.setattr(CostTable, name, lambda *a, **k: None)
    greedy = _requests(256, 4, seed=1)
    sampled = [replace(r, id=10 + r.id, params=replace(r.params, temperature=0.8, seed=7, max_new_tokens=6,
                                                       top_k=20 * (r.id % 2), top_p=0.9 if r.id else 1.0))
               for r in _requests(256, 3, seed=2)]
    mixed = [greedy[0], sampled[0], greedy[1], sampled[1], greedy[2], sampled[2], greedy[3]]
    ref, _ = _generate(art, greedy, method="ar", backend="ort")
    kw = dict(method=method, scheduler=scheduler)
    # both gate a head alone under sps / sps-async (EngineConfig.gate_head) on the same held table
    host, _ = _generate(art, mixed, backend="ort", profile=replace(_profile(2.0), backend="ort"), **kw)
    dev, engine = _generate(art, mixed, backend="torch", profile=_profile(2.0), **kw)
    assert [dev[i] for i in (0, 2, 4, 6)] == ref
    assert dev == host  # the sampled requests too: same draws, same rng streams
    assert engine.device_rounds.syncs == engine.stats.steps > 0  # every step was a device round


def test_state_is_allocated_once(art):
    """Across rounds of one bucket the device state, the result buffers and the runners' static inputs stay put."""
    with Engine(art, method="dspark", backend="torch", threads=1, slots=4) as engine:
        rounds = engine.device_rounds
        ptrs = lambda: [t.data_ptr() for t in (rounds.length, rounds.anchor, rounds.budget, rounds.ctx_features,
                                               *rounds._out.values(), *rounds._host.values())]
        for r in _requests(256, 4, seed=3):
            engine.add_request(r.prompt_ids, r.params)
        engine.step()
        before, feeds = ptrs(), {id(c): [t.data_ptr() for t in c.feeds.values()]
                                 for c in engine.target._calls.values()}
        while engine.has_unfinished():
            engine.step()
        assert ptrs() == before
        assert all([t.data_ptr() for t in c.feeds.values()] == feeds[id(c)]
                   for c in engine.target._calls.values() if id(c) in feeds)


def _profile(draft_ms: float) -> Profile:
    """The torch backend's cost table for the tests: a verify curve with a knee (each token past the anchors costs
    more), so Algorithm 1 admits confident drafts and refuses doubtful ones."""
    verify = {b: {p: 10.0 + 1.0 * max(0, p - b) for p in range(b, 8 * b + 1)} for b in (1, 2, 4)}
    return Profile(backend="torch", threads=1, position=16, machine="test", created="", verify=verify,
                   draft={"dspark": {1: draft_ms}, "mtp": {1: draft_ms}})


def test_a_gated_head_not_called_is_a_decoding_step_on_the_device(art):
    """Under sps a head alone is gated on the device too (EngineConfig.gate_head): on a table where its draft call
    costs 1e6 ms it is called only to explore, and a round without drafts runs the target's decoding step (its decode
    bucket, one token per slot), not a verify grid; the output is AR's."""
    requests = [replace(r, params=replace(r.params, max_new_tokens=50)) for r in _requests(256, 3, seed=6)]
    ref, _ = _generate(art, requests, method="ar", backend="ort")
    dev, engine = _generate(art, requests, method="dspark", scheduler="sps", backend="torch", profile=_profile(1e6))
    assert dev == ref
    gate = engine.drafter
    assert 0 < gate.rounds[HEAD] < gate.rounds[LOOKUP], gate.rounds  # explorations only
    drafting = {key[-1] for key in engine.device_rounds._rounds}  # (bucket, sampled, filters, head, drafting)
    assert drafting == {True, False}
    decode = engine.target.spec.bucket("decode", B=engine.device_rounds.slots)
    assert any(dict(key[1:]) == dict(decode) for key in engine.target._calls)  # (slot, *bucket items)


@pytest.mark.parametrize("method,scheduler", [("dspark", "sps"), ("dspark", "sps-async"), ("mtp", "sps"),
                                              ("ngram", "sps-async"), ("dspark+ngram", "sps"),
                                              ("mtp+ngram", "fixed"), ("dspark+ngram", "threshold")])
def test_every_scheduler_and_hybrid_on_the_device(art, method, scheduler, monkeypatch):
    """The cost-aware schedulers and the hybrids run on the device too (the host plans what only it knows and sends
    it down in the round's one copy): AR's tokens, one synchronisation per round, lengths the schedule cut; a hybrid
    runs rounds with and without its head, its skipped head catching up on the device. With the host loop's cost
    table held at the profile (it is refined from this machine's timings and explores, which makes its choices
    differ run to run; the device path reads the table as it stands), the rounds equal the host loop's: the same choices, drafts (so the head saw the same context rows,
    backlogs included), lengths and acceptance."""
    for name in ("observe_verify", "observe_draft"):  # the host loop's table stays the profile; it never explores
        monkeypatch.setattr(CostTable, name, lambda *a, **k: None)
    # a gated head's explorations wait at most as long on the host as the device's backlog buffer allows
    monkeypatch.setattr(hybrid, "EXPLORE_MAX", hybrid.EXPLORE)
    # and draft for every slot, as the device's do (on the host an exploration drafts for one slot: `_held`)
    monkeypatch.setattr(hybrid.HybridDrafter, "_held", lambda self, slots: np.zeros(len(slots), bool))
    requests = [replace(r, params=replace(r.params, max_new_tokens=40)) for r in _requests(256, 6, seed=5)]
    ref, _ = _generate(art, requests, method="ar", backend="ort")
    records, host_records = Records(), Records()
    kw = dict(method=method, scheduler=scheduler, threshold=0.2)
    host, _ = _generate(art, requests, backend="ort", profile=replace(_profile(2.0), backend="ort"),
                        observers=[host_records], **kw)
    dev, engine = _generate(art, requests, backend="torch", profile=_profile(2.0), observers=[records], **kw)
    rounds = engine.device_rounds
    assert dev == host == ref
    assert rounds.syncs == engine.stats.steps > 0
    assert [(r.request, r.position, r.draft_tokens, r.verify_len, r.accepted) for r in records] == \
           [(r.request, r.position, r.draft_tokens, r.verify_len, r.accepted) for r in host_records]
    lengths = [r.verify_len for r in records]
    assert any(0 < ell for ell in lengths)
    if scheduler != "fixed" or "+" in method:  # the schedule (or the lookups' counts) cut some rounds short
        assert any(ell < engine.gamma for ell in lengths)
    if "+" in method:
        assert engine.drafter.rounds[LOOKUP] > 0 and engine.drafter.rounds[HEAD] > 0, engine.drafter.rounds
        assert rounds.caught_up > 0  # some backlog outgrew one propose call and went through the prefill bucket


def test_other_backends_run_the_host_loop(art):
    with Engine(art, method="dspark+ngram", scheduler="sps", backend="ort", threads=1, profile=_profile(2.0)) as e:
        assert e.device_rounds is None and "host loop" in e.device_note


def test_bfloat16_modules(art):
    """--dtype bfloat16: the modules run in bf16 (outputs keep the graph's dtypes), close to fp32."""
    from specrt.artifact import load_manifest
    from specrt.runtime.backends import infer, load_runner
    from specrt.tools.compare import random_feeds

    m = load_manifest(art)
    runners = {d: load_runner("torch", art, m, "target", threads=1, dtype=d) for d in ("float32", "bfloat16")}
    for r in runners.values():
        r.allocate(4)
    assert runners["bfloat16"]._family.model.lm_head.weight.dtype == torch.bfloat16
    bucket = m.graphs["target"].bucket("verify", B=2, T=4, P=8)
    feeds, _ = random_feeds(m, "target", bucket, 1, np.random.default_rng(0), np.array([0, 3]))
    out = {d: infer(r, 0, feeds)["logits"].copy() for d, r in runners.items()}
    assert out["bfloat16"].dtype == np.float32
    assert np.abs(out["bfloat16"] - out["float32"]).max() < 0.1 * np.abs(out["float32"]).max()


def test_device_flags_on_the_cli(art):
    from click.testing import CliRunner

    from specrt.cli import main

    r = CliRunner().invoke(main, ["run", str(art), "--input-ids", "5,6,7,5,6", "--method", "dspark", "--backend",
                                  "torch", "--dtype", "bfloat16", "--max-new-tokens", "6", "--json"])
    assert r.exit_code == 0, r.output
    assert len(__import__("json").loads(r.output)["requests"][0]["output_ids"]) == 6
    r = CliRunner().invoke(main, ["run", str(art), "--input-ids", "5,6", "--dtype", "bfloat16"])
    assert r.exit_code == 1 and "torch backend" in r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, ["run", str(art), "--input-ids", "5,6", "--backend", "torch", "--device", "cuda"])
        assert r.exit_code == 1 and "no CUDA GPU" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["run", str(art), "--input-ids", "5,6", "--backend", "torch", "--device", "tpu"])
    assert r.exit_code == 1 and "unknown device" in r.output
