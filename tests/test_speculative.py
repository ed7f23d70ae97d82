"""The speculative loop end to end: DeepSpec's own trace, greedy identity with AR, stops inside rounds,
and the exact target distribution under speculative sampling."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file
from scipy.stats import chisquare

from specrt.artifact import ExportSettings
from specrt.cli import main
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint, save_mtp_checkpoint
from specrt.runtime.engine import Engine, Request
from specrt.runtime.profile import Profile
from specrt.runtime.sampling import SamplingParams
from power import ALPHA, samples_for

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"


def copy_mtp(src: Path, dst: Path, target_dir: Path) -> Path:
    """An MTP head that predicts the target's own next token: eh_proj passes hnorm(h_t) through and
    the block adds nothing, so its logits are the target's logits at t up to a positive scale. On a
    target that repeats itself this head is often right: a 'good' draft without training."""
    w = {k.split(".", 3)[-1]: v for k, v in load_file(src / "model.safetensors").items()}
    d = w["enorm.weight"].shape[0]
    w["enorm.weight"][:] = 1.0
    w["hnorm.weight"][:] = 1.0
    w["shared_head.norm.weight"][:] = 1.0
    w["eh_proj.weight"] = np.concatenate([np.zeros((d, d), np.float32), np.eye(d, dtype=np.float32)], axis=1)
    w["self_attn.o_proj.weight"][:] = 0.0
    w["mlp.down_proj.weight"][:] = 0.0
    return save_mtp_checkpoint(dst, json.loads((target_dir / "config.json").read_text()), w)


@pytest.fixture(scope="module")
def fixture_art(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fx") / "art"
    return export_artifact(FIXTURE / "target", out, ExportSettings(batch=4, max_seq=256, prefill_chunk=16,
                                                                   verify_len=5), draft=FIXTURE / "draft",
                           progress=False)


@pytest.fixture(scope="module")
def tiny_arts(tiny_model_dir, tmp_path_factory):
    """kind -> artifact with a random DSpark head (block 4) and a copy-MTP head, gamma 4."""
    made = {}

    def make(kind: str) -> Path:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"spec_{kind}")
            target = tiny_model_dir(kind, num_layers=3)
            draft = random_dspark_checkpoint(root / "draft", target, layers=1, block_size=4, markov_rank=16)
            mtp = copy_mtp(random_mtp_checkpoint(root / "mtp_random", target), root / "mtp", target)
            made[kind] = export_artifact(target, root / "art", ExportSettings(batch=4, max_seq=160, prefill_chunk=16,
                                                                             verify_len=5),
                                         draft=draft, mtp=mtp, progress=False)
        return made[kind]

    return make


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


def _generate(art: Path, method: str, prompts, params: SamplingParams, threads: int = 1, **kw):
    engine = Engine(art, method=method, threads=threads, **kw)  # one thread: tiny graphs, less overhead
    outs, stats = engine.generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
    return [o.output_ids for o in outs], stats


# -- DeepSpec's own greedy loop ---------------------------------------------------------------------

def test_fixture_trace_is_reproduced_round_by_round(fixture_art, tmp_path):
    expected = json.loads((FIXTURE / "expected_trace.json").read_text())
    runner = CliRunner()
    for i, sample in enumerate(expected["samples"]):
        trace = tmp_path / f"trace{i}.jsonl"
        res = runner.invoke(main, ["run", str(fixture_art), "--input-ids", ",".join(map(str, sample["prompt_ids"])),
                                   "--method", "dspark", "--scheduler", "fixed", "--temperature", "0", "--ignore-eos",
                                   "--max-new-tokens", str(expected["max_new_tokens"]), "--trace", str(trace),
                                   "--json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        assert out["requests"][0]["output_ids"] == sample["output_ids"]
        rounds = [json.loads(line) for line in trace.read_text().splitlines()]
        want = sample["rounds"]
        # DeepSpec verifies a full block even when fewer tokens remain, and runs until 64 tokens after the
        # prefill token: only its final round (or one extra round) may differ from ours.
        assert len(want) - 1 <= len(rounds) <= len(want)
        produced = 1  # the prefill token
        for k, (got, ref) in enumerate(zip(rounds[:-1], want)):
            assert got["draft_tokens"] == ref["draft_tokens"], f"sample {i} round {k}"
            assert got["accepted"] == ref["accepted"], f"sample {i} round {k}"
            np.testing.assert_allclose(got["confidence_logits"], ref["confidence_logits"], atol=1e-4)
            # near the end we verify only drafts that can still be committed
            assert got["request"] == 0 and got["round"] == k
            assert got["verify_len"] == min(4, expected["max_new_tokens"] - produced - 1)
            produced += got["committed"]
        assert rounds[-1]["draft_tokens"] == want[len(rounds) - 1]["draft_tokens"]
        assert out["stats"]["rounds"] == len(rounds)
        # positions advance by accepted + 1 per round, starting at the prompt length + 1 (the prefill token)
        pos = len(sample["prompt_ids"])
        for got in rounds:
            assert got["position"] == pos
            pos += got["accepted"] + 1
    acc = [a + 1 for s in expected["samples"] for a in (r["accepted"] for r in s["rounds"])]
    assert min(acc) == 1 and max(acc) == 5, "the fixture exercises zero, partial and full acceptance"


def test_fixture_batch_matches_ar(fixture_art):
    prompts = [s["prompt_ids"] for s in json.loads((FIXTURE / "expected_trace.json").read_text())["samples"]]
    prompts += _prompts(512, [5, 30], seed=7)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ar, _ = _generate(fixture_art, "ar", prompts, params)
    spec, stats = _generate(fixture_art, "dspark", prompts, params)
    assert spec == ar
    assert stats.to_dict()["tau"] > 1.2  # the fixture head repeats tokens: some rounds accept drafts


# -- greedy identity ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "mtp", "dspark"])
def test_greedy_speculative_equals_autoregressive(tiny_arts, kind, method):
    art = tiny_arts(kind)
    prompts = _prompts(256, [3, 17, 40, 9, 24], seed=1)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar, _ = _generate(art, "ar", prompts, params)
    for one in prompts[:2]:  # batch 1
        assert _generate(art, method, [one], params)[0] == [ar[prompts.index(one)]]
    spec, stats = _generate(art, method, prompts, params)  # 5 requests on 4 slots: a slot is refilled
    assert spec == ar
    d = stats.to_dict()
    assert d["rounds"] == len(stats.rounds) and d["tau"] >= 1.0
    assert len(d["per_position_acceptance"]["conditional"]) == 4
    if method == "mtp" and kind == "llama":  # the copy head is right where the target repeats itself
        assert max(a for _, a, _ in stats.rounds) >= 2


def test_a_round_that_admits_no_draft_is_a_decoding_step(tiny_arts):
    """Lookups found, none admitted (sps on a table where a verify costs far more than a step): the round makes
    the decoding step's call, not a verify's, and the drafter still observes it; the output stays AR's."""
    art = tiny_arts("llama")
    verify = {b: {p: 1.0 if p == b else 1e6 for p in range(b, 5 * b + 1)} for b in (1, 2, 4)}
    profile = Profile(backend="ort", threads=1, position=16, machine="test", created="", verify=verify, draft={})
    prompts = [[5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9], [7, 3, 7, 3, 7, 3, 7]]  # lookups find a match at once
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar, _ = _generate(art, "ar", prompts, params)
    engine = Engine(art, method="ngram", scheduler="sps", threads=1, profile=profile)
    calls = {"verify": 0, "decode": 0, "observe": 0, "drafted": 0}
    drafter, target = engine.drafter, engine.target
    last = {"drafts": False}

    def propose(slots, f=drafter.propose):
        p = f(slots)
        last["drafts"] = bool(p.counts.any())
        return p

    def run(slot, bucket, f=target.run, **kw):  # a round's target call: the decoding step's bucket (T = 1) or not
        if bucket not in target.spec.buckets["prefill"]:
            kind = "decode" if bucket["T"] == 1 else "verify"
            calls[kind] += 1
            calls["drafted"] += kind == "decode" and last["drafts"]
            last["drafts"] = False
        return f(slot, bucket, **kw)

    def observe(*args, f=drafter.observe):
        calls["observe"] += 1
        return f(*args)

    drafter.propose, drafter.observe, target.run = propose, observe, run
    outs, stats = engine.generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
    assert [o.output_ids for o in outs] == ar
    assert calls["drafted"] > 0, calls  # rounds with drafts took the decode path
    assert calls["verify"] + calls["decode"] == stats.steps, calls
    assert calls["verify"] < calls["decode"], calls  # only the cost table's explorations verify
    assert calls["observe"] >= calls["drafted"], calls


