"""Acceptance of drafted tokens by Leviathan/Chen rejection sampling, written once on the array API: the host round
runs it on numpy for one slot at a time (`accept_sampled`), the device round on torch for all its slots at once
(`accept_rows`). Greedy acceptance, a prefix match against the target's argmax, is runtime/steps.py's `accept`.

Sampling: accept d_k with probability min(1, p(d_k) / q(d_k)); on the first rejection draw the bonus
from norm(max(0, p - q)); if all are accepted draw it from p at the next position. The committed
tokens then follow the target distribution p exactly, whatever the draft distribution q is.

Each slot's uniforms are drawn from its request's rng before the round, in one order on both paths: gamma for the
acceptance tests, then one for the bonus (after the head's draft noise), so a seeded request draws the same tokens
on ONNX Runtime's host loop and on the torch backend's device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.runtime.arrays import device, namespace
from specrt.runtime.sampling import Array, SamplingParams, distribution, draw, draw_row


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: int  # a: drafts accepted (a prefix of the proposal)
    bonus: int  # the target's token at position a (correction or continuation)


def accepts(u: Array, q_d: Array, p_d: Array) -> Array:
    """The acceptance test of drafts x drawn from q, so q(x) > 0: probability min(1, p(x)/q(x)), i.e. u*q(x) < p(x)."""
    return u * q_d < p_d


def accept_rows(drafts: Array, p: Array, q: Array | None, onehot: Array | None, lengths: Array, u: Array, v: Array
                ) -> tuple[Array, Array]:
    """Rejection sampling for B slots at once. drafts [B, G]; p [B, G + 1, V] the target's distributions at each
    verified position (float64); q [B, G, V] the distributions the drafts were drawn from (None: every draft one-hot,
    such as n-gram lookups; `onehot` [B] marks one-hot rows beside q); lengths [B] drafts verified; u [B, G] and
    v [B] uniforms. Returns accepted [B] and tokens [B, G + 1] (the accepted drafts, the bonus at index accepted)."""
    xp = namespace(p)
    b, g = drafts.shape
    dev = device(p)
    p_d = xp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]
    if q is None:
        q_d = xp.ones_like(p_d)
    else:
        q_d = xp.astype(xp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0], xp.float64)
        if onehot is not None:
            q_d = xp.where(onehot[:, None], xp.ones_like(q_d), q_d)
    ok = accepts(xp.astype(u, xp.float64), q_d, p_d) & (xp.arange(g, device=dev)[None, :] < lengths[:, None])
    accepted = xp.sum(xp.cumulative_prod(xp.astype(ok, xp.int64), axis=1), axis=1) if g else xp.zeros_like(lengths)
    at = accepted[:, None, None]
    p_a = xp.take_along_axis(p, at, axis=1)[:, 0]  # [B, V]: the target at the first unaccepted position
    pad = xp.zeros((b, 1), dtype=drafts.dtype, device=dev)
    d_a = xp.take_along_axis(xp.concat([drafts, pad], axis=1), accepted[:, None], axis=1)
    hot = xp.astype(xp.arange(p.shape[-1], device=dev)[None, :] == d_a, xp.float64)
    if q is None:
        q_a = hot
    else:
        rows = xp.concat([xp.astype(q, xp.float64), xp.zeros_like(p_a[:, None])], axis=1)
        q_a = xp.take_along_axis(rows, at, axis=1)[:, 0]
        if onehot is not None:
            q_a = xp.where(onehot[:, None], hot, q_a)
    residual = xp.clip(p_a - q_a, min=0.0)
    mass = xp.sum(residual, axis=-1, keepdims=True)
    rejected = (accepted < lengths)[:, None] & (mass > 1e-12)
    bonus = draw(xp.where(rejected, residual / xp.where(mass > 0, mass, xp.ones_like(mass)), p_a), v)
    tokens = xp.concat([drafts, bonus[:, None]], axis=1)
    place = xp.arange(g + 1, device=dev)[None, :] == accepted[:, None]
    return accepted, xp.where(place, bonus[:, None], tokens)


def accept_sampled(drafts: np.ndarray, draft_probs: np.ndarray | None, target_logits: np.ndarray,
                   params: SamplingParams, rng: np.random.Generator, *, gamma: int | None = None) -> Verdict:
    """One slot on the host: drafts [l], draft_probs [l, V] the distribution each draft was drawn from (None for
    one-hot drafts such as n-gram lookups), target_logits [l+1, V]. Draws `gamma` (default l) acceptance uniforms,
    then one for the bonus. The target's distribution is computed only up to the first rejection (the rows after it
    cannot change the verdict); the verdict is `accept_rows`'s on that one row, its bonus drawn over the nonzero
    entries (the same token: see `sampling.sample`) without the batched path's vocabulary-wide temporaries."""
    ell = len(drafts)
    u = rng.random(ell if gamma is None else gamma)[:ell]
    v = float(rng.random())
    for k in range(ell + 1):
        p = distribution(target_logits[k], params)
        if k == ell:  # every draft accepted: the bonus comes from the target's next distribution
            return Verdict(ell, draw_row(p, v))
        d = int(drafts[k])
        if not accepts(u[k], 1.0 if draft_probs is None else float(draft_probs[k, d]), p[d]):
            break
    # rejected at k: the bonus comes from the residual max(p - q, 0), normalised (p itself when it has no mass)
    if draft_probs is None:  # a one-hot draft: p without the drafted token
        residual = p.copy()
        residual[d] = 0.0
    else:
        residual = np.clip(p - draft_probs[k].astype(np.float64), 0.0, None)
    mass = residual.sum()
    return Verdict(k, draw_row(residual / mass if mass > 1e-12 else p, v))


