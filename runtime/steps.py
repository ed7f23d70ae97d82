"""The round's array steps, written once on the array API: the host loop runs them on numpy arrays, the device
round (runtime/device_round.py) on torch tensors of the torch backend's device, inside its CUDA graph.

    survive  prefix survivals [n, γ] of a proposal, zero past the drafts each slot has
    plan     the schedulers' lengths from survivals: `threshold` (the cut), `admission` (sps: the DSpark paper's
             Algorithm 1 on a cost curve), `admit` (sps-async: the best `budget` pairs over the batch)
    cap      verify lengths: the scheduler's, capped by the drafts proposed, gamma and each request's budget
    best     the target's argmax at every grid cell of a (dense or packed) verify call
    accept   greedy: the longest prefix of drafts equal to the argmax before them; the bonus is the argmax there
    advance  commit on slot state arrays: length and budget grow by a + 1, the bonus becomes the anchor

Sampled acceptance (rejection sampling with uniforms drawn from each request's rng) is runtime/acceptance.py's.
"""
from __future__ import annotations

from specrt.runtime.arrays import Array, device, namespace


def survive(a: Array, counts: Array) -> Array:
    """Survivals a [n, γ] with 0 past each slot's counts[i] drafts (never verified, never admitted)."""
    xp = namespace(a)
    within = xp.arange(a.shape[1], device=device(a))[None, :] < counts[:, None]
    return xp.where(within, a, xp.zeros_like(a))


def threshold(a: Array, cut: float) -> Array:
    """[n] drafts whose prefix survival is at least `cut` (a is non-increasing along a row: a prefix)."""
    xp = namespace(a)
    return xp.sum(xp.astype(a >= cut, xp.int64), axis=1)


def admission(a: Array, active: Array, fixed_ms: Array | float, verify_ms: Array, explore: Array | None = None
              ) -> tuple[Array, Array, Array]:
    """Algorithm 1 on survivals a [n, γ] of the `active` rows: (lengths [n], the round's expected committed tokens
    per ms, whether a pair was admitted to explore).

    `verify_ms` [P + 1]: the cost of a verify call of n slots over p tokens in all, for p = 0..P (float64; tokens
    past P cost verify_ms[P]); `fixed_ms`: the draft side of the round. Every active slot verifies its anchor and
    commits a bonus token, so the round starts at (active slots) tokens; each admitted (slot, k) pair adds one
    token and a[slot, k] expected tokens. Pairs are taken in order of survival (ties: lower k, then lower slot)
    while the rate improves; the first pair that does not improve it ends admission. `explore` [P + 1] marks the
    calls whose cost the table wants measured: if it marks the call of one pair fewer, the last pair admitted is left
    out (a cost believed too high below the stopping point, the decoding step's above all, is never measured by the
    rounds it makes longer); else, if it marks the call that first pair would make, that pair is admitted too.
    Sums run in the order pairs are admitted, in float64, so every array library gives the same lengths."""
    xp = namespace(a)
    n, g = a.shape
    dev = device(a)
    base = xp.sum(xp.astype(active, xp.float64))
    values = xp.where(active[:, None], xp.astype(a, xp.float64), xp.zeros((n, g), dtype=xp.float64, device=dev))
    flat = xp.reshape(xp.permute_dims(values, (1, 0)), (-1,))  # k-major: equal survivals ordered by k, then slot
    order = xp.argsort(-flat, stable=True)
    v = xp.take(flat, order)
    expected = xp.cumulative_sum(xp.concat([xp.reshape(base, (1,)), v]))  # expected[j]: after j admitted pairs
    start = xp.astype(base, xp.int64)
    tokens = start + xp.arange(n * g + 1, device=dev)
    cost = xp.take(verify_ms, xp.clip(tokens, max=verify_ms.shape[0] - 1))
    rate = expected / (fixed_ms + cost)
    better = (rate[1:] > rate[:-1]) & (v > 0)
    m = xp.sum(xp.cumulative_prod(xp.astype(better, xp.int64)))  # pairs admitted before the first non-improvement
    more = fewer = xp.zeros((), dtype=xp.bool, device=dev)
    if explore is not None:
        last = explore.shape[0] - 1
        nxt = xp.clip(m, max=n * g - 1)
        cell = xp.clip(xp.take(tokens, xp.reshape(nxt + 1, (1,)))[0], max=last)
        below = xp.clip(xp.take(tokens, xp.reshape(xp.clip(m - 1, min=0), (1,)))[0], max=last)
        fewer = (m > 0) & explore[below]
        more = ~fewer & (m < n * g) & (xp.take(v, xp.reshape(nxt, (1,)))[0] > 0) & explore[cell]
    rank = xp.zeros(n * g, dtype=xp.int64, device=dev)
    rank[order] = xp.arange(n * g, device=dev)
    taken = rank < m + xp.astype(more, xp.int64) - xp.astype(fewer, xp.int64)
    lengths = xp.sum(xp.astype(xp.reshape(taken, (g, n)), xp.int64), axis=0)
    return lengths, xp.take(rate, xp.reshape(m, (1,)))[0], more | fewer


