"""Sampling parameters and the token distribution they define (applied identically to target and draft)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.arrays import Array, namespace

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


def warp(logits: Array, temperature: Array, top_k: Array, top_p: Array, *, filters: tuple[bool, bool] | None = None
         ) -> Array:
    """Probabilities (float64) after temperature, top-k and top-p over the last axis, row by row: `temperature`,
    `top_k` (0: off) and `top_p` (1.0: off) have the logits' leading shape. Written on the array API (numpy on the
    host, torch on the device round's device). `filters`: whether any row uses top-k / top-p, where the caller knows
    (a device round: no host synchronisation); else read from the arrays.

    Top-k keeps the tokens at least as large as the k-th largest; top-p then keeps the smallest prefix, in order of
    probability (ties in token order), whose mass reaches top_p (the token crossing the line stays)."""
    xp = namespace(logits)
    if isinstance(logits, np.ndarray) and logits.ndim == 1 and 0 < int(top_k) < logits.shape[-1]:
        p = _top_k_row(logits, float(temperature), int(top_k), float(top_p))
        if p is not None:
            return p
    x = xp.astype(logits, xp.float64) / xp.astype(temperature, xp.float64)[..., None]
    v = x.shape[-1]
    if filters is None:
        filters = (bool(xp.any((top_k > 0) & (top_k < v))), bool(xp.any(top_p < 1.0)))
    if filters[0]:
        keep = (x >= _kth_largest(x, top_k)) | ((top_k <= 0) | (top_k >= v))[..., None]
        p = xp.where(keep, xp.exp(x - xp.max(x, axis=-1, keepdims=True)), xp.zeros_like(x))
    else:
        p = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
    p = p / xp.sum(p, axis=-1, keepdims=True)
    if filters[1] and filters[0] and isinstance(p, np.ndarray) and p.ndim == 1:  # the host's row after top-k: sort only
        live = np.flatnonzero(p)  # the tokens top-k kept (the same prefix sums, in the same order)
        order = live[np.argsort(-p[live], kind="stable")]
        sorted_p = p[order]
        p = p.copy()
        p[order[(np.cumsum(sorted_p) - sorted_p) >= float(top_p)]] = 0.0
        return p / p.sum()
    if filters[1]:
        order = xp.argsort(-p, axis=-1, stable=True)
        sorted_p = xp.take_along_axis(p, order, axis=-1)
        drop_sorted = (xp.cumulative_sum(sorted_p, axis=-1) - sorted_p) >= xp.astype(top_p, xp.float64)[..., None]
        drop = xp.take_along_axis(drop_sorted, _inverse(order), axis=-1) & (top_p < 1.0)[..., None]
        p = xp.where(drop, xp.zeros_like(p), p)
        p = p / xp.sum(p, axis=-1, keepdims=True)
    return p


def _top_k_row(logits: np.ndarray, temperature: float, k: int, top_p: float) -> np.ndarray | None:
    """`warp` of one host row with top-k, bit for bit, its exponentials computed on the kept tokens only (a sampled
    host round calls it once a slot, and the whole vocabulary's float64 softmax cost ~2 ms a row). Dividing by a
    temperature > 0 keeps the order of float32 logits, so the kept set is the logits' k largest (and their ties);
    the sums run over the whole row as in `warp`. None (use the general path) when no token passes: NaN logits."""
    kth = np.partition(logits, -k)[-k]
    live = np.flatnonzero(logits >= kth)
    if live.size == 0:
        return None
    x = logits[live].astype(np.float64) / temperature
    p = np.zeros(logits.shape[-1])
    p[live] = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:  # the smallest prefix by probability (ties in token order) whose mass reaches top_p
        live = live[p[live] > 0]
        order = live[np.argsort(-p[live], kind="stable")]
        sorted_p = p[order]
        p[order[(np.cumsum(sorted_p) - sorted_p) >= top_p]] = 0.0
        p /= p.sum()
    return p


def _kth_largest(x: Array, k: Array) -> Array:
    """[..., 1]: each row's k-th largest value (k clipped to 1..V)."""
    xp = namespace(x)
    v = x.shape[-1]
    k = xp.clip(k, min=1, max=v)
    if isinstance(x, np.ndarray) and (k.size == 0 or (k == k.flat[0]).all()):  # one k (the host's case): a partition
        kk = int(k.flat[0]) if k.size else 1
        return np.partition(x, -kk, axis=-1)[..., -kk, None]
    ordered = -xp.sort(-x, axis=-1)  # descending (numpy's sort has no such flag)
    return xp.take_along_axis(ordered, xp.astype(k, xp.int64)[..., None] - 1, axis=-1)


def _inverse(order: Array) -> Array:
    """The inverse of permutations `order` along the last axis (a scatter; the array API standard has none)."""
    if isinstance(order, np.ndarray):
        inv = np.empty_like(order)
        np.put_along_axis(inv, order, np.broadcast_to(np.arange(order.shape[-1]), order.shape), axis=-1)
        return inv
    return namespace(order).argsort(order, axis=-1)


def draw(probs: Array, u: Array) -> Array:
    """Tokens drawn by inverse CDF from distributions probs [..., V] with uniforms u [...] in [0, 1): the first token
    whose cumulative mass exceeds u x the total (so a token of zero probability is never drawn)."""
    xp = namespace(probs)
    cdf = xp.cumulative_sum(probs, axis=-1)
    total = cdf[..., -1:]
    x = xp.minimum(xp.astype(u, cdf.dtype)[..., None] * total, xp.nextafter(total, xp.zeros_like(total)))
    if isinstance(cdf, np.ndarray) and cdf.ndim == 1:  # one row (the host's case): a binary search finds the same token
        return np.searchsorted(cdf, x, side="right")[0]
    return xp.count_nonzero(cdf <= x, axis=-1)  # u x total rounding up to the total stays below it


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top-k and top-p over the last axis (float64 for exactness): `warp` with one
    request's parameters."""
    lead = logits.shape[:-1]
    return warp(logits, np.full(lead, params.temperature), np.full(lead, params.top_k), np.full(lead, params.top_p),
                filters=(0 < params.top_k < logits.shape[-1], params.top_p < 1.0))


INVALID = "sampling got an invalid distribution (NaN, inf or all zero); the logits or parameters are broken"


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a 1-D distribution by inverse CDF (`draw`), over its nonzero entries only: adding a
    zero leaves a cumulative sum as it is, so the tokens' CDF values, and the token drawn, are the full row's."""
    live = np.flatnonzero(probs)  # NaN is nonzero: it reaches the check below
    q = probs[live]
    total = q.sum()
    if not 0.0 < total < np.inf or not (q > 0).all():  # NaN fails this too: never draw from a broken one
        raise SpecrtError(INVALID)
    return int(live[draw(q, np.asarray(rng.random()))])


def draw_row(probs: np.ndarray, u: float) -> int:
    """`draw` of one host row [V] with uniform u, over its nonzero entries only (the same token, see `sample`)."""
    live = np.flatnonzero(probs)
    if live.size == 0:
        raise SpecrtError(INVALID)
    return int(live[draw(probs[live], np.asarray(u))])


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy argmax or a draw from `distribution` for one row of logits."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(distribution(logits, params), rng)