def accept_tree_sampled(drafts: np.ndarray, parents: np.ndarray, draft_probs: np.ndarray | None,
                        target_logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, *,
                        gamma: int | None = None) -> tuple[Verdict, list[int]]:
    """One slot's draft tree on the host, sampled: drafts [l] and parents [l] (runtime/tree.py), draft_probs [l, V]
    the distribution each node was drawn from (None, or a zero row: a node chosen without sampling, q one-hot),
    target_logits [l + 1, V] in grid cell order (the anchor, then node j at cell j + 1). Returns the verdict and the
    path's cells (the anchor's 0 first).

    From the anchor, with r the target's distribution there, each child c in node order is tried against r: accepted
    with probability min(1, r(c) / q_c(c)) (a one-hot q: r(c)); on rejection r becomes norm(max(0, r - q_c)) (one-hot:
    r without c). The first accepted child is the next node; when none is, the bonus is drawn from r. With at most one
    sampled child per node, tried first, and the others chosen before any of the target's uniforms is drawn, the token
    committed at each position is distributed as the target's distribution there (SpecInfer's multi-step speculative
    sampling; with deterministic candidates, sampling by elimination); a sampled child is tried first wherever the
    node order puts it. Uniforms: node j's test reads u[j] of `gamma`
    (default l) drawn first, the bonus one more, as a chain's do."""
    ell = len(drafts)
    u = rng.random(ell if gamma is None else gamma)[:ell]
    v = float(rng.random())
    cur, cells = 0, [0]
    while True:
        r = distribution(target_logits[cur], params)
        moved = False
        children = np.flatnonzero(parents[:ell] == cur - 1).tolist()
        if draft_probs is not None:  # a child drawn from q is tried before those chosen outright
            children.sort(key=lambda j: not draft_probs[j].any())
        for j in children:
            d = int(drafts[j])
            q = None if draft_probs is None or not draft_probs[j].any() else draft_probs[j].astype(np.float64)
            if accepts(u[j], 1.0 if q is None else float(q[d]), r[d]):
                cur, moved = j + 1, True
                cells.append(cur)
                break
            if q is None:
                r = r.copy()
                r[d] = 0.0
            else:
                r = np.clip(r - q, 0.0, None)
            mass = r.sum()
            if mass <= 1e-12:  # nothing left to draw (q covered r): the target's own distribution, as a chain does
                r = distribution(target_logits[cur], params)
                break
            r = r / mass
        if not moved:
            return Verdict(len(cells) - 1, draw_row(r, v)), cells
