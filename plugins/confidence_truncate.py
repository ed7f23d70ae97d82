"""specrt::ConfidenceTruncate: calibrated prefix survival of a DSpark block and the verify lengths it implies.

Schema (the op every backend implements; this numpy function is its reference):

    inputs   logits        f32 [B, γ]   raw confidence-head logits, draft position k = 0..γ-1
             temperatures  f32 [γ]      STS temperature per position (the artifact's HeadSpec.temperatures)
             threshold     f32 []       cut each row where survival drops below it (used when budget < 0)
             budget        i64 []       total drafts to verify over the batch (>= 0), or -1 for threshold mode
    outputs  survival      f32 [B, γ]   a[b, k] = Π_{i<=k} sigmoid(logits[b, i] / temperatures[i])
             lengths       i64 [B]      drafts to verify per row

threshold mode: lengths[b] = #{k : a[b, k] >= threshold} (a is non-increasing along k, so that is a prefix).
budget mode:    the `budget` (b, k) pairs of largest survival over the whole batch (pairs with survival 0, which
                float32 sigmoids reach only for logits below -100, never), ties broken by lower k then lower b;
                because a is non-increasing along k, the admitted pairs of each row form a prefix, and
                lengths[b] counts them.

Nothing here looks at whether a draft will be accepted, only at the draft's own confidence, which is what keeps
speculative decoding exact under any schedule (DSpark paper, Appendix A).
"""
from __future__ import annotations

import numpy as np


def survival(logits: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """a[b, k] = Π_{i<=k} sigmoid(logits[b, i] / T_i), in float32 like the kernels."""
    z = np.asarray(logits, np.float32) / np.asarray(temperatures, np.float32)
    return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=-1, dtype=np.float32).astype(np.float32)


def truncate(logits: np.ndarray, temperatures: np.ndarray, threshold: float = 0.0, budget: int = -1
             ) -> tuple[np.ndarray, np.ndarray]:
    """(survival [B, γ] f32, lengths [B] i64): the reference of specrt::ConfidenceTruncate."""
    a = survival(logits, temperatures)
    if budget < 0:
        return a, (a >= np.float32(threshold)).sum(axis=-1).astype(np.int64)
    return a, admit(a, budget)


def admit(a: np.ndarray, budget: int) -> np.ndarray:
    """Budget mode on survivals a [B, γ]: per row, how many of the `budget` best (b, k) pairs fall in it."""
    b, g = a.shape
    flat = a.ravel()
    order = np.lexsort((np.repeat(np.arange(b), g), np.tile(np.arange(g), b), -flat))
    taken = order[:max(0, budget)]
    return np.bincount(taken[flat[taken] > 0] // g, minlength=b).astype(np.int64)
