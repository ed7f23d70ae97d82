"""The acceptance rules on synthetic distributions: greedy prefix match, and rejection sampling whose
committed tokens follow the target distribution exactly (chi-square with a fixed seed)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import torch

from specrt.runtime import steps
from specrt.runtime.acceptance import accept_sampled
from specrt.runtime.sampling import SamplingParams, distribution


def _greedy(drafts, logits, length=None):
    """steps.accept on one slot (numpy) and on the same slot as torch tensors: (accepted, bonus), which agree."""
    t = logits.shape[0]
    best = np.argmax(logits, -1)[None]
    d = np.zeros((1, t - 1), np.int64)
    d[0, :len(drafts)] = drafts
    ell = np.array([len(drafts) if length is None else length])
    a, tokens = steps.accept(d, best, ell)
    ta, ttokens = steps.accept(torch.from_numpy(d), torch.from_numpy(best), torch.from_numpy(ell))
    assert int(ta[0]) == int(a[0]) and ttokens.tolist() == tokens.tolist()
    assert tokens[0, :a[0]].tolist() == list(drafts[:a[0]])  # the accepted drafts come first
    return int(a[0]), int(tokens[0, a[0]])


def test_greedy_accepts_the_matching_prefix_and_adds_the_target_token():
    logits = np.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 1, 9]):
        logits[row, tok] = 5.0
    assert _greedy(np.array([3, 7, 1]), logits) == (3, 9)  # all accepted: the bonus comes from the last row
    assert _greedy(np.array([3, 2, 1]), logits) == (1, 7)  # mismatch at the second draft: the target's token
    assert _greedy(np.array([4, 7, 1]), logits) == (0, 3)
    assert _greedy(np.array([], dtype=np.int64), logits[:1]) == (0, 3)  # no drafts: a plain autoregressive step
    assert _greedy(np.array([3, 7, 1]), logits, length=1) == (1, 7)  # verified up to the length only


def test_cap_and_advance_on_both_namespaces():
    for xp in (np, torch):
        arr = (lambda v: np.asarray(v, np.int64)) if xp is np else (lambda v: torch.tensor(v, dtype=torch.int64))
        active = np.array([True, True, True, False]) if xp is np else torch.tensor([True, True, True, False])
        lengths = steps.cap(arr([4, 2, 5, 3]), arr([4, 4, 1, 4]), arr([10, 10, 2, 10]), active, 3)
        assert lengths.tolist() == [3, 2, 1, 0]  # gamma, planned, counts and budget - 1 cap; idle slots verify 0
        length, budget, anchor = arr([10, 20, 30, 40]), arr([9, 9, 9, 9]), arr([1, 2, 3, 4])
        steps.advance(length, budget, anchor, arr([2, 0, 1, 5]), arr([7, 8, 9, 6]), active)
        assert (length.tolist(), budget.tolist(), anchor.tolist()) == ([13, 21, 32, 40], [6, 8, 7, 9], [7, 8, 9, 4])


def _chi2_matches(samples: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of a chi-square goodness-of-fit test, pooling bins with small expected counts."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert counts[probs == 0].sum() == 0, "a token with zero target probability was emitted"
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("draft", ["good", "bad", "disjoint"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "topk", "topp"])
def test_rejection_sampling_commits_tokens_from_the_target_distribution(draft, params):
    if draft == "disjoint" and params.top_k == 0 and params.top_p == 1.0:
        pytest.skip("a draft disjoint from the target needs tokens the target never emits (top-k/top-p)")
    rng = np.random.default_rng(1234)
    vocab, gamma, trials = 12, 3, 20_000
    target_logits = rng.normal(size=(gamma + 1, vocab)) * 1.5
    p = [distribution(row, params) for row in target_logits]
    if draft == "good":  # close to the target: most drafts accepted
        q = [0.8 * pk + 0.2 / vocab for pk in p[:gamma]]
    elif draft == "bad":  # unrelated to the target
        q = [np.exp(x) / np.exp(x).sum() for x in rng.normal(size=(gamma, vocab)) * 2.0]
    else:  # all mass on tokens the target never emits: every draft rejected
        q = []
        for pk in p[:gamma]:
            qk = (pk == 0).astype(float)
            q.append(qk / qk.sum())
    q = np.stack(q)
    first, second, accepted = [], [], []
    for _ in range(trials):
        drafts = np.array([rng.choice(vocab, p=qk) for qk in q])
        v = accept_sampled(drafts, q, target_logits, params, rng)
        tokens = [*drafts[:v.accepted], v.bonus]
        first.append(tokens[0])
        accepted.append(v.accepted)
        if len(tokens) > 1:  # the second committed token, when this round produced one
            second.append(tokens[1])
    # Every committed position is a draw from the target's distribution at that position, whatever q is.
    assert _chi2_matches(np.array(first), p[0]) > 1e-3
    if draft != "disjoint":
        assert _chi2_matches(np.array(second), p[1]) > 1e-3
    mean_acc = np.mean(accepted)
    if draft == "good":
        assert mean_acc > 1.0
    if draft == "disjoint":
        assert mean_acc == 0.0


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["t1", "topk"])
def test_one_hot_drafts_commit_tokens_from_the_target_distribution(params):
    """Deterministic drafts (n-gram lookup, draft_probs=None): accepted with probability p(d), else the
    bonus is drawn from p without d; every committed position still follows p exactly."""
    rng = np.random.default_rng(99)
    vocab, trials = 10, 20_000
    target_logits = rng.normal(size=(3, vocab)) * 1.5
    p = [distribution(row, params) for row in target_logits]
    drafts = np.array([int(np.argmax(p[0])), int(np.argsort(p[1])[-2])])  # a likely and a less likely draft
    first, second, accepted = [], [], []
    for _ in range(trials):
        v = accept_sampled(drafts, None, target_logits, params, rng)
        tokens = [*drafts[:v.accepted], v.bonus]
        first.append(tokens[0])
        accepted.append(v.accepted)
        if len(tokens) > 1:
            second.append(tokens[1])
    assert _chi2_matches(np.array(first), p[0]) > 1e-3
    assert _chi2_matches(np.array(second), p[1]) > 1e-3
    assert abs(np.mean(np.array(accepted) >= 1) - p[0][drafts[0]]) < 0.02  # accepted with probability p(d)