@pytest.mark.parametrize("method", ["ngram", "mtp", "dspark"])
def test_runtime_gamma_below_the_exported_one(tiny_arts, method):
    art = tiny_arts("llama")
    prompts = _prompts(256, [6, 11], seed=2)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ar, _ = _generate(art, "ar", prompts, params)
    for gamma in (1, 2):
        spec, stats = _generate(art, method, prompts, params, gamma=gamma)
        assert spec == ar
        assert max(ell for ell, _, _ in stats.rounds) <= gamma


@pytest.mark.parametrize("case", ["llama-ngram", "llama-mtp", "llama-dspark", "fixture-dspark"])
def test_max_new_tokens_inside_a_round(tiny_arts, fixture_art, case):
    kind, method = case.split("-")
    art, vocab = (fixture_art, 512) if kind == "fixture" else (tiny_arts(kind), 256)
    prompts = _prompts(vocab, [7, 12, 20], seed=3)
    full, _ = _generate(art, "ar", prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for n in (1, 2, 3, 5, 8, 13):
        spec, _ = _generate(art, method, prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
        assert spec == [f[:n] for f in full]


@pytest.mark.parametrize("stop", ["stop_token", "eos", "limit"])
def test_commit_stops_inside_accepted_drafts(fixture_art, stop):
    """The fixture's heads only ever get repeated tokens accepted, so a stop token can't first appear
    inside accepted drafts end to end; the engine's commit is checked directly: it ends at the stop token."""
    from specrt.runtime.acceptance import Verdict
    from specrt.runtime.drafters import Proposal
    from specrt.runtime.sequence import Sequence
    from specrt.runtime.round import Outcome, Round
    from specrt.runtime.stats import RunStats

    engine = Engine(fixture_art, method="dspark", threads=1)
    eos = next(iter(engine.eos_ids))
    kw = {"stop_token": dict(stop_token_ids=(77,)), "eos": {}, "limit": dict(max_new_tokens=3)}[stop]
    stats = RunStats()

    def slot(params: SamplingParams) -> Sequence:
        s = Sequence(Request([1, 2, 3], params), capacity=63, eos_ids=engine.eos_ids, tokenizer=None, stream=False)
        s.length, s.pending, s.output_ids = 3, 10, [10]
        s.ids[:4], s.size = [1, 2, 3, 10], 4
        return s

    def commit(s: Sequence, drafts: list[int], accepted: int) -> None:
        proposal = Proposal(tokens=np.array([drafts]), counts=np.array([4]), probs=None)
        tokens = [*drafts[:accepted], 99]
        outcome = Outcome(4, Verdict(accepted, 99), tokens, np.zeros((accepted + 1, 4)))
        engine._commit([s], Round(proposal, [outcome], draft_s=0.0, verify_s=0.0), {}, stats)

    s = slot(SamplingParams(**{"max_new_tokens": 64, **kw}))
    drafts = [5, 77 if stop != "eos" else eos, 6, 8]
    commit(s, drafts, 3)
    assert stats.rounds[-1] == (4, 3, 2) and s.output_ids == [10, 5, drafts[1]]
    assert s.finish_reason == ("length" if stop == "limit" else "eos")
    s = slot(SamplingParams(max_new_tokens=64))
    commit(s, [5, 6, 7, 8], 2)
    assert stats.rounds[-1] == (4, 2, 3)
    assert s.output_ids == [10, 5, 6, 99] and s.finish_reason is None and s.history().tolist()[-3:] == [5, 6, 99]
    assert s.length == 6 and s.ctx.pos == 3 and s.ctx.next_tokens.tolist() == [5, 6, 99]


def test_method_needs_its_head(tiny_model_dir, tmp_path):
    art = export_artifact(tiny_model_dir("llama"), tmp_path / "a", ExportSettings(4, 64, 16, 5), progress=False)
    res = CliRunner().invoke(main, ["run", str(art), "--input-ids", "1,2,3", "--method", "dspark"])
    assert res.exit_code == 1 and "needs an artifact exported with a dspark head" in res.output
    res = CliRunner().invoke(main, ["run", str(art), "--input-ids", "1,2,3", "--method", "ar", "--gamma", "0",
                                    "--max-new-tokens", "8"])
    assert res.exit_code == 0 and "--gamma is ignored with --method ar" in res.output  # said, not silent
    res = CliRunner().invoke(main, ["run", str(art), "--input-ids", "1,2,1,2,1", "--method", "ngram",
                                    "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output  # n-gram drafting needs no head


# -- speculative sampling follows the target distribution exactly ------------------------------------

@pytest.fixture(scope="module")
def peaked(tiny_model_dir, tmp_path_factory):
    """A 32-token model with a sharpened head (peaked distributions) and good and bad heads."""
    root = tmp_path_factory.mktemp("peaked")
    target = Path(tiny_model_dir("llama", tie=False, vocab_size=32, num_layers=2, seed=5))
    sharp = root / "target"
    sharp.mkdir()
    for f in target.iterdir():
        (sharp / f.name).write_bytes(f.read_bytes())
    w = load_file(sharp / "model.safetensors")
    w["lm_head.weight"] = w["lm_head.weight"] * 8.0
    save_file(w, sharp / "model.safetensors", metadata={"format": "pt"})
    good = copy_mtp(random_mtp_checkpoint(root / "mtp_random", sharp), root / "mtp_copy", sharp)
    bad = random_dspark_checkpoint(root / "draft", sharp, layers=1, block_size=3, markov_rank=8, init_std=0.5)
    settings = ExportSettings(batch=32, max_seq=32, prefill_chunk=8, verify_len=4)  # 32 slots: fewer rounds
    return {"target": sharp,
            "good": export_artifact(sharp, root / "art_good", settings, mtp=good, progress=False),
            "bad": export_artifact(sharp, root / "art_bad", settings, draft=bad, progress=False)}


def _exact_pair_probs(target: Path, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(x1, x2) = p(x1 | prompt) p(x2 | prompt, x1) from transformers, with the same filters."""
    import transformers as tf

    from specrt.runtime.sampling import distribution

    model = tf.AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        p1 = distribution(model(torch.tensor([prompt])).logits[0, -1].double().numpy(), params)
        v = len(p1)
        seqs = torch.tensor([prompt + [x] for x in range(v)])
        p2 = distribution(model(seqs).logits[:, -1].double().numpy(), params)
    return p1[:, None] * p2


def _pvalue(pairs: np.ndarray, probs: np.ndarray) -> float:
    v = probs.shape[0]
    counts = np.bincount(pairs[:, 0] * v + pairs[:, 1], minlength=v * v).astype(float)
    expected = probs.ravel() * len(pairs)
    assert counts[expected == 0].sum() == 0, "emitted a pair the target never emits"
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if expected[~big].sum() > 0:  # pool the rare pairs into one bin
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=3, seed=11, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=3, seed=12,
                                                   ignore_eos=True)], ids=["t1", "filtered"])
def test_sampled_tokens_follow_the_target_distribution(peaked, params):
    """The (first, second) generated tokens follow p(x1) p(x2|x1) exactly (the second token comes from a speculative
    round), for AR, a good draft and a bad draft; as many requests per method as the test needs (tests/power.py)."""
    prompt = [5, 9, 14, 3]
    probs = _exact_pair_probs(peaked["target"], prompt, params)
    n = samples_for(probs)
    for method, art in (("ar", peaked["good"]), ("mtp", peaked["good"]), ("dspark", peaked["bad"]),
                        ("ngram", peaked["good"])):
        outs, stats = _generate(art, method, [prompt] * n, params)
        pairs = np.array([o[:2] for o in outs])
        p = _pvalue(pairs, probs)
        assert p > ALPHA, f"{method}: chi-square p = {p:.2e}"
        if method == "mtp":
            assert stats.to_dict()["tau"] > 1.1  # the good head gets drafts accepted
        if method == "ngram" and params.top_k == 0:  # one-hot drafts looked up in the prompt: some accepted,
            verified = sum(ell for ell, _, _ in stats.rounds)  # some rejected and resampled (with top-k 6
            assert 0 < sum(a for _, a, _ in stats.rounds) < verified  # the lookup rarely matches at all)


def test_sampled_tokens_follow_the_target_distribution_on_the_device(peaked):
    """The torch backend's device rounds (rejection sampling on the device, with top-k and top-p): enough requests per
    method (tests/power.py), a good head, a bad head and one-hot lookups; the (first, second) tokens follow
    p(x1) p(x2|x1)."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=3, seed=13, ignore_eos=True)
    prompt = [5, 9, 14, 3]
    probs = _exact_pair_probs(peaked["target"], prompt, params)
    for method, art in (("mtp", peaked["good"]), ("dspark", peaked["bad"]), ("ngram", peaked["good"])):
        engine = Engine(art, method=method, threads=1, backend="torch")
        assert engine.device_rounds is not None, engine.device_note
        outs, stats = engine.generate([Request(prompt_ids=prompt, params=params, id=i)
                                       for i in range(samples_for(probs))])
        assert engine.device_rounds.syncs == stats.steps  # every round ran on the device
        p = _pvalue(np.array([o.output_ids[:2] for o in outs]), probs)
        assert p > ALPHA, f"{method}: chi-square p = {p:.2e}"
        if method == "mtp":
            assert stats.to_dict()["tau"] > 1.1  # the good head's sampled drafts get accepted on the device


def test_hybrid_sampled_tokens_follow_the_target_distribution_on_the_device(peaked):
    """dspark+ngram under sps on the device: lookup rows (one-hot drafts) and head rows (a bad head's distributions)
    chosen per slot on the device, in one batch; as many requests as the test needs (tests/power.py)."""
    from specrt.runtime.hybrid import HEAD, LOOKUP

    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=43, ignore_eos=True)
    prompt = [5, 9, 14, 5, 9, 3]  # x1 in {5, 9, 14, 3} gives a lookup match, any other token none
    probs = _exact_pair_probs(peaked["target"], prompt, params)
    verify = {b: {p: 10.0 + 0.5 * p for p in range(b, 8 * b + 1)} for b in (1, 2, 4, 8)}
    profile = Profile(backend="torch", threads=1, position=16, machine="test", created="", verify=verify,
                      draft={"dspark": {1: 1.0}})
    engine = Engine(peaked["bad"], method="dspark+ngram", scheduler="sps", threads=1, backend="torch", profile=profile)
    outs, stats = engine.generate([Request(prompt_ids=prompt, params=params, id=i) for i in range(samples_for(probs))])
    assert engine.device_rounds.syncs == stats.steps  # every round ran on the device
    p = _pvalue(np.array([o.output_ids[:2] for o in outs]), probs)
    assert p > ALPHA, f"chi-square p = {p:.2e}"
    assert engine.drafter.rounds[LOOKUP] > 0 and engine.drafter.rounds[HEAD] > 0, engine.drafter.rounds


# -- backends ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ar", "ngram", "mtp", "dspark"])
def test_greedy_output_identical_across_backends(tiny_arts, fixture_art, method):
    """Every method on the torch backend produces ONNX Runtime's greedy AR tokens (tiny models, the fixture)."""
    cases = [(tiny_arts("llama"), 256), (tiny_arts("qwen3"), 256)]
    if method != "mtp":  # the fixture has no MTP head
        cases.append((fixture_art, 512))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for art, vocab in cases:
        prompts = _prompts(vocab, [5, 19, 11], seed=4)
        ort, _ = _generate(art, "ar", prompts, params)
        assert _generate(art, method, prompts, params, backend="torch")[0] == ort, art


def test_decoding_calls_keep_their_memory_plan_after_a_verify(tiny_arts, capfd, monkeypatch):
    """ONNX Runtime keys its memory plans (every intermediate at a planned offset of one block) by the XOR of a call's
    input dimensions, which for a target is the batch for a decoding call and for every verify of that batch alike,
    and the first call of a key sets the plan. The runner runs its decoding buckets when it allocates, so a decoding
    call after a verify still runs on its own plan: ONNX Runtime's verbose log names every tensor it allocates apart
    from the plan (here: none for the decoding call; the verify's, on the decoding call's plan, do show)."""
    from specrt import artifact as io
    from specrt.runtime import calls
    from specrt.runtime.backends import load_runner
    from specrt.runtime.backends import ort as backend

    made = backend.session_options

    def verbose(*args, **kw):
        so = made(*args, **kw)
        so.log_severity_level = 0
        return so

    monkeypatch.setattr(backend, "session_options", verbose)
    art = tiny_arts("llama")
    runner = load_runner("ort", art, io.load_manifest(art), io.TARGET, threads=1)
    runner.allocate(1)

    def call(t: int) -> str:
        bucket = runner.spec.bucket("verify", B=1, T=t, P=t) if t > 1 else runner.spec.bucket("decode", B=1)
        rows = calls.target.packed_rows(np.array([t - 1]), np.array([True]), bucket)
        calls.target.grid(runner.inputs(0, bucket), np.array([5]), np.array([3]), np.full((1, 7), 9), rows)
        capfd.readouterr()
        runner.run(0, bucket)
        return capfd.readouterr().err

    fallback = "fall back to default allocation"
    call(3)  # the first verify of this batch
    assert fallback not in call(1)
    assert fallback in call(3)  # the log is on: a verify allocates apart from the decoding call's plan
