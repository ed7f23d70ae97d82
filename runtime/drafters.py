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
            self.runner.run(slot, self._feeds([piece], [0], [0.0], np.zeros((1, self.steps), np.float32),
                                              rows=self.chunk))
        return Context(ctx.pos + r - 1, ctx.features[r - 1:], ctx.next_tokens[r - 1:])

    def propose(self, slots: list[SlotView | None]) -> Proposal:
        """One draft call over slots [0, n); idle slots draft garbage that nobody reads."""
        n = len(slots)
        ctxs = [s.ctx if s is not None else None for s in slots]
        rows = max(len(c.next_tokens) for c in ctxs if c is not None)
        noise = np.zeros((n, self.steps), np.float32)
        temps = [0.0] * n
        anchors = [0] * n
        for i, s in enumerate(slots):
            if s is not None:
                anchors[i], temps[i] = s.pending, s.temperature
                if s.temperature > 0:
                    noise[i] = s.rng.random(self.steps, dtype=np.float32)
        out = self.runner.run(0, self._feeds(ctxs, anchors, temps, noise, rows=rows))
        for s in slots:
            if s is not None:
                s.ctx = None  # written into the draft cache
        return Proposal(tokens=out[io.DRAFT_TOKENS], probs=out[io.DRAFT_PROBS],
                        confidence_logits=out.get(io.CONFIDENCE_LOGITS))

    def _feeds(self, ctxs: list[Context | None], anchors: list[int], temps: list[float], noise: np.ndarray,
               rows: int) -> dict[str, np.ndarray]:
        raise NotImplementedError


class DSparkDrafter(_Drafter):
    """DSpark / DFlash: context = raw target-layer features; drafts a block of K tokens in parallel."""

    def __init__(self, art_dir: Path, manifest: io.Manifest, *, threads: int | None = None) -> None:
        super().__init__(art_dir, manifest, "dspark", threads=threads)
        self.steps = self.info["block"]

    def _feeds(self, ctxs, anchors, temps, noise, rows):
        n = len(ctxs)
        feats = np.zeros((n, rows, self.width), np.float32)
        pos = np.zeros((n, rows), np.int64)
        write, valid = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for i, c in enumerate(ctxs):
            if c is None:
                continue
            r = len(c.next_tokens)
            feats[i, :r] = c.features[:, self.offset:self.offset + self.width]
            pos[i] = c.pos + np.arange(rows)
            write[i], valid[i] = c.pos, c.pos + r
        return {io.CTX_FEATURES: feats, io.CTX_POSITIONS: pos, io.CTX_WRITE_INDEX: write, io.CTX_LEN: valid,
                io.ANCHOR_IDS: np.asarray(anchors, np.int64), io.TEMPERATURE: np.asarray(temps, np.float32),
                io.NOISE: noise}


class MTPDrafter(_Drafter):
    """MTP: rows pair the target's final hidden h_t with x_{t+1}; chains `steps` drafts from the last row."""

    def __init__(self, art_dir: Path, manifest: io.Manifest, *, threads: int | None = None) -> None:
        super().__init__(art_dir, manifest, "mtp", threads=threads)
        self.steps = self.info["steps"]

    def _feeds(self, ctxs, anchors, temps, noise, rows):
        n = len(ctxs)
        tokens = np.zeros((n, rows), np.int64)
        hidden = np.zeros((n, rows, self.width), np.float32)
        pos = np.zeros((n, rows), np.int64)
        last = np.zeros(n, np.int64)
        for i, c in enumerate(ctxs):
            if c is None:
                continue
            r = len(c.next_tokens)
            tokens[i, :r] = c.next_tokens
            hidden[i, :r] = c.features[:, self.offset:self.offset + self.width]
            pos[i] = c.pos + np.arange(rows)
            last[i] = r - 1
        return {io.MTP_TOKENS: tokens, io.MTP_HIDDEN: hidden, io.MTP_POSITIONS: pos, io.MTP_LAST_ROW: last,
                io.TEMPERATURE: np.asarray(temps, np.float32), io.NOISE: noise}


DRAFTERS = {"dspark": DSparkDrafter, "mtp": MTPDrafter}
