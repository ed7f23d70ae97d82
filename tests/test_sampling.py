"""Sampling: the distribution temperature/top-k/top-p define, draws from it, parameter validation."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import special, stats

from specrt.errors import SpecrtError
from specrt.runtime.sampling import SamplingParams, distribution, next_token, sample


def logits(n: int = 50, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, size=n).astype(np.float32)


def P(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.5, 10.0])
def test_temperature_scaling(temperature):
    x = logits()
    p = distribution(x, P(temperature=temperature))
    assert p.dtype == np.float64
    np.testing.assert_allclose(p, special.softmax(x.astype(np.float64) / temperature), rtol=1e-12, atol=1e-15)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)


def test_temperature_sharpens_and_flattens():
    x = logits()
    entropy = [stats.entropy(distribution(x, P(temperature=t))) for t in (0.3, 1.0, 3.0)]
    assert entropy[0] < entropy[1] < entropy[2]
    assert distribution(x, P(temperature=1e-3)).argmax() == x.argmax()
    assert distribution(x, P(temperature=1e-3)).max() > 0.999


@pytest.mark.parametrize("k", [1, 2, 7, 49, 50, 1000])
def test_top_k_keeps_exactly_k(k):
    x = logits()
    p = distribution(x, P(top_k=k))
    kept = np.flatnonzero(p)
    n = min(k, x.size)
    assert kept.size == n
    assert set(kept) == set(np.argsort(-x)[:n])
    np.testing.assert_allclose(p[kept], special.softmax(x[kept].astype(np.float64)), rtol=1e-12)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)


def test_top_k_zero_is_off():
    x = logits()
    np.testing.assert_array_equal(distribution(x, P(top_k=0)), distribution(x, P()))


@pytest.mark.parametrize("top_p", [1e-6, 0.1, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p):
    x = logits(seed=3)
    full = distribution(x, P())
    order = np.argsort(-full)
    cum = np.cumsum(full[order])
    n = int(np.searchsorted(cum, top_p) + 1)  # first prefix whose mass is >= top_p
    assert cum[n - 1] >= top_p and (n == 1 or cum[n - 2] < top_p)
    p = distribution(x, P(top_p=top_p))
    kept = np.flatnonzero(p)
    assert set(kept) == set(order[:n])
    np.testing.assert_allclose(p[kept], full[kept] / full[kept].sum(), rtol=1e-12)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)


def test_top_p_boundary_exact_mass():
    # probabilities 0.5, 0.25, 0.125, 0.125: top_p 0.75 is reached exactly by the first two
    x = np.log(np.array([0.125, 0.5, 0.125, 0.25]))
    np.testing.assert_allclose(distribution(x, P(top_p=0.75)), [0, 2 / 3, 0, 1 / 3], atol=1e-12)
    np.testing.assert_allclose(distribution(x, P(top_p=0.5)), [0, 1, 0, 0], atol=1e-12)
    np.testing.assert_allclose(distribution(x, P(top_p=0.51)), [0, 2 / 3, 0, 1 / 3], atol=1e-12)


def test_top_k_then_top_p():
    x = logits(seed=4)
    p = distribution(x, P(top_k=10, top_p=0.6))
    top10 = distribution(x, P(top_k=10))
    order = np.argsort(-top10)
    n = int(np.searchsorted(np.cumsum(top10[order]), 0.6) + 1)
    assert set(np.flatnonzero(p)) == set(order[:n]) and n <= 10
    assert p.sum() == pytest.approx(1.0, abs=1e-12)


def _full_sort_reference(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The filters by their definition: mask below the k-th logit, softmax, then sort the whole row for top-p."""
    z = x.astype(np.float64) / params.temperature
    if params.top_k:
        z = np.where(z < np.sort(z, axis=-1)[..., -params.top_k, None], -np.inf, z)
    q = np.exp(z - z.max(axis=-1, keepdims=True))
    q /= q.sum(axis=-1, keepdims=True)
    order = np.argsort(-q, axis=-1, kind="stable")
    sorted_q = np.take_along_axis(q, order, axis=-1)
    drop = np.zeros(q.shape, bool)
    np.put_along_axis(drop, order, (np.cumsum(sorted_q, axis=-1) - sorted_q) >= params.top_p, axis=-1)
    q = np.where(drop, 0.0, q)
    return q / q.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_fast_path_equals_full_sort(seed):
    """With top-k set, top-p sorts only the tokens top-k kept: the same tokens survive, bit for bit, ties included
    (rounded logits), for single rows, batches and a full-size vocabulary."""
    rng = np.random.default_rng(seed)
    vocab = 49152 if seed == 0 else int(rng.integers(30, 3000))
    x = rng.normal(0, 3, size=(3, vocab) if seed % 2 else vocab).astype(np.float32)
    if seed % 3 == 0:
        x = np.round(x)
    params = P(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.integers(1, 64)),
               top_p=float(rng.uniform(0.1, 0.99)))
    assert np.array_equal(distribution(x, params), _full_sort_reference(x, params))


