"""Cheaper drafts: the greedy variants of the draft graphs, and the drafter that combines n-gram lookups with a
head (runtime/hybrid.py): exact in greedy and sampled decoding, and a skipped head catches up on what it missed."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from specrt import artifact as io
from specrt.runtime.drafters import Context, GraphDrafter, lookup, lookup_match
from specrt.runtime.engine import Engine, Request
from specrt.runtime.hybrid import DECAY, EXPLORE, HEAD, LOOKUP, PRIOR_ROUNDS, PRIOR_TOKENS, HybridDrafter, Record
from specrt.runtime.profile import Profile, save_profile
from specrt.runtime.sampling import SamplingParams

from test_speculative import _exact_pair_probs, _pvalue, peaked, tiny_arts  # noqa: F401 (fixtures)
from power import ALPHA, samples_for


def _store_profile(art: Path, draft_ms: float = 1.0) -> None:
    """A flat verify curve, so drafts pay whenever they are likely: the tests see every decision made."""
    verify = {b: {p: 10.0 + 0.5 * p for p in range(b, 8 * b + 1)} for b in (1, 2, 4, 8)}
    save_profile(art, Profile(backend="ort", threads=1, position=16, machine="test", created="", verify=verify,
                              draft={"dspark": {1: draft_ms}, "mtp": {1: draft_ms}}))


def _repetitive(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat spans, so lookups find matches (and outputs that copy them too)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        span = [int(t) for t in rng.integers(3, vocab, 6)]
        out.append([*span, *rng.integers(3, vocab, 3).tolist(), *span, *span[:3]])
    return out


def test_lookup_follows_the_latest_longest_suffix_match():
    """The n-gram lookup: what followed the latest earlier occurrence of the longest suffix (up to max_n), and that
    suffix's length (scripts/lookup_sim.py --by-match reads it)."""
    assert lookup_match(np.array([7, 8, 9, 4, 7, 8]), 3, 3)[1] == 2
    assert lookup(np.array([7, 8, 9, 4, 7, 8]), 3, 3).tolist() == [9, 4, 7]
    tokens, n = lookup_match(np.array([1, 2, 3, 9, 5, 3, 6, 2, 3]), 3, 2)  # "2 3" beats the later lone "3"
    assert (tokens.tolist(), n) == ([9, 5], 2)
    tokens, n = lookup_match(np.array([1, 2, 3, 9, 8, 3, 6, 4, 3]), 3, 2)
    assert (tokens.tolist(), n) == ([6, 4], 1)  # only the last token matches: its latest occurrence
    assert lookup_match(np.array([1, 2, 3]), 3, 2)[1] == 0 and lookup(np.array([1, 2, 3]), 3, 2).size == 0


def test_lookup_survivals_are_kept_per_match_length(tiny_arts):
    """An n-gram lookup's drafts survive as lookups of the same match length have been accepted: a round's outcome
    updates its own length's history only, and an engine's rounds feed them (sps then plans on them)."""
    from specrt.runtime.drafters import NGramDrafter

    class View:
        def __init__(self, tokens):
            self.tokens = np.asarray(tokens, np.int64)

        def history(self):
            return self.tokens

    d = NGramDrafter(3, max_n=3)
    d.allocate(2)
    slots = [View([1, 2, 3, 9, 5, 1, 2, 3]), View([7, 4, 6, 7])]  # a 3-token match, a 1-token one
    p = d.propose(slots)
    assert d.match.tolist() == [3, 1] and p.counts.tolist() == [3, 3]
    assert np.allclose(p.survival[0], p.survival[1])  # no outcome yet: both at the prior
    for _ in range(6):
        d.observe(0, 3, 3)  # the 3-token match's drafts all accepted
        d.observe(1, 3, 0)  # the 1-token match's first draft refused
    p = d.propose(slots)
    assert p.survival[0, 0] > 0.8 > 0.3 > p.survival[1, 0]
    art = tiny_arts("llama")
    with Engine(art, method="ngram", scheduler="fixed", threads=1) as engine:
        engine.generate([Request(q, SamplingParams(max_new_tokens=24, ignore_eos=True), id=i)
                         for i, q in enumerate(_repetitive(engine.manifest.model.vocab_size, 3, seed=4))])
        prior = NGramDrafter(engine.drafter.steps).histories[0].tries.sum()
        assert sum(h.tries.sum() - prior for h in engine.drafter.histories[1:]) > 0  # outcomes observed
        assert engine.drafter.histories[0].tries.sum() == prior  # no match, no drafts, nothing tried


