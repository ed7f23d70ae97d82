"""How far a bench's ratios can be trusted: paired per-prompt ratios, their median and a bootstrap interval.

Within one pass of an interleaved bench, two engines run the same prompt minutes apart at most, so the
ratio of their rates on that prompt is a paired measurement; the machine's slow drift cancels in it. The
median of those ratios over prompts and repeats is the reported speedup, and its 95% interval comes from a
two-stage bootstrap: prompts resampled with replacement, then each chosen prompt's repeats (the repeats of
one prompt are not independent of each other, the prompts are the sample).
"""
from __future__ import annotations

import warnings

import numpy as np

RESAMPLES = 2000
SEED = 0  # the interval of a given set of ratios is reproducible


def median_ci(ratios: np.ndarray, *, level: float = 0.95, resamples: int = RESAMPLES, seed: int = SEED
              ) -> dict | None:
    """`ratios` [prompts, repeats] (NaN where a pair has no ratio): {"median", "low", "high", "n"}; None if
    empty."""
    r = np.asarray(ratios, np.float64)
    r = r[~np.isnan(r).all(axis=1)]
    values = r[~np.isnan(r)]
    if not values.size:
        return None
    rng = np.random.default_rng(seed)
    n, k = r.shape
    prompts = rng.integers(0, n, size=(resamples, n))
    repeats = rng.integers(0, k, size=(resamples, n, k))
    picked = r[prompts[:, :, None], repeats]  # [resamples, n, k]
    with warnings.catch_warnings():  # a resample made only of prompts without a ratio has no median
        warnings.simplefilter("ignore", RuntimeWarning)
        medians = np.nanmedian(picked.reshape(resamples, -1), axis=1)
    lo, hi = np.nanpercentile(medians, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return {"median": round(float(np.median(values)), 4), "low": round(float(lo), 4), "high": round(float(hi), 4),
            "n": int(values.size)}


def fmt(ci: dict | None) -> str:
    """1.23x [1.10, 1.31]"""
    return "-" if ci is None else f"{ci['median']:.2f}x [{ci['low']:.2f}, {ci['high']:.2f}]"