def test_batched_rows_match_single_rows():
    x = np.stack([logits(seed=s) for s in range(4)])
    params = P(temperature=0.8, top_k=20, top_p=0.9)
    p = distribution(x, params)
    assert p.shape == x.shape
    for row, xs in zip(p, x):
        np.testing.assert_allclose(row, distribution(xs, params), rtol=1e-12)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-12)


def test_extreme_logits_stay_finite():
    x = np.array([1e4, -1e4, 0.0, 3e4], np.float32)
    p = distribution(x, P(temperature=0.5))
    assert np.isfinite(p).all() and p.argmax() == 3 and p.sum() == pytest.approx(1.0)
    x16 = np.array([60000, -60000, 0, 100], np.float16)  # fp16 logits from a float16 artifact
    assert np.isfinite(distribution(x16, P())).all()


@pytest.mark.parametrize("params", [P(), P(temperature=0.7, top_k=8), P(top_p=0.9)])
def test_sample_frequencies_match_probabilities(params):
    probs = distribution(logits(20, seed=5), params)
    rng = np.random.default_rng(1234)
    n = 20000
    counts = np.bincount([sample(probs, rng) for _ in range(n)], minlength=probs.size)
    support = probs > 0
    assert counts[~support].sum() == 0  # filtered tokens are never drawn
    expected, observed = probs[support] * n, counts[support]
    small = expected < 5  # chi-square needs >= 5 expected per cell: pool the rare tokens into one cell
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    chi2, pvalue = stats.chisquare(observed, expected)
    assert pvalue > 1e-3, (chi2, pvalue)


def test_sample_never_draws_zero_probability_tokens():
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    rng = np.random.default_rng(0)
    draws = {sample(probs, rng) for _ in range(2000)}
    assert draws == {1, 3}
    assert sample(np.array([0.0, 0.0, 1.0]), rng) == 2


def test_sample_is_reproducible_with_a_seed():
    probs = distribution(logits(), P())
    a = [sample(probs, np.random.default_rng(9)) for _ in range(3)]
    b = [sample(probs, np.random.default_rng(9)) for _ in range(3)]
    assert a == b


def test_next_token_greedy_and_sampled():
    x = logits()
    rng = np.random.default_rng(0)
    assert next_token(x, SamplingParams(), rng) == int(np.argmax(x))
    assert next_token(x, P(top_k=1), rng) == int(np.argmax(x))
    draws = {next_token(x, P(), rng) for _ in range(200)}
    assert len(draws) > 1


@pytest.mark.parametrize("kw, fragment", [
    ({"temperature": -0.1}, "--temperature"),
    ({"temperature": float("nan")}, "--temperature"),
    ({"temperature": float("inf")}, "--temperature"),
    ({"top_k": -1}, "--top-k"),
    ({"top_p": 0.0}, "--top-p"),
    ({"top_p": -0.5}, "--top-p"),
    ({"top_p": 1.01}, "--top-p"),
    ({"max_new_tokens": 0}, "--max-new-tokens"),
    ({"max_new_tokens": -5}, "--max-new-tokens"),
    ({"seed": -1}, "--seed"),
])
def test_sampling_params_validation(kw, fragment):
    with pytest.raises(SpecrtError, match=fragment):
        SamplingParams(**kw)


def test_sampling_params_defaults_and_edges():
    p = SamplingParams()
    assert p.greedy and p.top_k == 0 and p.top_p == 1.0 and p.max_new_tokens == 128 and p.stop_strings == ()
    assert not SamplingParams(temperature=0.5).greedy
    SamplingParams(top_p=1.0, top_k=0, max_new_tokens=1, seed=0, temperature=0.0)
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen


def test_a_vanishing_temperature_is_greedy_and_nothing_non_finite_is_sampled():
    """temperature 1e-308 once turned the probabilities into NaN and the reply into garbage."""
    from specrt.errors import SpecrtError
    from specrt.runtime.sampling import MIN_TEMPERATURE, SamplingParams, distribution, next_token, sample

    logits = np.array([0.5, 3.0, 2.999, -1.0], np.float32)
    rng = np.random.default_rng(0)
    for t in (1e-308, 5e-324, MIN_TEMPERATURE / 2):
        params = SamplingParams(temperature=t)
        assert params.greedy and params.temperature == 0.0
        assert next_token(logits, params, rng) == 1
    p = distribution(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0)
    for bad in (np.array([np.nan, 0.5]), np.array([np.inf, 1.0]), np.zeros(3)):
        with pytest.raises(SpecrtError, match="invalid distribution"):
            sample(bad, rng)