# -- greedy variants -------------------------------------------------------------------------------------

@pytest.mark.parametrize("head", ["dspark", "mtp"])
def test_greedy_variant_drafts_the_full_graphs_argmax(tiny_arts, head):
    """The greedy variant (`{head}.greedy.onnx`) drafts exactly the full graph's temperature-0 tokens (and the
    same confidences) over the same cache, without the vocabulary-wide outputs."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    spec = manifest.graphs[head]
    assert spec.greedy_file == f"{head}.greedy.onnx" and (art / spec.greedy_file).is_file()
    from specrt.runtime.backends import load_runner

    runner = load_runner("ort", art, manifest, head, threads=1)
    runner.allocate(2)
    rng = np.random.default_rng(3)
    for rows in (1, 3):
        bucket = runner.spec.bucket("propose", B=2, C=rows)
        outs = []
        for greedy in (False, True):
            feeds = runner.inputs(0, bucket, greedy=greedy)
            state = np.random.default_rng(rows)  # the same inputs for both calls
            for name, buf in feeds.items():
                if buf.dtype == np.float32 and name not in (io.TEMPERATURE, io.NOISE):
                    buf[...] = state.normal(0, 1, buf.shape)
                elif name in (io.CTX_POSITIONS, io.MTP_POSITIONS):
                    buf[...] = 20 + np.arange(buf.shape[1])
                elif name in (io.CTX_WRITE_INDEX,):
                    buf[...] = 20
                elif name in (io.CTX_LEN,):
                    buf[...] = 20 + rows
                elif name in (io.ANCHOR_IDS, io.MTP_TOKENS):
                    buf[...] = state.integers(3, 200, buf.shape)
                elif name == io.MTP_LAST_ROW:
                    buf[...] = rows - 1
                elif name == io.TRUNCATE_BUDGET:
                    buf[...] = -1
            feeds[io.TEMPERATURE][:] = 0.0
            feeds[io.NOISE][:] = rng.random(feeds[io.NOISE].shape)  # unread at temperature 0
            outs.append({k: v.copy() for k, v in runner.run(0, bucket, greedy=greedy).items()})
        full, greedy = outs
        assert not set(io.GREEDY_DROPS) & set(greedy) and set(io.GREEDY_DROPS) <= set(full)
        np.testing.assert_array_equal(greedy[io.DRAFT_TOKENS], full[io.DRAFT_TOKENS])
        np.testing.assert_array_equal(full[io.DRAFT_TOKENS], full[io.DRAFT_LOGITS].argmax(-1)
                                      if not manifest.heads[head].vocab_ids else full[io.DRAFT_TOKENS])
        for name in (io.CONFIDENCE_LOGITS, io.SURVIVAL):
            if name in full:
                np.testing.assert_allclose(greedy[name], full[name], rtol=1e-5, atol=1e-6)


# -- the hybrid drafter in the loop ----------------------------------------------------------------------

@pytest.mark.parametrize("scheduler", ["fixed", "sps"])
@pytest.mark.parametrize("method", ["dspark+ngram", "mtp+ngram"])
def test_hybrid_greedy_identity(tiny_arts, method, scheduler):
    art = tiny_arts("llama")
    _store_profile(art)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reqs = [Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(_repetitive(256, 5, seed=4))]
    ar, _ = Engine(art, method="ar", threads=1).generate(reqs)
    engine = Engine(art, method=method, scheduler=scheduler, threads=1)
    spec, stats = engine.generate(reqs)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    calls = engine.drafter.rounds
    assert calls[LOOKUP] > 0 and calls[HEAD] > 0, calls  # both kinds of rounds ran
    assert sum(c for _, _, c in stats.rounds) == sum(len(o.output_ids) - 1 for o in spec)


def test_hybrid_sampled_tokens_follow_the_target_distribution(peaked):
    """(first, second) tokens follow p(x1) p(x2|x1) with lookup rows (one-hot drafts) and head rows
    (a bad DSpark head's distributions) mixed in one batch, under sps."""
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=41, ignore_eos=True)
    prompt = [5, 9, 14, 5, 9, 3]  # x1 in {5, 9, 14, 3} gives a lookup match, any other token none
    probs = _exact_pair_probs(peaked["target"], prompt, params)
    art = peaked["bad"]
    _store_profile(art)
    engine = Engine(art, method="dspark+ngram", scheduler="sps", threads=1)
    outs, stats = engine.generate([Request(prompt_ids=prompt, params=params, id=i)
                                   for i in range(samples_for(probs))])  # tests/power.py
    pairs = np.array([o.output_ids[:2] for o in outs])
    assert _pvalue(pairs, probs) > ALPHA
    assert engine.drafter.rounds[LOOKUP] > 0 and engine.drafter.rounds[HEAD] > 0, engine.drafter.rounds


