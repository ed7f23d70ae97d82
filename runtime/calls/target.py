"""The target's calls: prefill one slot's chunk, decode, and packed verify.

A decode or verify call is a B x T grid: row i holds slot i's anchor (its last committed token, not yet in the
cache) and then its drafts, at positions start[i], start[i] + 1, ...; `token_rows` names the P cells computed
(dense: all of them; packed: each slot's anchor and verified drafts, then padding) and the logits come back for
each, in that order. Idle slots compute their anchor cell at position 0 of their own cache row (a dummy write).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from specrt.runtime.arrays import device, namespace

from specrt import artifact as io
from specrt.runtime.calls.head import Array, positions


def prefill(feeds: dict[str, Array], ids: Array, start: int) -> None:
    """One slot's chunk: `ids` (at most T tokens) at positions start, start + 1, ...; logits of its last token."""
    x = feeds[io.INPUT_IDS]
    xp = namespace(x)
    b, t = x.shape
    n = ids.shape[0]
    x[0, :n] = ids
    x[0, n:] = 0
    feeds[io.POSITION_IDS][0] = xp.arange(start, start + t, dtype=x.dtype, device=device(x))
    feeds[io.WRITE_INDEX][0] = start
    feeds[io.TOKEN_ROWS][...] = xp.arange(b * t, dtype=x.dtype, device=device(x))
    feeds[io.LOGIT_ROWS][0] = n - 1


def run_prefill(runner, slot: int, ids: np.ndarray) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Prefill `ids` into `slot` of a target runner from position 0, a chunk per call; yields each chunk's tokens and
    the call's outputs (valid until the next chunk runs)."""
    bucket = runner.spec.bucket("prefill")
    feeds = runner.inputs(slot, bucket)  # bound buffers: filled in place
    for start in range(0, len(ids), bucket["T"]):
        piece = ids[start:start + bucket["T"]]
        prefill(feeds, piece, start)
        yield piece, runner.run(slot, bucket)


def grid(feeds: dict[str, Array], anchor: Array, start: Array, drafts: Array | None, rows: Array) -> None:
    """Decode (T = 1) or verify: anchors [B], start positions [B], drafts [B, >= T - 1] (cells past a slot's
    verify length are not computed when packed, and are invisible to its verified cells when dense), `rows`: the P
    cells computed (`dense_rows` or `packed_rows`)."""
    x = feeds[io.INPUT_IDS]
    xp = namespace(x)
    t = x.shape[1]
    x[:, 0] = anchor
    if t > 1:
        x[:, 1:] = drafts[:, :t - 1]
    feeds[io.POSITION_IDS][...] = positions(start, t)
    feeds[io.WRITE_INDEX][...] = start
    feeds[io.TOKEN_ROWS][...] = rows
    r = feeds[io.LOGIT_ROWS]
    r[...] = xp.arange(r.shape[0], dtype=r.dtype, device=device(r))


def packed_rows(lengths: np.ndarray, active: np.ndarray, bucket: io.Bucket) -> np.ndarray:
    """token_rows [P] of a packed verify (host: the lengths decide P): each active slot's anchor and `lengths[i]`
    drafts in slot order, then distinct cells no real token uses (budget padding)."""
    b, t, p = bucket["B"], bucket["T"], bucket["P"]
    cells = np.zeros((b, t), bool)
    n = len(lengths)
    cells[:n] = (np.arange(t) <= lengths[:, None]) & active[:, None]
    real = np.flatnonzero(cells)
    return np.concatenate([real, np.flatnonzero(~cells)[:p - len(real)]])


def dense_rows(bucket: io.Bucket) -> np.ndarray:
    """token_rows of a call that computes every cell of its B x T grid."""
    return io.dense_rows(bucket)
