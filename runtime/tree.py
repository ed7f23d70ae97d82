"""Draft trees: a proposal whose drafts branch, verified in one target call (on the host's numpy arrays).

A slot's drafts are nodes 0..K-1 with parents [K] (-1: the anchor), each after its parent, in the drafter's order of
preference, so the first l nodes are a subtree: what a scheduler admits when it admits l drafts, and what a verify of
l + 1 tokens costs. A chain is the tree whose node j has parent j - 1.

    verify   grid cell 1 + j holds node j at position start + depth(j); the target's tree_mask input hides from each
             cell the cells that are not its ancestors, so each node's row is the row decoding its path would give
             (`mask`, `positions`)
    accept   greedy: from the anchor, follow the child whose token is the target's argmax there, while there is one
             (`accept`); sampled: runtime/acceptance.py `accept_tree_sampled`
    commit   the accepted path's cells are the slot's next cache rows: their K/V move to the positions after the
             anchor (`moves`), and the rows of the other branches are left beyond the length, overwritten later

`cells` [n, T]: the grid cell of each committed position (0: the anchor), what features and cache rows are read from.
"""
from __future__ import annotations

import numpy as np


def chain(k: int) -> np.ndarray:
    """[k] parents of a chain of k drafts."""
    return np.arange(k, dtype=np.int64) - 1


def depths(parents: np.ndarray) -> np.ndarray:
    """[..., K] depth of each node (the anchor's children: 1), parents [..., K] in node order."""
    d = np.zeros(parents.shape, np.int64)
    for j in range(parents.shape[-1]):
        p = parents[..., j]
        d[..., j] = np.where(p < 0, 1, np.take_along_axis(d, np.maximum(p, 0)[..., None], axis=-1)[..., 0] + 1)
    return d


def positions(start: np.ndarray, parents: np.ndarray, t: int) -> np.ndarray:
    """[n, t] position of each grid cell: the anchor at start, node j at start + depth(j) (cells past the nodes: as
    a chain's, never read)."""
    pos = start[:, None] + np.arange(t, dtype=np.int64)[None, :]
    k = min(t - 1, parents.shape[1])
    pos[:, 1:k + 1] = start[:, None] + depths(parents[:, :k])
    return pos


def mask(parents: np.ndarray, lengths: np.ndarray, t: int, out: np.ndarray) -> None:
    """Fill out [n', t, t] (the tree_mask input; rows past n are left as chains): 1 where cell j is not an ancestor of
    cell c among each slot's first lengths[i] nodes (the anchor, cell 0, is every cell's)."""
    out[...] = 0
    n = len(lengths)
    for i in range(n):
        ell = int(lengths[i])
        seen = np.zeros((ell + 1, ell + 1), bool)  # seen[c, j]: cell c sees cell j
        seen[:, 0] = True
        for j in range(ell):
            p = int(parents[i, j])
            seen[j + 1] = seen[p + 1] if p >= 0 else seen[0]
            seen[j + 1, j + 1] = True
        out[i, :ell + 1, :ell + 1] = ~seen


def is_chain(parents: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether every slot's admitted nodes form a chain (the verify needs no mask)."""
    k = min(parents.shape[1], int(lengths.max()) if len(lengths) else 0)
    return bool((parents[:, :k] == chain(k)[None, :]).all())


def accept(drafts: np.ndarray, best: np.ndarray, parents: np.ndarray, lengths: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy: from the anchor, the child whose token is the target's argmax at the current cell, while one is among
    the admitted nodes. drafts [n, T - 1], best [n, T], parents [n, >= T - 1], lengths [n] -> accepted [n], tokens
    [n, T] (the path's drafts, the bonus at index accepted), cells [n, T] (the path's cells; past it: 0)."""
    n, t = best.shape
    accepted = np.zeros(n, np.int64)
    tokens = np.zeros((n, t), np.int64)
    cells = np.zeros((n, t), np.int64)
    for i in range(n):
        ell, cur, a = int(lengths[i]), 0, 0
        nodes = parents[i, :ell]
        while True:
            want = best[i, cur]
            hit = np.flatnonzero((nodes == cur - 1) & (drafts[i, :ell] == want))
            if not len(hit):
                break
            cur = int(hit[0]) + 1
            tokens[i, a] = want
            a += 1
            cells[i, a] = cur
        accepted[i] = a
        tokens[i, a] = best[i, cur]
    return accepted, tokens, cells


def moves(cells: np.ndarray, accepted: np.ndarray, start: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(slot, from, to) cache positions per slot whose accepted path is not already where a chain's would be: the
    path's cells 1..a move to start + 1..a."""
    out = []
    for i in range(len(accepted)):
        a = int(accepted[i])
        path = cells[i, 1:a + 1]
        if a and (path != np.arange(1, a + 1)).any():
            out.append((i, start[i] + path, start[i] + np.arange(1, a + 1)))
    return out


def by_survival(survival: list[float], parent: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Nodes listed with each parent before its children (parent[j] < j; -1: the anchor) in the order a proposal
    takes: (order, parents), the nodes by decreasing survival (stable: a parent, never less likely than its child,
    stays before it, so a prefix is a subtree) and each one's parent as a position in that order."""
    order = np.argsort(-np.asarray(survival, np.float64), kind="stable")
    at = np.empty(len(order), np.int64)
    at[order] = np.arange(len(order))
    up = np.asarray(parent, np.int64)[order]
    return order, np.where(up >= 0, at[np.maximum(up, 0)], -1)


def graft(tokens: np.ndarray, counts: np.ndarray, survival: np.ndarray, first_top: np.ndarray,
          first_probs: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A head's chains [n, K] (survivals [n, g]) with up to width - 1 of its likeliest other first tokens grafted
    beside each first draft: (tokens, counts, survivals [n, K + width - 1], parents, chain) over the nodes in order
    of survival,
    `chain[i, j]` the chain position of node j (-1: an alternative). An alternative's survival is the chance the
    first draft is rejected times its share of the head's probability without the first draft's."""
    n, k = tokens.shape
    g = survival.shape[1]
    m = k + width - 1
    out_t, out_p, chain = np.zeros((n, m), np.int64), np.tile(np.arange(m) - 1, (n, 1)), np.full((n, m), -1)
    out_s, out_c = np.zeros((n, m), np.float32), counts.copy()
    for i in range(n):
        c = int(counts[i])
        if c == 0:
            continue
        s = np.zeros(k)
        s[:min(c, g)] = survival[i, :min(c, g)]
        nodes = [(float(s[j]), j, int(tokens[i, j])) for j in range(c)]  # (survival, chain position, token)
        first = int(tokens[i, 0])
        ids, probs = first_top[i].tolist(), first_probs[i].astype(np.float64)
        p_first = float(probs[ids.index(first)]) if first in ids else 0.0
        alts = [(t, q) for t, q in zip(ids, probs) if t >= 0 and t != first][:width - 1]
        nodes += [((1.0 - s[0]) * q / max(1.0 - p_first, 1e-9), -1, t) for t, q in alts]
        order, parents = by_survival([x[0] for x in nodes], [x[1] - 1 if x[1] > 0 else -1 for x in nodes])
        m_i = len(nodes)
        out_t[i, :m_i] = [nodes[x][2] for x in order]
        chain[i, :m_i] = [nodes[x][1] for x in order]
        out_s[i, :m_i] = [nodes[x][0] for x in order]
        out_p[i, :m_i] = parents
        out_c[i] = m_i
    return out_t, out_c, out_s, out_p, chain
