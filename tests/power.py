"""How many samples a distribution test needs: the sampling tests draw just enough requests for their chi-square
goodness-of-fit test (rejecting at p < ALPHA) to catch a given deviation from the exact distribution with a given
power, rather than a round number.

The deviation is Cohen's effect size w = sqrt(sum((p' - p)^2 / p)) of the emitted distribution p' from the exact p;
the test's statistic then follows a noncentral chi-square with noncentrality n w^2, so the power at n samples is
P(chi2(df, n w^2) > the central chi2(df)'s 1 - ALPHA quantile). The default W = 0.15 is about half the deviation of
the classic rejection-sampling bug (after a rejection, drawing from p instead of the residual max(p - q, 0)) in the
toy case of test_schedulers' admission test (w = 0.32 there). Checked with that bug put into runtime/acceptance.py:
at these sizes it fails test_speculative's host and device tests and test_draft_vocab's (chi-square p < 1e-20);
the scheduler and hybrid tests, whose heads are bad (their residual is nearly p) or whose drafts are lookups, did
not catch it at their earlier 12,000 requests either: they test that the schedule keeps the distribution.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2

ALPHA = 1e-3  # the sampling tests' threshold: p < ALPHA fails
W = 0.15
POWER = 0.99


def _bins(probs: np.ndarray, n: int) -> int:
    """The chi-square's cells at n samples as test_speculative._pvalue makes them: those expecting >= 5, the rest
    pooled into one."""
    expected = np.asarray(probs, dtype=float).ravel() * n
    big = int((expected >= 5).sum())
    return big + int(expected[expected < 5].sum() > 0)


def samples_for(probs: np.ndarray, *, w: float = W, power: float = POWER, alpha: float = ALPHA) -> int:
    """The fewest samples at which the test of `probs` rejects a deviation of size `w` with probability `power`."""
    n = 1000
    for _ in range(20):  # the cells depend on n, n on the cells: iterate to the fixed point
        df = max(_bins(probs, n) - 1, 1)
        critical = chi2.isf(alpha, df)
        lam = brentq(lambda x: ncx2.sf(critical, df, x) - power, 1e-6, 1e6)
        need = math.ceil(lam / w**2)
        if need == n:
            break
        n = need
    return n