# -- catching up a skipped head ----------------------------------------------------------------------------

@dataclass
class _View:
    """A slot as drafters see it."""

    ctx: Context | None
    pending: int
    tokens: list[int]
    temperature: float = 0.0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def history(self) -> np.ndarray:
        return np.asarray(self.tokens, np.int64)


class _Costs:
    """A flat verify curve; the draft call costs `draft` ms (set per round by the test)."""

    draft = 0.0

    def verify_ms(self, batch, tokens):
        return 10.0 + 0.5 * tokens

    def draft_ms(self, head, batch):
        return self.draft


@pytest.mark.parametrize("head", ["dspark", "mtp"])
@pytest.mark.parametrize("skipped", [[1], [2, 3, 2]])  # rows of the rounds the head skips (in one call / not)
@pytest.mark.parametrize("defer", [False, True])  # the prompt written at prefill, or left in the backlog too
def test_skipped_rounds_reach_the_head_before_it_drafts(tiny_arts, head, skipped, defer):
    """Rounds drafted by lookups alone leave their verified rows in a backlog; the next head call writes them
    first (through the prefill bucket when they exceed one propose call's rows), so its drafts equal those of a
    head that saw every round. With `defer_prefill` the prompt's rows wait there too."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    rng = np.random.default_rng(7)
    F = max(h.feature_offset + h.feature_dim for h in manifest.heads.values())  # every head's features
    prompt = rng.integers(3, 256, 12)
    prompt_ctx = Context(0, rng.normal(0, 1, (12, F)).astype(np.float32), np.asarray([*prompt[1:], 50]))
    rounds = [Context(12 + sum(skipped[:i]), rng.normal(0, 1, (r, F)).astype(np.float32), rng.integers(3, 256, r))
              for i, r in enumerate([*skipped, 2])]

    plain = GraphDrafter(art, manifest, head, threads=1)
    plain.allocate(1)
    pending = plain.prefill(0, prompt_ctx)
    for ctx in [merge_first(pending, rounds[0]), *rounds[1:]]:  # a head that sees every round
        want = plain.propose([_View(ctx, int(ctx.next_tokens[-1]), [1, 2, 3])])

    costs = _Costs()
    hybrid = HybridDrafter(GraphDrafter(art, manifest, head, threads=1), costs, defer_prefill=defer)
    hybrid.allocate(1)
    pending = hybrid.prefill(0, prompt_ctx)
    assert (pending is None) == defer
    history = [7, 8, 9, 4, 7, 8]  # "7 8" occurred before: the lookup proposes 9, 4, ...
    costs.draft = 1e9  # the head cannot pay: lookups draft
    for i, ctx in enumerate(rounds[:-1]):
        p = hybrid.propose([_View(merge_first(pending, ctx) if i == 0 and pending else ctx, 1, history)])
        assert p.head == "" and p.counts[0] > 0
    assert sum(len(c.next_tokens) for c in hybrid.backlog[0]) == (len(prompt) if defer else 1) + sum(skipped)
    costs.draft = 0.0
    got = hybrid.propose([_View(rounds[-1], int(rounds[-1].next_tokens[-1]), [1, 2, 3])])  # no match: the head
    assert got.head == head and hybrid.backlog[0] == [] and got.catch_up  # its time is not a draft call's cost
    np.testing.assert_array_equal(got.tokens, want.tokens)
    if want.confidence_logits is not None:
        np.testing.assert_allclose(got.confidence_logits, want.confidence_logits, rtol=1e-5, atol=1e-5)


def merge_first(pending: Context, ctx: Context) -> Context:
    """The prefill's pending row, then a round's rows."""
    from specrt.runtime.hybrid import merge

    return merge([pending, ctx])


def test_head_is_explored_when_its_estimate_says_skip(tiny_arts):
    """A head whose rounds realized little is still called after EXPLORE rounds, so its estimate can recover; each
    exploration that does not win it back doubles the wait before the next, up to EXPLORE_MAX rounds."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    costs = _Costs()
    hybrid = HybridDrafter(GraphDrafter(art, manifest, "dspark", threads=1), costs, explore_max=4 * EXPLORE)
    hybrid.allocate(1)
    # its request's rounds so far: a million slot rounds that committed one token in all
    hybrid.records[0] = Record(1e6, 1.0, 2e6)
    feats = np.zeros((1, max(h.feature_offset + h.feature_dim for h in manifest.heads.values())), np.float32)
    heads = []
    for i in range(16 * EXPLORE):
        view = _View(Context(i, feats, np.asarray([5])), 5, [1, 2, 3])  # never a lookup match
        heads.append(hybrid.propose([view]).head == "dspark")  # no outcome observed: the estimate stays
    called = [i for i, h in enumerate(heads) if h]
    waits = np.diff([-1, *called]) - 1  # rounds without the head before each call
    assert waits.tolist() == [EXPLORE, 2 * EXPLORE, 4 * EXPLORE, 4 * EXPLORE, 4 * EXPLORE], waits



