"""Acceptance of drafted tokens by Leviathan/Chen rejection sampling (greedy acceptance, a prefix match against the
target's argmax, is runtime/steps.py's `accept`, shared with the device round).

Sampling: accept d_k with probability min(1, p(d_k) / q(d_k)); on the first rejection draw the bonus
from norm(max(0, p - q)); if all are accepted draw it from p at the next position. The committed
tokens then follow the target distribution p exactly, whatever the draft distribution q is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.runtime.sampling import SamplingParams, distribution, sample


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: int  # a: drafts accepted (a prefix of the proposal)
    bonus: int  # the target's token at position a (correction or continuation)


def accept_sampled(drafts: np.ndarray, draft_probs: np.ndarray | None, target_logits: np.ndarray,
                   params: SamplingParams, rng: np.random.Generator) -> Verdict:
    """Rejection sampling; draft_probs [l, V] is the distribution each draft was drawn from, None for
    deterministic (one-hot) drafts such as n-gram lookups."""
    for k, x in enumerate(drafts):
        p = distribution(target_logits[k], params)
        if draft_probs is None:  # q = one-hot(x): accept with probability p(x), else resample from p without x
            if rng.random() < p[x]:
                continue
            residual = p.copy()
            residual[x] = 0.0
            mass = residual.sum()
            return Verdict(k, sample(residual / mass if mass > 1e-12 else p, rng))
        q = draft_probs[k].astype(np.float64)
        # q(x) > 0: x was drawn from q. Accept with probability min(1, p/q): u < p/q  <=>  u*q < p.
        if rng.random() * q[x] < p[x]:
            continue
        residual = np.maximum(p - q, 0.0)
        mass = residual.sum()
        return Verdict(k, sample(residual / mass if mass > 1e-12 else p, rng))
    return Verdict(len(drafts), sample(distribution(target_logits[len(drafts)], params), rng))
