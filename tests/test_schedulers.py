"""Schedulers and the ConfidenceTruncate reference: survival, threshold and budget modes, the DSpark paper's
Algorithm 1 on a cost curve, exactness under every scheduler, and why admission must not look at acceptance."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specrt.errors import SpecrtError
from specrt.plugins.confidence_truncate import admit, survival, truncate
from specrt.runtime.acceptance import accept_sampled
from specrt.runtime.drafters import Proposal
from specrt.runtime.engine import Engine, Request
from specrt.runtime.profile import Profile, save_profile
from specrt.runtime.sampling import SamplingParams
from specrt.runtime import schedulers
from specrt.runtime.schedulers import (AcceptanceHistory, AsyncSPSScheduler, SPSScheduler, make_scheduler)

from test_speculative import _exact_pair_probs, _prompts, _pvalue, peaked, tiny_arts  # noqa: F401 (fixtures)
from power import ALPHA, samples_for

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"


# -- the ConfidenceTruncate reference -------------------------------------------------------------------

@pytest.mark.parametrize("gamma", [1, 2, 7, 16])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_truncate_reference(gamma, batch):
    rng = np.random.default_rng(gamma * 100 + batch)
    logits = rng.normal(0, 3, (batch, gamma)).astype(np.float32)
    temps = rng.uniform(0.5, 2.0, gamma).astype(np.float32)
    a, lengths = truncate(logits, temps, threshold=0.4)
    expect = np.cumprod(1 / (1 + np.exp(-logits.astype(np.float64) / temps)), axis=1)
    np.testing.assert_allclose(a, expect, rtol=1e-5)
    assert (np.diff(a, axis=1) <= 0).all()
    assert (lengths == (expect >= 0.4).sum(1)).all()
    for budget in (0, 1, gamma, batch * gamma // 2, batch * gamma, batch * gamma + 5):
        _, ls = truncate(logits, temps, budget=budget)
        assert ls.sum() == min(budget, batch * gamma) and (ls <= gamma).all()
        admitted = np.arange(gamma) < ls[:, None]  # a prefix per row: the admitted pairs are the best ones
        if admitted.any() and (~admitted).any():
            assert a[admitted].min() >= a[~admitted].max()


def test_truncate_edges():
    temps = np.ones(4, np.float32)
    sure, unsure = np.full((2, 4), 30.0, np.float32), np.full((2, 4), -30.0, np.float32)
    assert truncate(sure, temps, threshold=0.99)[1].tolist() == [4, 4]
    assert truncate(unsure, temps, threshold=0.01)[1].tolist() == [0, 0]
    assert truncate(unsure, temps, threshold=0.0)[1].tolist() == [4, 4]  # threshold 0 keeps everything
    assert truncate(sure, temps, budget=5)[1].tolist() == [4, 1]  # ties: the lower flat index b·γ + k
    assert admit(np.array([[0.9, 0.0], [0.5, 0.2]], np.float32), 4).tolist() == [1, 2]  # survival 0: never


# -- scheduler units -----------------------------------------------------------------------------------

class LinearCosts:
    """A verify call costs `step` + `per_token` per extra token per slot; drafts cost `draft`."""

    def __init__(self, step=10.0, per_token=2.0, draft=2.0):
        self.step, self.per_token, self.draft = step, per_token, draft

    def verify_ms(self, batch, tokens):
        return self.step * (1 + 0.1 * (batch - 1)) + self.per_token * batch * (tokens - 1)

    def draft_ms(self, head, batch):
        return self.draft


def _proposal(conf: np.ndarray) -> Proposal:
    n, g = conf.shape
    return Proposal(tokens=np.zeros((n, g), np.int64), counts=np.full(n, g), probs=None,
                    confidence_logits=conf.astype(np.float32), head="dspark")


def _schedule(s, proposal: Proposal, active: list[bool], capacity: np.ndarray | None = None) -> np.ndarray:
    """The lengths the host round asks of a scheduler's rule (runtime/host_round.py `draft`, runtime/round.py
    `run`): the proposal's survivals, and for the cost-aware rules the draft call's cost and the verify curve."""
    from specrt.runtime.round import cost_inputs

    n, active = len(active), np.array(active)
    draft_ms, curve = (cost_inputs(s.costs, n, n * (s.gamma + 1), proposal.head) if s.traits.plans_on_costs
                       else (0.0, None))
    capacity = np.full((), -1, np.int64) if capacity is None else capacity
    return s.rule(s.survival(proposal), proposal.counts, active, draft_ms, curve, capacity)


def test_sps_admits_while_the_rate_improves():
    s = SPSScheduler(4, costs=LinearCosts(), temperatures=np.ones(4), head="dspark")
    # survival 0.95^k: every draft is worth 2 ms of a 12 ms round; a survival of 0.05 is not
    strong = np.log(0.95 / 0.05)
    lengths = _schedule(s, _proposal(np.full((1, 4), strong)), [True])
    assert lengths.tolist() == [4]
    weak = _schedule(s, _proposal(np.full((1, 4), np.log(0.05 / 0.95))), [True])
    assert weak.tolist() == [0]
    # survivals: row 0 .99, .495, .490, .485; row 1 .45, ...; a verify call costs 11 + 3 ms per extra token per
    # slot. Row 0's first draft pays; its second (.495, one more token for both slots) does not, and admission
    # stops there, though row 1's first draft (.45, free once T = 2) would have paid: Algorithm 1 stops at the
    # first non-improvement.
    sure = np.array([[0.99, 0.5, 0.99, 0.99], [0.45, 0.99, 0.99, 0.99]])
    conf = np.log(sure / (1 - sure))
    s = SPSScheduler(4, costs=LinearCosts(step=10.0, per_token=1.5, draft=0.0), temperatures=np.ones(4),
                     head="dspark")
    assert _schedule(s, _proposal(conf), [True, True]).tolist() == [1, 0]
    assert _schedule(s, _proposal(conf), [True, False])[1] == 0  # idle rows never verify


def _admission_by_pairs(a, active, fixed_ms, curve, explore=None):
    """Algorithm 1 as the paper states it, one pair at a time: the reference steps.admission is checked against."""
    n, gamma = a.shape
    lengths = np.zeros(n, np.int64)
    rows = np.flatnonzero(active)
    expected, tokens = float(len(rows)), len(rows)
    best = expected / (fixed_ms + curve[min(tokens, len(curve) - 1)])
    last = nxt = None  # the row of the last pair admitted; the first pair not admitted
    cand = [(float(a[r, k]), k, r) for r in rows for k in range(gamma) if a[r, k] > 0]
    for value, k, r in sorted(cand, key=lambda c: (-c[0], c[1], c[2])):
        rate = (expected + value) / (fixed_ms + curve[min(tokens + 1, len(curve) - 1)])
        if rate <= best:
            nxt = (k, r)
            break
        best, expected, tokens = rate, expected + value, tokens + 1
        lengths[r], last = k + 1, r
    if explore is None:
        return lengths, best, False
    if last is not None and explore[min(tokens - 1, len(explore) - 1)]:  # one pair fewer (a row's pairs: in k order)
        lengths[last] -= 1
        return lengths, best, True
    if nxt is not None and explore[min(tokens + 1, len(explore) - 1)]:  # one pair more
        lengths[nxt[1]] = nxt[0] + 1
        return lengths, best, True
    return lengths, best, False


class _Curve:
    """A cost table that is one verify curve (and the cells it wants explored)."""

    def __init__(self, curve, explore):
        self.curve, self.explore, self.explorations = curve, explore, 0

    def verify_curve(self, batch, tokens):
        return self.curve

    def exploring(self, batch, tokens):
        return self.explore

    def explored(self):
        self.explorations += 1


def admission_case(seed: int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray, np.ndarray | None]:
    """A random round for Algorithm 1 (also tests/test_cpp.py's): survivals [n, g] with ties and zeros, active rows
    (some idle), the draft side's ms, a convex verify curve, and on odd seeds the cells to explore."""
    rng = np.random.default_rng(seed)
    n, g = int(rng.integers(1, 9)), int(rng.integers(1, 8))
    a = np.cumprod(rng.choice([0.0, 0.3, 0.5, 0.9, 0.95, 1.0], (n, g)), axis=1).astype(np.float32)
    active = rng.random(n) < 0.8
    curve = np.cumsum(rng.uniform(0.0, 4.0, n * (g + 1) + 1)) + 10.0
    fixed = float(rng.uniform(0, 5))
    explore = rng.random(len(curve)) < 0.5 if seed % 2 else None
    return a, active, fixed, curve, explore


@pytest.mark.parametrize("seed", range(40))
def test_admission_is_algorithm_1_on_numpy_and_torch(seed):
    """steps.admission (sorted pairs, running sums in admission order) equals Algorithm 1 pair by pair, on numpy
    and on torch tensors alike: survivals with ties and zeros, idle rows, convex and flat cost curves, exploration;
    steps.admit equals ConfidenceTruncate's budget-mode reference."""
    from specrt.runtime import steps

    a, active, fixed, curve, explore = admission_case(seed)
    n, g = a.shape
    want, rate, explored = _admission_by_pairs(a, active, fixed, curve, explore)
    got = steps.admission(a, active, fixed, curve, explore)
    assert got[0].tolist() == want.tolist() and float(got[1]) == rate and bool(got[2]) == explored
    t = steps.admission(torch.from_numpy(a), torch.from_numpy(active), torch.tensor(fixed, dtype=torch.float64),
                        torch.from_numpy(curve), None if explore is None else torch.from_numpy(explore))
    assert t[0].tolist() == want.tolist() and float(t[1]) == rate and bool(t[2]) == explored
    # the host wrapper, with its shortcut for rounds that admit nothing (most rounds on a steep curve)
    for c in (curve, 10.0 + 8.0 * (curve - 10.0)):
        want, rate, explored = _admission_by_pairs(a, active, fixed, c, explore)
        table = _Curve(c, explore)
        lengths, host_rate = schedulers.admission(a, active, fixed, table, explore=explore is not None)
        assert lengths.tolist() == want.tolist() and host_rate == rate and table.explorations == int(explored)
    for budget in (0, 1, n, n * g // 2, n * g + 3):
        assert steps.admit(a, budget).tolist() == admit(a, budget).tolist()
        assert steps.admit(torch.from_numpy(a), torch.tensor(budget)).tolist() == admit(a, budget).tolist()


@pytest.mark.parametrize("seed", range(60))
def test_a_round_with_one_active_slot_takes_the_walk_and_gives_the_same_admission(seed):
    """One active slot (the host's shortcut for it, `_admit_one`): the same lengths, rate and exploration as
    Algorithm 1 pair by pair and as steps.admission, bit for bit, on rows with ties and zeros, idle rows beside it,
    with and without cells to explore, on a flat and a steep curve; a row whose survivals rise takes the sort."""
    from specrt.runtime import steps

    a, _, fixed, curve, explore = admission_case(seed)
    n, g = a.shape
    rng = np.random.default_rng(1000 + seed)
    active = np.zeros(n, bool)
    active[int(rng.integers(0, n))] = True
    if seed % 5 == 4:  # a row that is not a prefix's survival: shuffled
        a[active] = rng.permutation(a[active][0])
    for c in (curve, 10.0 + 8.0 * (curve - 10.0), np.full_like(curve, 10.0)):
        want, rate, explored = steps.admission(a, active, fixed, c, explore)
        rate, explored = float(rate), bool(explored)
        if seed % 5 != 4:  # (the pair by pair reference reads a row's pairs as a prefix's)
            ref = _admission_by_pairs(a, active, fixed, c, explore)
            assert (ref[0].tolist(), ref[1], ref[2]) == (want.tolist(), rate, explored)
        table = _Curve(c, explore)
        got, host_rate = schedulers.admission(a, active, fixed, table, explore=explore is not None)
        assert got.tolist() == want.tolist() and host_rate == rate and table.explorations == int(explored)


def test_async_sps_uses_the_previous_rounds_capacity():
    s = AsyncSPSScheduler(4, costs=LinearCosts(), temperatures=np.ones(4), head="dspark")
    strong, weak = _proposal(np.full((1, 4), 5.0)), _proposal(np.full((1, 4), -5.0))
    capacity = np.full((), -1, np.int64)  # the round's state the rule keeps its plan in
    assert _schedule(s, strong, [True], capacity).tolist() == [4]  # first round: plans for itself
    assert _schedule(s, weak, [True], capacity).tolist() == [4]  # capacity planned on the strong round
    assert _schedule(s, strong, [True], capacity).tolist() == [0]  # ... and now on the weak one


def test_history_and_threshold_without_a_confidence_head():
    h = AcceptanceHistory(3)
    np.testing.assert_allclose(h.survival(), [0.5, 0.25, 0.125])
    for _ in range(8):
        h.observe(3, 3)
    h.observe(3, 0)
    assert h.survival()[0] == pytest.approx(9 / 11) and h.tries.tolist() == [11, 10, 10]
    s = make_scheduler("threshold", gamma=3, threshold=0.5)
    p = Proposal(tokens=np.zeros((2, 3), np.int64), counts=np.array([3, 1]), probs=None)
    assert _schedule(s, p, [True, True]).tolist() == [1, 1]  # 0.5, then 0.25
    with pytest.raises(SpecrtError, match="needs a cost profile"):
        make_scheduler("sps", gamma=3)
    with pytest.raises(SpecrtError, match="unknown scheduler"):
        make_scheduler("psychic", gamma=3)
    with pytest.raises(SpecrtError, match="--threshold"):
        make_scheduler("threshold", gamma=3, threshold=1.5)


# -- exactness ------------------------------------------------------------------------------------------

def _store_cheap_drafts_profile(art: Path) -> None:
    """A stored cost table on which drafts pay (a flat verify curve, cheap draft calls), so the cost-aware
    schedulers admit drafts whenever survival is high and the tests see them decide, whatever this machine's
    timing would say for a tiny model (its measured curve can make every draft a loss: nothing verified)."""
    verify = {b: {p: 10.0 + 0.5 * p for p in range(b, 8 * b + 1)} for b in (1, 2, 4, 8, 16)}
    save_profile(art, Profile(backend="ort", threads=1, position=16, machine="test", created="", verify=verify,
                              draft={"dspark": {1: 1.0}, "mtp": {1: 1.0}}))


@pytest.mark.parametrize("scheduler", ["threshold", "sps", "sps-async"])
@pytest.mark.parametrize("method", ["ngram", "mtp", "dspark"])
def test_greedy_identity_under_every_scheduler(tiny_arts, scheduler, method):
    art = tiny_arts("llama")
    _store_cheap_drafts_profile(art)
    prompts = _prompts(256, [5, 19, 11, 3], seed=9)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reqs = [Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)]
    ar, _ = Engine(art, method="ar", threads=1).generate(reqs)
    spec, stats = Engine(art, method=method, scheduler=scheduler, threads=1, threshold=0.2).generate(reqs)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    assert stats.rounds


@pytest.mark.parametrize("scheduler", ["sps", "sps-async"])
def test_sampled_tokens_follow_the_target_distribution(peaked, scheduler):
    """(first, second) tokens follow p(x1) p(x2|x1) under the confidence-driven schedulers (a bad DSpark head:
    many rejections) and under sps on an MTP head (no confidence head: the run's acceptance history)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=31, ignore_eos=True)
    prompt = [5, 9, 14, 3]
    probs = _exact_pair_probs(peaked["target"], prompt, params)
    cases = [("dspark", peaked["bad"])] + ([("mtp", peaked["good"])] if scheduler == "sps" else [])
    for method, art in cases:
        _store_cheap_drafts_profile(art)
        engine = Engine(art, method=method, scheduler=scheduler, threads=1)
        outs, stats = engine.generate([Request(prompt_ids=prompt, params=params, id=i)
                                       for i in range(samples_for(probs))])  # tests/power.py
        pairs = np.array([o.output_ids[:2] for o in outs])
        assert _pvalue(pairs, probs) > ALPHA, f"{method}/{scheduler}"
        lengths = {ell for ell, _, _ in stats.rounds}
        assert len(lengths) > 1 or method == "mtp", lengths  # the schedule varies from round to round


def test_admission_that_peeks_at_acceptance_is_not_exact():
    """Appendix A of the DSpark paper: verify a draft only when the target would surely accept it, and the
    output follows q restricted to those drafts, not p. A rule that ignores the draft (here: a coin that
    depends on nothing the round draws, as confidence-driven schedules do) stays exact."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(p)[None].repeat(2, 0)  # the target's logits at both verified positions
    params = SamplingParams(temperature=1.0)

    def first_tokens(rule, n=40_000):
        out = np.empty(n, np.int64)
        for i in range(n):
            x = rng.choice(4, p=q)
            if rule(x):
                v = accept_sampled(np.array([x]), q[None], logits, params, rng)
                out[i] = x if v.accepted else v.bonus
            else:  # verify nothing: the bonus comes straight from p
                out[i] = accept_sampled(np.array([], np.int64), None, logits[:1], params, rng).bonus
        return np.bincount(out, minlength=4) / n

    peek = first_tokens(lambda x: p[x] >= q[x])  # looks at whether the draft will be accepted
    blind = first_tokens(lambda x: rng.random() < 0.6)  # independent of the draft and of p
    assert np.abs(peek - p).max() > 0.05
    assert np.abs(blind - p).max() < 0.01


def test_confidence_of_a_draft_does_not_depend_on_that_draft():
    """What keeps DSpark's schedules exact: c_k is computed from h_k and the previous token, never from token
    k itself. Change only the noise that draws token k: confidences up to k stay, later ones may move."""
    from specrt.exporter.loaders import load_target
    from specrt.exporter.loaders.deepspec import load_dspark
    from specrt.models.dspark import DSparkDraft

    target = load_target(FIXTURE / "target")
    d = load_dspark(FIXTURE / "draft", target.config)
    model = DSparkDraft.from_weights(d.config, d.with_target(target.weights))
    k = d.config.block_size
    model.setup_caches(1, 32)
    torch.manual_seed(0)
    h = torch.randn(1, k, d.config.layers.hidden_size)
    base = model.lm_head(h)
    temp = torch.ones(1)
    noise = torch.rand(1, k)
    first = model.sample_block(base, h, torch.tensor([5]), temp, noise)
    for pos in range(k):
        for trial in range(20):
            n2 = noise.clone()
            n2[0, pos] = torch.rand(1).item()
            second = model.sample_block(base, h, torch.tensor([5]), temp, n2)
            if second.tokens[0, pos] != first.tokens[0, pos]:
                break
        else:
            continue  # this position's distribution is too peaked to flip: nothing to compare
        torch.testing.assert_close(second.confidence_logits[:, :pos + 1], first.confidence_logits[:, :pos + 1])
        if pos + 1 < k:
            assert not torch.equal(second.confidence_logits[:, pos + 1], first.confidence_logits[:, pos + 1])