def test_only_the_rows_the_head_drafted_are_its_record(tiny_arts):
    """A head round's slots that kept their lookups (or that an exploration left out) add nothing to the head's
    record of tokens committed and verified: their tokens are the lookups'."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    hybrid = HybridDrafter(GraphDrafter(art, manifest, "dspark", threads=1), _Costs())
    hybrid.allocate(2)
    hybrid._last_head = True
    hybrid.source[:2] = [LOOKUP, HEAD]
    hybrid.observe(0, 3, 3)  # the lookup's row: 4 tokens committed
    hybrid.observe(1, 2, 0)  # the head's: 1
    hybrid._fold()
    for record in (hybrid.record, hybrid.records[1]):  # every request's, and the one the head drafted for
        assert record.rounds == pytest.approx(DECAY * PRIOR_ROUNDS + 1)
        assert record.committed == pytest.approx(DECAY * PRIOR_ROUNDS * PRIOR_TOKENS + 1)
        assert record.verified == pytest.approx(DECAY * PRIOR_ROUNDS * 2.0 + 3)
    assert hybrid.records[0].rounds == PRIOR_ROUNDS  # the slot that kept its lookup: untouched


def test_the_head_is_priced_per_request(tiny_arts):
    """Each request has its own record of what the head's rounds delivered to it, and a round's price sums those of
    the requests in flight: a head that pays for one request and not the other is called when the first is in
    flight, not for the second alone. A new request starts from every request's record so far, at the weight of
    PRIOR_ROUNDS rounds."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    hybrid = HybridDrafter(GraphDrafter(art, manifest, "dspark", threads=1), _Costs(), lookups=False, lazy=True,
                           defer_prefill=True)
    hybrid.allocate(2)
    F = max(h.feature_offset + h.feature_dim for h in manifest.heads.values())
    view = _View(Context(0, np.zeros((1, F), np.float32), np.asarray([5])), 5, [1, 2, 3])
    # a decoding step commits a token per 10.5 ms per request; request 0's head rounds committed 1 token for 2
    # verified (1 per 11 ms), request 1's 3 for 3 (3 per 11.5 ms)
    hybrid.records[:2] = [Record(100, 100, 200), Record(100, 300, 300)]
    assert not hybrid.choose([view, None])[2]
    assert hybrid.choose([None, view])[2]
    assert hybrid.choose([view, view])[2]  # 4 tokens per 12.5 ms against 2 per 11
    hybrid.record = Record(50, 50, 125)  # every request's head rounds: 1 committed and 2.5 verified each
    hybrid.prefill(1, view.ctx)  # a new request in slot 1
    r = hybrid.records[1]
    assert (r.rounds, r.committed, r.verified) == pytest.approx((PRIOR_ROUNDS, PRIOR_ROUNDS, 2.5 * PRIOR_ROUNDS))
    assert not hybrid.choose([None, view])[2]  # 1 per 11.25 ms: below a decoding step's
    hybrid._last_head, hybrid.source[1] = True, HEAD
    for _ in range(8):  # its own rounds: all three drafts accepted, each time
        hybrid.observe(1, 3, 3)
        hybrid._last_head = True
        hybrid._fold()
    assert hybrid.choose([None, view])[2]
    assert hybrid.records[0].rounds == 100  # the other request's record: untouched