def admit(a: Array, budget: Array | int) -> Array:
    """sps-async's cut (specrt::ConfidenceTruncate's budget mode): per row of survivals a [n, γ], how many of the
    `budget` best (row, k) pairs over the batch fall in it (ties: the lower flat index row·γ + k; pairs with
    survival 0 never)."""
    xp = namespace(a)
    n, g = a.shape
    dev = device(a)
    flat = xp.reshape(a, (-1,))
    order = xp.argsort(-flat, stable=True)
    rank = xp.zeros(n * g, dtype=xp.int64, device=dev)
    rank[order] = xp.arange(n * g, device=dev)
    taken = (rank < budget) & (flat > 0)
    return xp.sum(xp.astype(xp.reshape(taken, (n, g)), xp.int64), axis=1)


def cap(planned: Array, counts: Array, budget: Array, active: Array, gamma: int) -> Array:
    """[B] verify lengths: min(planned, counts, gamma, budget - 1) for active slots (the bonus token is always
    committed, so at most budget - 1 drafts can be), 0 for idle ones."""
    xp = namespace(planned)
    room = xp.clip(budget - 1, min=0, max=gamma)
    return xp.where(active, xp.minimum(xp.minimum(planned, counts), room), xp.zeros_like(planned))


def best(logits: Array, rows: Array, b: int, t: int) -> Array:
    """[b, t] argmax token of every grid cell; `logits` [P, V] are the cells `rows` [P] in order (cells not
    computed keep 0: no accepted prefix reaches them)."""
    xp = namespace(logits)
    out = xp.zeros(b * t, dtype=rows.dtype, device=device(rows))
    out[rows] = xp.argmax(logits, axis=-1)
    return xp.reshape(out, (b, t))


def accept(drafts: Array, best: Array, lengths: Array) -> tuple[Array, Array]:
    """Greedy acceptance of drafts [B, T - 1] verified up to lengths [B] against the argmax best [B, T]: accepted
    [B] and tokens [B, T] (the accepted drafts, the bonus at index accepted; later entries are drafts)."""
    xp = namespace(drafts)
    t = best.shape[1]
    if t == 1:  # nothing verified (a decoding step): the argmax is the bonus
        return xp.zeros_like(lengths), best
    within = xp.arange(t - 1, device=device(drafts))[None, :] < lengths[:, None]
    ok = xp.astype((drafts == best[:, :t - 1]) & within, drafts.dtype)
    accepted = xp.sum(xp.cumulative_prod(ok, axis=1), axis=1)
    bonus = xp.take_along_axis(best, accepted[:, None], axis=1)
    tokens = xp.concat([drafts[:, :t - 1], bonus], axis=1)
    at = xp.arange(t, device=device(drafts))[None, :] == accepted[:, None]
    return accepted, xp.where(at, bonus, tokens)


def advance(length: Array, budget: Array, anchor: Array, accepted: Array, bonus: Array, active: Array) -> None:
    """Commit a round on slot state arrays in place: length and budget move by a + 1, the bonus is the anchor."""
    xp = namespace(length)
    step = (accepted + 1) * xp.astype(active, accepted.dtype)
    length += step
    budget -= step
    anchor[...] = xp.where(active, bonus, anchor)
