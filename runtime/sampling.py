"""Sampling parameters and the token distribution they define (applied identically to target and draft)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specrt.errors import SpecrtError

# Below this a temperature is greedy, as in vLLM: dividing logits by it would overflow to inf (and the softmax to
# NaN) long before 1e-307, and its distribution is the argmax's to within exp(-gap / 1e-5) for any logit gap.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end the request like EOS (kept in output)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SpecrtError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k < 0:
            raise SpecrtError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecrtError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise SpecrtError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and self.seed < 0:
            raise SpecrtError(f"--seed must be >= 0, got {self.seed}")
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:  # ids past the vocabulary are the engine's to reject: only it knows the vocabulary
            raise SpecrtError(f"--stop-token-id must be >= 0, got {bad[0]}")
        if "" in self.stop_strings:
            raise SpecrtError("--stop must not be empty (it would stop every request at once)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top-k and top-p over the last axis (float64 for exactness)."""
    x = logits.astype(np.float64) / params.temperature
    top_k = 0 < params.top_k < x.shape[-1]
    if top_k:
        kth = np.partition(x, -params.top_k, axis=-1)[..., -params.top_k, None]
        keep = x >= kth
        x -= x.max(axis=-1, keepdims=True)
        p = np.zeros_like(x)
        p[keep] = np.exp(x[keep])  # exp(-inf) over the whole vocabulary is ~10x slower than these few exps
    else:
        p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        if top_k:
            _top_p_after_top_k(p, params.top_p)
        else:
            order = np.argsort(-p, axis=-1, kind="stable")
            sorted_p = np.take_along_axis(p, order, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing the line stays)
            drop_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) >= params.top_p
            drop = np.zeros_like(drop_sorted)
            np.put_along_axis(drop, order, drop_sorted, axis=-1)
            p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def _top_p_after_top_k(p: np.ndarray, top_p: float) -> None:
    """The top-p cut in place, sorting only the tokens top-k left: the same prefix sums, in the same order, as
    sorting the whole row (zeros sort last, ties stay in index order), so the same tokens are dropped."""
    for row in p.reshape(-1, p.shape[-1]):
        live = np.flatnonzero(row)
        order = live[np.argsort(-row[live], kind="stable")]
        sorted_p = row[order]
        row[order[(np.cumsum(sorted_p) - sorted_p) >= top_p]] = 0.0


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a 1-D distribution by inverse CDF (over its nonzero entries: the same sums, and
    the zeros between them are never drawn)."""
    live = np.flatnonzero(probs)
    cdf = np.cumsum(probs[live])
    if not len(cdf) or not 0.0 < cdf[-1] < np.inf:  # NaN fails this too: never draw from a broken distribution
        raise SpecrtError("sampling got an invalid distribution (NaN, inf or all zero); the logits or parameters "
                          "are broken")
    return int(live[min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(live) - 1)])


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy argmax or a draw from `distribution` for one row of logits."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(distribution(logits, params), rng)