def test_a_head_whose_drafts_are_never_accepted_stops_being_called(tiny_arts):
    """The head's record starts from a prior (as if its rounds committed 1.5 tokens for 2 verified) that decays with
    its rounds: a head whose drafts are never accepted, on costs where a 2-token verify costs barely more than a
    decoding step (10.5 against 10 ms, a free draft call), wins its first rounds on the prior, then is called only
    on its explorations. (A prior that stayed kept it winning every round, at 1.083 tokens per 11 ms.)"""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    costs = _Costs()
    hybrid = HybridDrafter(GraphDrafter(art, manifest, "dspark", threads=1), costs, lookups=False, lazy=True)
    hybrid.allocate(1)
    feats = np.zeros((1, max(h.feature_offset + h.feature_dim for h in manifest.heads.values())), np.float32)
    heads = []
    for i in range(8 * EXPLORE):
        p = hybrid.propose([_View(Context(i, feats, np.asarray([5])), 5, [1, 2, 3])])
        heads.append(p.head == "dspark")
        if heads[-1]:
            hybrid.observe(0, 1, 0)  # one draft verified, refused
    assert all(heads[:4]), heads[:8]  # the prior's rounds
    assert 0 < sum(heads[4 * EXPLORE:]) <= 2, heads  # then its explorations only

