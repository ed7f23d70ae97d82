"""Draft heads at run time: each keeps its own KV cache and turns pending context rows into proposals.

A slot's pending context rows are target positions whose features the draft has not seen yet:
after prefill, the prompt's last position; after each round, the a + 1 verified positions. Every
propose call writes them into the draft cache and drafts from the slot's pending (anchor) token.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from specrt import artifact as io
from specrt.runtime.backends.ort import OrtRunner


@dataclass
class Context:
    """Pending context rows of one slot: positions pos..pos+r-1."""

    pos: int
    features: np.ndarray  # [r, F_all] target features of those positions
    next_tokens: np.ndarray  # [r] the token at each position + 1 (MTP pairs h_t with x_{t+1})


@dataclass
class Proposal:
    tokens: np.ndarray  # [n, K] i64
    probs: np.ndarray  # [n, K, V] f32: the distribution each token was drawn from
    confidence_logits: np.ndarray | None  # [n, K]


class SlotView(Protocol):
    ctx: Context | None
    pending: int
    temperature: float
    rng: np.random.Generator


class _Drafter:
    """Shared plumbing: one runner over the head's graph family, chunked writes of prompt context."""

    steps: int  # tokens drafted per call

    def __init__(self, art_dir: Path, manifest: io.Manifest, name: str, *, threads: int | None = None) -> None:
        self.info = manifest.heads[name]
        self.runner = OrtRunner(art_dir, manifest.graphs[name], threads=threads, spin=False)
        self.chunk = manifest.export.prefill_chunk
        self.offset, self.width = self.info["feature_offset"], self.info["feature_dim"]

    def allocate(self, slots: int) -> None:
        self.runner.allocate(slots)

    def prefill(self, slot: int, ctx: Context) -> Context:
        """Write all but the last pending row of a fresh slot in chunks; return the last row, still pending."""
        r = len(ctx.next_tokens)
        for start in range(0, r - 1, self.chunk):
            stop = min(start + self.chunk, r - 1)
            piece = Context(ctx.pos + start, ctx.features[start:stop], ctx.next_tokens[start:stop])
            feeds = self.runner.inputs(slot, B=1, C=self.chunk)
            feeds[io.TEMPERATURE][:] = 0.0
            feeds[io.NOISE][:] = 0.0
            self._fill(feeds, [piece], [0])
            self.runner.run_bound(slot, B=1, C=self.chunk)
        return Context(ctx.pos + r - 1, ctx.features[r - 1:], ctx.next_tokens[r - 1:])

    def propose(self, slots: list[SlotView | None]) -> Proposal:
        """One draft call over slots [0, n); idle slots draft garbage that nobody reads."""
        n = len(slots)
        ctxs = [s.ctx if s is not None else None for s in slots]
        rows = max(len(c.next_tokens) for c in ctxs if c is not None)
        feeds = self.runner.inputs(0, B=n, C=rows)  # bound buffers: filled in place
        temps, noise = feeds[io.TEMPERATURE], feeds[io.NOISE]
        anchors = [0] * n
        for i, s in enumerate(slots):
            temps[i], noise[i] = (s.temperature, 0.0) if s is not None else (0.0, 0.0)
            if s is not None:
                anchors[i] = s.pending
                if s.temperature > 0:
                    noise[i] = s.rng.random(self.steps, dtype=np.float32)
        self._fill(feeds, ctxs, anchors)
        out = self.runner.run_bound(0, B=n, C=rows)
        for s in slots:
            if s is not None:
                s.ctx = None  # written into the draft cache
        return Proposal(tokens=out[io.DRAFT_TOKENS], probs=out[io.DRAFT_PROBS],
                        confidence_logits=out.get(io.CONFIDENCE_LOGITS))

    def _fill(self, feeds: dict[str, np.ndarray], ctxs: list[Context | None], anchors: list[int]) -> None:
        """Write the context rows (padded) and anchors into the bound input buffers."""
        raise NotImplementedError


class DSparkDrafter(_Drafter):
    """DSpark / DFlash: context = raw target-layer features; drafts a block of K tokens in parallel."""

    def __init__(self, art_dir: Path, manifest: io.Manifest, *, threads: int | None = None) -> None:
        super().__init__(art_dir, manifest, "dspark", threads=threads)
        self.steps = self.info["block"]

    def _fill(self, feeds, ctxs, anchors):
        feats, pos = feeds[io.CTX_FEATURES], feeds[io.CTX_POSITIONS]
        write, valid = feeds[io.CTX_WRITE_INDEX], feeds[io.CTX_LEN]
        feats[:] = 0
        feeds[io.ANCHOR_IDS][:] = anchors
        for i, c in enumerate(ctxs):  # idle slots: an empty context at position 0 of their own row
            r = len(c.next_tokens) if c is not None else 0
            start = c.pos if c is not None else 0
            if r:
                feats[i, :r] = c.features[:, self.offset:self.offset + self.width]
            np.add(start, np.arange(pos.shape[1]), out=pos[i])
            write[i], valid[i] = start, start + r


class MTPDrafter(_Drafter):
    """MTP: rows pair the target's final hidden h_t with x_{t+1}; chains `steps` drafts from the last row."""

    def __init__(self, art_dir: Path, manifest: io.Manifest, *, threads: int | None = None) -> None:
        super().__init__(art_dir, manifest, "mtp", threads=threads)
        self.steps = self.info["steps"]

    def _fill(self, feeds, ctxs, anchors):
        tokens, hidden = feeds[io.MTP_TOKENS], feeds[io.MTP_HIDDEN]
        pos, last = feeds[io.MTP_POSITIONS], feeds[io.MTP_LAST_ROW]
        tokens[:] = 0
        hidden[:] = 0
        for i, c in enumerate(ctxs):  # idle slots: one dummy row at position 0 of their own row
            r = len(c.next_tokens) if c is not None else 1
            start = c.pos if c is not None else 0
            if c is not None:
                tokens[i, :r] = c.next_tokens
                hidden[i, :r] = c.features[:, self.offset:self.offset + self.width]
            np.add(start, np.arange(pos.shape[1]), out=pos[i])
            last[i] = r - 1


DRAFTERS = {"dspark": DSparkDrafter, "mtp": MTPDrafter}
