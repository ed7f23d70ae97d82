"""A DSpark (or DFlash) head's propose call: raw target-layer features as context, a block drafted in parallel.

The call writes each slot's context rows into the head's cache at their positions (ctx_write_index), attends to
its first ctx_len positions, and drafts the block after the anchor token.
"""
from __future__ import annotations

from specrt import artifact as io
from specrt.runtime.calls.head import Array, ContextRows, positions

FEATURES = True  # the head reads target features (slots carry them as context rows)


def propose(feeds: dict[str, Array], ctx: ContextRows, anchor: Array) -> None:
    """Fill a propose (or prefill) call over B slots: context rows `ctx`, anchors [B]."""
    f = feeds[io.CTX_FEATURES]
    c = ctx.features.shape[1]
    f[:, :c] = ctx.features
    f[:, c:] = 0
    feeds[io.CTX_POSITIONS][...] = positions(ctx.start, f.shape[1])
    feeds[io.CTX_WRITE_INDEX][...] = ctx.start
    feeds[io.CTX_LEN][...] = ctx.start + ctx.rows
    feeds[io.ANCHOR_IDS][...] = anchor