@pytest.mark.parametrize("head", ["dspark", "mtp"])
@pytest.mark.parametrize("defer", [False, True])  # the prompts in the head's cache already, or in the backlogs
def test_an_exploration_drafts_for_the_slot_with_the_fewest_pending_rows(tiny_arts, head, defer):
    """Under load an exploration calls the head for one slot, the one whose backlog is shortest: the others keep
    theirs (the call writes nothing they will read) and their lookups, and count in none of the head's rounds. The
    next head round writes every backlog first and drafts what a head that saw every round drafts."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    rng = np.random.default_rng(3)
    F = max(h.feature_offset + h.feature_dim for h in manifest.heads.values())
    sizes = [14, 5, 21]  # prompt rows per slot: slot 1 has the fewest pending rows (the prompt's, if deferred)
    prompts = [Context(0, rng.normal(0, 1, (r, F)).astype(np.float32), rng.integers(3, 256, r)) for r in sizes]
    widths = [2, 1, 2]  # verified rows a round per slot (slot 1: the fewest either way)
    rounds = [[Context(r + k * w, rng.normal(0, 1, (w, F)).astype(np.float32), rng.integers(3, 256, w))
               for k in range(EXPLORE + 2)] for r, w in zip(sizes, widths)]
    histories = [[7, 8, 9, 4, 7, 8], [1, 2, 3], [5, 6, 5]]  # slot 0 and 2 find lookups, slot 1 none

    plain = GraphDrafter(art, manifest, head, threads=1)  # a head that sees every round
    plain.allocate(4)  # the artifact's batch: 3 slots take the propose bucket of 4
    pending = [plain.prefill(i, c) for i, c in enumerate(prompts)]
    for k in range(EXPLORE + 2):
        views = [_View(merge_first(pending[i], rounds[i][0]) if k == 0 else rounds[i][k], 9, histories[i])
                 for i in range(3)]
        if k == EXPLORE + 1:  # sampled: the drafts' distributions, which every cached row moves
            views = [_View(v.ctx, 9, [1, 2, 3], 1.0, np.random.default_rng(i)) for i, v in enumerate(views)]
        want = plain.propose(views)

    costs = _Costs()
    costs.draft = 1e9  # the head cannot pay: called on its exploration only
    hybrid = HybridDrafter(GraphDrafter(art, manifest, head, threads=1), costs, defer_prefill=defer)
    hybrid.allocate(4)
    pending = [hybrid.prefill(i, c) for i, c in enumerate(prompts)]
    assert all((x is None) == defer for x in pending)
    writes = []
    prefill = hybrid.head.prefill
    hybrid.head.prefill = lambda slot, ctx: writes.append(slot) or prefill(slot, ctx)
    for k in range(EXPLORE + 1):
        p = hybrid.propose([_View(merge_first(pending[i], rounds[i][0]) if k == 0 and not defer else rounds[i][k], 9,
                                  histories[i]) for i in range(3)])
        assert (p.head == head) == (k == EXPLORE)
        for i in range(3):
            hybrid.observe(i, int(p.counts[i]), 0)
    assert set(writes) == {1} and hybrid.held[:3].tolist() == [True, False, True]
    assert p.counts[1] == hybrid.head.steps and p.counts[0] > 0 and p.counts[2] > 0  # the held keep lookups
    assert [len(b) for b in hybrid.backlog[:3]] == [EXPLORE + 1 + defer, 0, EXPLORE + 1 + defer]
    hybrid._fold()
    assert hybrid.record.rounds == pytest.approx(DECAY * PRIOR_ROUNDS + 1)  # the explored slot's round only
    assert [r.rounds for r in hybrid.records[:3]] == pytest.approx([PRIOR_ROUNDS, DECAY * PRIOR_ROUNDS + 1,
                                                                     PRIOR_ROUNDS])
    costs.draft = 0.0
    hybrid.records[:3] = [Record(1e3, 4e3, 1e3) for _ in range(3)]  # their rounds paid: the head wins
    got = hybrid.propose([_View(rounds[i][-1], 9, [1, 2, 3], 1.0, np.random.default_rng(i)) for i in range(3)])
    assert got.head == head and not hybrid.held[:3].any() and hybrid.backlog[:3] == [[], [], []]
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.probs, want.probs, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("scheduler", ["sps", "sps-async"])
def test_a_head_alone_is_gated_under_the_cost_aware_schedulers(tiny_arts, scheduler):
    """`dspark` under sps / sps-async: the head is called only on the rounds where it promises more than a plain
    decoding step (the hybrid's choice without lookups). On a profile where its call costs 50 decoding steps it is
    called on the exploring rounds only, every other round decodes without a draft call, and the tokens are `ar`'s;
    on a profile where it is cheap it drafts on most rounds. Under fixed and threshold the head drafts every round."""
    art = tiny_arts("llama")
    prompts = _repetitive(256, 3, seed=4)
    reqs = [Request(prompt_ids=p, params=SamplingParams(max_new_tokens=96, ignore_eos=True), id=i)
            for i, p in enumerate(prompts)]
    want = [o.output_ids for o in Engine(art, method="ar", threads=1).generate(reqs)[0]]
    drafted = {}
    for draft_ms in (500.0, 0.01):
        _store_profile(art, draft_ms=draft_ms)
        with Engine(art, method="dspark", scheduler=scheduler, threads=1) as engine:
            assert isinstance(engine.drafter, HybridDrafter) and not engine.drafter.lookups
            outs, stats = engine.generate(reqs)
            rounds = engine.drafter.rounds
        assert [o.output_ids for o in outs] == want, draft_ms
        drafted[draft_ms] = rounds[HEAD] / (rounds[HEAD] + rounds[LOOKUP])
    assert drafted[500.0] <= 2 / EXPLORE and drafted[0.01] > 0.5, drafted
    with Engine(art, method="dspark", scheduler="fixed", threads=1) as engine:
        assert isinstance(engine.drafter, GraphDrafter)


def test_a_hybrid_s_lookups_survive_by_match_length(tiny_arts):
    """A hybrid's lookup drafts survive as its lookups of the same match length have been accepted (not one curve
    for all): a lookup round's outcome feeds that length's history only, a head round's the head's."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    costs = _Costs()
    costs.draft = 1e9  # the head cannot pay: lookups on every round but its explorations
    hybrid = HybridDrafter(GraphDrafter(art, manifest, "dspark", threads=1), costs)
    hybrid.allocate(2)
    feats = np.zeros((1, max(h.feature_offset + h.feature_dim for h in manifest.heads.values())), np.float32)
    views = [_View(Context(0, feats, np.asarray([3])), 3, [1, 2, 3, 9, 5, 1, 2, 3]),  # a 3-token match
             _View(Context(0, feats, np.asarray([7])), 7, [7, 4, 6, 7])]  # a 1-token one
    p = hybrid.propose(views)
    assert not p.head and hybrid.lookup.match.tolist() == [3, 1] and p.counts.tolist() == [4, 3]
    assert np.allclose(p.survival[0, :3], p.survival[1, :3])  # no outcome yet: both at the prior
    head_tries = hybrid.head_history.tries.sum()
    for _ in range(6):
        hybrid.observe(0, 3, 3)  # the 3-token match's drafts all accepted
        hybrid.observe(1, 3, 0)  # the 1-token match's first draft refused
    assert hybrid.head_history.tries.sum() == head_tries  # lookup rounds: not the head's record
    p = hybrid.propose(views)
    assert p.survival[0, 0] > 0.8 > 0.3 > p.survival[1, 0]
    assert p.survival[0, 1] == pytest.approx(p.survival[0, 0] * (2 * 0.8 + 6) / 8)  # LOOKUP_LATER's prior after
    hybrid.source[:] = HEAD
    hybrid.observe(0, 3, 1)
    assert hybrid.head_history.tries.sum() > head_tries
    assert hybrid.lookup.histories[3].tries[0] == 2 + 6  # unchanged by the head's round


