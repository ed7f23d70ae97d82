"""An MTP head's propose call: rows pair the target's final hidden h_t with the next token x_{t+1}; the block is
chained `steps` times from the last row (whose next token is the anchor)."""
from __future__ import annotations

from specrt.runtime.arrays import namespace

from specrt import artifact as io
from specrt.runtime.calls.head import Array, ContextRows, positions

FEATURES = True  # the head reads target features (slots carry them as context rows)


def propose(feeds: dict[str, Array], ctx: ContextRows, anchor: Array) -> None:
    """Fill a propose (or prefill) call over B slots: context rows `ctx` (the anchor is their last next token)."""
    xp = namespace(ctx.rows)
    tokens, hidden = feeds[io.MTP_TOKENS], feeds[io.MTP_HIDDEN]
    c = ctx.features.shape[1]
    tokens[:, :c] = ctx.next_tokens
    tokens[:, c:] = 0
    hidden[:, :c] = ctx.features
    hidden[:, c:] = 0
    feeds[io.MTP_POSITIONS][...] = positions(ctx.start, tokens.shape[1])
    feeds[io.MTP_LAST_ROW][...] = xp.clip(ctx.rows - 1, min=0)  # an idle slot: its (dummy) first row
