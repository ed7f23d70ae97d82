"""The round's array steps, written once on the array API: the host loop runs them on numpy arrays, the device
round (runtime/device_round.py) on torch tensors of the torch backend's device, inside its CUDA graph.

    cap      verify lengths: the scheduler's, capped by the drafts proposed, gamma and each request's budget
    best     the target's argmax at every grid cell of a (dense or packed) verify call
    accept   greedy: the longest prefix of drafts equal to the argmax before them; the bonus is the argmax there
    advance  commit on slot state arrays: length and budget grow by a + 1, the bonus becomes the anchor

Sampled acceptance (rejection sampling with each request's rng) is runtime/acceptance.py's, on the host.
"""
from __future__ import annotations

from specrt.runtime.arrays import Array, device, namespace


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
    within = xp.arange(t - 1, device=device(drafts))[None, :] < lengths[:, None]
    ok = xp.astype((drafts == best[:, :t - 1]) & within, drafts.dtype)
    accepted = xp.sum(xp.cumulative_prod(ok, axis=1), axis=1) if t > 1 else xp.zeros_like(lengths)
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