@pytest.mark.parametrize("lazy", [False, True])
def test_lazy_lookups_skip_the_rounds_where_none_could_be_admitted(tiny_arts, lazy):
    """Under a cost-aware scheduler (`lazy`) a slot looks up only on the rounds where a lookup could be admitted
    (its first-position acceptance beats a plain step at these costs) or the head is called; the lookups that
    are made and the head's calls are those of a drafter that always looks up."""
    art = tiny_arts("llama")
    manifest = io.load_manifest(art)
    costs = _Costs()
    costs.draft = 1e9  # the head cannot pay: called on its explorations only
    hybrid = HybridDrafter(GraphDrafter(art, manifest, "dspark", threads=1), costs, lazy=lazy)
    hybrid.allocate(1)
    made = []
    propose = hybrid.lookup.propose
    hybrid.lookup.propose = lambda slots: made.append(1) or propose(slots)
    feats = np.zeros((1, max(h.feature_offset + h.feature_dim for h in manifest.heads.values())), np.float32)
    history = [7, 8, 9, 4, 7, 8]  # "7 8" occurred before: the lookup proposes 9, 4, ...
    for _ in range(40):  # lookups of every match length were verified 40 times, never accepted: 1 / 42 < 10.5 / 11 - 1
        for h in hybrid.lookup.histories:  # (_Costs)
            h.observe(1, 0)
    heads, drafted = [], []
    for i in range(2 * EXPLORE):
        p = hybrid.propose([_View(Context(i, feats, np.asarray([8])), 8, history)])
        heads.append(p.head == "dspark")
        drafted.append(int(p.counts[0]))
    assert heads == [i == EXPLORE for i in range(2 * EXPLORE)]  # its first exploration, either way
    if lazy:
        assert len(made) == sum(heads), made  # looked up only for the head's rounds
        assert all(d == 0 for d, h in zip(drafted, heads) if not h), drafted  # the rest decode
    else:
        assert len(made) == 2 * EXPLORE and all(d > 0 for d, h in zip(drafted, heads) if not h), drafted
    for _ in range(200):  # lookups of one match length that now are accepted: looked up again on every round
        hybrid.lookup.histories[3].observe(1, 1)
    made.clear()
    p = hybrid.propose([_View(Context(2 * EXPLORE, feats, np.asarray([8])), 8, history)])
    assert len(made) == 1 and p.counts[0] > 0


def test_a_shared_thread_pool_opt_in_gives_the_same_tokens(tiny_arts):
    """SPECRT_ORT_SHARED_POOL=1 (in a process of its own: ONNX Runtime's global pool is process-wide) puts every
    session on one pool sized by the first, an engine asking for another thread count included, and the
    tokens are those of per-session pools."""
    import json
    import os
    import subprocess
    import sys

    art = tiny_arts("llama")
    prompts = _repetitive(io.load_manifest(art).model.vocab_size, 3, seed=5)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with Engine(art, method="ar", threads=1) as engine:
        want = [r.output_ids for r in engine.generate([Request(q, params, id=i) for i, q in enumerate(prompts)])[0]]
    script = f"""
import json, sys
from specrt.runtime.backends import ort as bo
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams
out = {{}}
for method, threads in (("dspark", 2), ("mtp", 1)):
    with Engine({str(art)!r}, method=method, scheduler="fixed", threads=threads) as engine:
        got = engine.generate([Request(q, SamplingParams(max_new_tokens=20, ignore_eos=True), id=i)
                               for i, q in enumerate({prompts!r})])[0]
        out[method] = [r.output_ids for r in got]
out["pool"] = bo._shared_pool
print(json.dumps(out))
"""
    env = {**os.environ, "SPECRT_ORT_SHARED_POOL": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["pool"] == 2  # sized by the first engine's sessions
    assert got["dspark"] == want and got["mtp"] == want


def test_the_command_line_puts_its_sessions_on_one_pool_unless_told_not_to(tiny_arts):
    """`specrt` owns its process, so its sessions share one pool by default (own_process_defaults); with
    SPECRT_ORT_SHARED_POOL=0 each keeps its own. Both give the tokens of `ar`."""
    import json
    import os
    import subprocess
    import sys

    art = tiny_arts("llama")
    prompt = _repetitive(io.load_manifest(art).model.vocab_size, 1, seed=7)[0]
    with Engine(art, method="ar", threads=1) as engine:
        want = engine.generate([Request(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))])[0][0].output_ids
    script = f"""
import contextlib, io, json
from specrt.cli import main
from specrt.runtime.backends import ort as bo
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["run", {str(art)!r}, "--input-ids", {",".join(map(str, prompt))!r}, "--method", "dspark", "--scheduler",
          "fixed", "--max-new-tokens", "16", "--ignore-eos", "--threads", "2", "--json"], standalone_mode=False)
print(json.dumps({{"ids": json.loads(out.getvalue())["requests"][0]["output_ids"], "pool": bo._shared_pool}}))
"""
    for setting, pool in ((None, 2), ("0", None)):
        env = {k: v for k, v in os.environ.items() if k != "SPECRT_ORT_SHARED_POOL"}
        if setting is not None:
            env["SPECRT_ORT_SHARED_POOL"] = setting
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["pool"] == pool, setting
        assert got["ids"] == want, setting
