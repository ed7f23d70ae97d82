"""Drafters: plug-ins that propose draft tokens for the active slots of a round.

A drafter reads what it needs from each slot through `SlotView` (token history, anchor token, pending
context rows, temperature, rng) and returns a `Proposal`; it never changes a slot. Graph drafters (DSpark,
MTP) keep their own KV cache on a backend runner: a slot's pending context rows are target positions
whose features the draft has not seen yet (after prefill, the prompt's last position; after each round,
the a + 1 verified positions), and every propose call writes them into the draft cache before drafting
from the anchor. The n-gram drafter has no weights: it looks the slot's recent tokens up in its history.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime import calls, tree
from specrt.runtime.arrays import Array, namespace
from specrt.runtime.arrays import device as array_device
from specrt.runtime.backends import load_runner
from specrt.runtime.config import Method

if TYPE_CHECKING:
    from specrt.runtime.schedulers import Costs


@dataclass
class Context:
    """Pending context rows of one slot: positions pos..pos+r-1."""

    pos: int
    features: np.ndarray  # [r, F_all] target features of those positions
    next_tokens: np.ndarray  # [r] the token at each position + 1 (MTP pairs h_t with x_{t+1})


@dataclass
class Proposal:
    """Drafts for slots [0, n): row i holds slot i's first counts[i] drafts (idle slots: counts 0)."""

    tokens: np.ndarray  # [n, K] i64
    counts: np.ndarray  # [n] i64: drafts proposed per slot (K for graph heads)
    probs: np.ndarray | None  # [n, K, V'] f32: the distribution each draft was drawn from; None = one-hot drafts
    confidence_logits: np.ndarray | None = None  # [n, K] (DSpark's confidence head)
    vocab_ids: np.ndarray | None = None  # [V'] token id of each probs column (a reduced draft vocabulary); None: all
    survival: np.ndarray | None = None  # [n, K] calibrated prefix survival (the graph's ConfidenceTruncate)
    head: str = ""  # the graph family whose call drafted this round ("": no graph call, n-gram lookups)
    onehot: np.ndarray | None = None  # [n] bool: rows drafted deterministically (q one-hot) beside `probs`
    # the head's call first wrote rows of rounds it skipped (a gated head's backlog): its time is not what a draft
    # call costs, so the cost table does not learn from it
    catch_up: bool = False
    # [n, K] i64: a draft tree's parents (runtime/tree.py: -1 the anchor, each node after its parent, a prefix of the
    # nodes a subtree); None: each row is a chain
    parents: np.ndarray | None = None
    # [n, A] a head's likeliest first tokens (ids, best first; -1: none for that row) and their probabilities under
    # its distribution: the alternatives a round may graft beside its first draft (tree.graft)
    first_top: np.ndarray | None = None
    first_probs: np.ndarray | None = None

    def draft_probs(self, i: int, n: int, vocab_size: int) -> np.ndarray | None:
        """Slot i's first n draft distributions over the whole vocabulary (zero outside a draft vocabulary);
        None for one-hot drafts."""
        if self.probs is None or (self.onehot is not None and self.onehot[i]):
            return None
        if self.vocab_ids is None:
            return self.probs[i, :n]
        q = np.zeros((n, vocab_size), self.probs.dtype)
        q[:, self.vocab_ids] = self.probs[i, :n]
        return q


class SlotView(Protocol):
    """What a drafter may read from a slot."""

    ctx: Context | None
    pending: int  # the anchor: the last committed token, not yet in the target cache
    temperature: float
    rng: np.random.Generator

    def history(self) -> np.ndarray:
        """Prompt + output token ids so far (the anchor last)."""


@dataclass
class DraftPlan:
    """What only the host knows about a round's drafts, for a round that runs elsewhere (the device round): the
    lookups found (None: the drafter looks nothing up), their survivals [n, steps] where the scheduler reads them,
    whether the head is called, and the head's survivals [steps] measured so far (for heads without a confidence
    head)."""

    lookups: Proposal | None
    survival: np.ndarray | None
    head: bool
    head_survival: np.ndarray | None = None


class Drafter(Protocol):
    steps: int  # drafts per proposal at most
    needs_features: bool  # whether slots must carry target features as context rows
    calls: ModuleType | None  # the contract of its graph family (runtime/calls), None: it runs no graph of its own
    graph: GraphDrafter | None  # the head whose graph drafts (its own, a hybrid's), None: lookups only
    picks: bool  # per slot, the lookups or the head's block, whichever survives better (`hybrid.pick`)
    backlog_rounds: int  # rounds of context rows a slot may hold (> 1: rounds without the head wait in a backlog)

    def allocate(self, slots: int) -> None:
        """Allocate per-slot state (a draft KV cache) for `slots` slots, once."""

    def prefill(self, slot: int, ctx: Context) -> Context | None:
        """Take a new request's prompt context; return the rows still pending for its first proposal."""

    def propose(self, slots: list[SlotView | None]) -> Proposal:
        """Drafts for slots [0, n) (None = an idle slot)."""

    def observe(self, slot: int, verified: int, accepted: int, path: np.ndarray | None = None) -> None:
        """How slot's drafts of the last proposal fared (after the round); `path`: a tree's accepted cells."""

    def plan(self, slots: list[SlotView | None], scheduler) -> DraftPlan:
        """The host's part of a round drafted elsewhere: lookups, the choice to call the head, survivals."""

    def drafted_by(self, lookup: np.ndarray) -> None:
        """Which rows of the last round drafted elsewhere kept their lookups (the history their outcome updates)."""


class GraphDrafter:
    """A draft head's graph family on a backend runner, its calls filled by the head kind's contract module
    (runtime/calls: `calls.propose(feeds, rows, anchors)`); chunked writes of the prompt context."""

    needs_features = True
    picks = False
    backlog_rounds = 1

    def __init__(self, art_dir: Path, manifest: io.Manifest, name: str, *, backend: str = "ort",
                 threads: int | None = None, **where) -> None:
        self.head = manifest.heads[name]
        self.calls = calls.for_head(self.head.kind)
        self.steps = self.head.steps
        # drafts run in turn with the target: no idle spinning that would steal the target's cores
        self.runner = load_runner(backend, art_dir, manifest, name, threads=threads, spin=False, **where)
        self.offset, self.width = self.head.feature_offset, self.head.feature_dim
        self.vocab_ids = np.asarray(self.head.vocab_ids, np.int64) if self.head.vocab_ids else None
        self.max_rows = max(b["C"] for b in self.runner.spec.buckets["propose"])  # context rows one propose takes

    def allocate(self, slots: int) -> None:
        self.runner.allocate(slots)

    def prefill(self, slot: int, ctx: Context) -> Context:
        """Write all but the last pending row of a fresh slot in chunks; return the last row, still pending."""
        r = len(ctx.next_tokens)
        feats = np.ascontiguousarray(ctx.features[:r - 1, self.offset:self.offset + self.width], np.float32)
        self.write_rows(slot, feats, np.asarray(ctx.next_tokens[:r - 1], np.int64), np.array([ctx.pos], np.int64))
        return Context(ctx.pos + r - 1, ctx.features[r - 1:], ctx.next_tokens[r - 1:])

    def write_rows(self, slot: int, features: Array, next_tokens: Array, start: Array, *, device: bool = False
                   ) -> None:
        """Write one slot's context rows into the head's cache through its prefill bucket, chunk by chunk (only the
        cache writes matter): features [r, width] (the head's columns), next_tokens [r], start [1] the first row's
        position. Arrays of the runner's namespace: numpy through its host call, or (`device`) the device round's
        tensors through its device call (runtime/device_round.py writes a backlog so)."""
        bucket = self.runner.spec.bucket("prefill")
        xp, where = namespace(next_tokens), array_device(next_tokens)
        anchor = xp.zeros(1, dtype=xp.int64, device=where)
        for s0 in range(0, next_tokens.shape[0], bucket["C"]):
            s1 = min(s0 + bucket["C"], next_tokens.shape[0])
            feeds = self.runner.module_inputs(slot, bucket) if device else self.runner.inputs(slot, bucket, greedy=True)
            calls.head.settings(feeds)
            rows = calls.ContextRows(features[None, s0:s1], next_tokens[None, s0:s1], start + s0,
                                     xp.full((1,), s1 - s0, dtype=xp.int64, device=where))
            self.calls.propose(feeds, rows, anchor)
            if device:
                self.runner.forward(slot, bucket, graphed=False)
            else:
                self.runner.run(slot, bucket, greedy=True)

    def rows(self, ctxs: list[Context | None], b: int) -> calls.ContextRows:
        """The pending context rows of slots [0, b) padded into arrays (an idle slot: none, at position 0)."""
        c = max((len(x.next_tokens) for x in ctxs if x is not None), default=1)
        feats = np.zeros((b, c, self.width), np.float32)
        nxt = np.zeros((b, c), np.int64)
        start, rows = np.zeros(b, np.int64), np.zeros(b, np.int64)
        for i, x in enumerate(ctxs):
            if x is not None:
                r = rows[i] = len(x.next_tokens)
                start[i] = x.pos
                if r:
                    feats[i, :r] = x.features[:, self.offset:self.offset + self.width]
                    nxt[i, :r] = x.next_tokens
        return calls.ContextRows(feats, nxt, start, rows)

    def propose(self, slots: list[SlotView | None]) -> Proposal:
        """One draft call over slots [0, n), rounded up to a bucket; idle rows draft garbage nobody reads. When
        every slot decodes greedily, the family's greedy variant runs (no distributions: none are needed)."""
        n = len(slots)
        rows = max((len(s.ctx.next_tokens) for s in slots if s is not None and s.ctx is not None), default=1)
        bucket = self.runner.spec.bucket("propose", B=n, C=rows)
        greedy = all(s is None or s.temperature <= 0 for s in slots)
        feeds = self.runner.inputs(0, bucket, greedy=greedy)  # bound buffers: filled in place
        b = bucket["B"]
        padded = [*slots, *[None] * (b - n)]
        temps, noise = np.zeros(b, np.float32), np.zeros((b, self.steps), np.float32)
        for i, s in enumerate(padded):
            if s is not None and s.temperature > 0:
                temps[i] = s.temperature
                noise[i] = s.rng.random(self.steps, dtype=np.float32)
        calls.head.settings(feeds, temperature=temps, noise=noise)  # the host scheduler cuts; the op reports survival
        anchors = np.array([s.pending if s is not None else 0 for s in padded], np.int64)
        self.calls.propose(feeds, self.rows([s.ctx if s is not None else None for s in padded], b), anchors)
        out = self.runner.run(0, bucket, greedy=greedy)
        counts = np.array([self.steps if s is not None else 0 for s in slots], np.int64)
        conf, surv, probs = out.get(io.CONFIDENCE_LOGITS), out.get(io.SURVIVAL), out.get(io.DRAFT_PROBS)
        top, top_p = out.get(io.DRAFT_FIRST_TOP), out.get(io.DRAFT_FIRST_PROBS)
        return Proposal(tokens=out[io.DRAFT_TOKENS][:n], counts=counts,
                        probs=probs[:n] if probs is not None else None,
                        confidence_logits=conf[:n] if conf is not None else None, vocab_ids=self.vocab_ids,
                        survival=surv[:n] if surv is not None else None, head=self.head.name,
                        first_top=top[:n] if top is not None else None,
                        first_probs=top_p[:n] if top_p is not None else None)

    @property
    def graph(self) -> GraphDrafter:
        return self

    def observe(self, slot: int, verified: int, accepted: int, path: np.ndarray | None = None) -> None:
        pass

    def plan(self, slots: list[SlotView | None], scheduler) -> DraftPlan:
        return DraftPlan(None, None, True, scheduler.history.survival())

    def drafted_by(self, lookup: np.ndarray) -> None:
        pass


class NGramDrafter:
    """Prompt lookup: the longest suffix (n <= max_n) of a slot's tokens that occurred before proposes the
    tokens that followed its latest earlier occurrence, up to `steps`; no match, no drafts.

    Its drafts' survivals come from the acceptance measured so far for lookups of the same match length: after a
    1-token match a lookup's first draft is accepted far less often than after a 3-token one (on code, 16-23% against
    84-93%: scripts/lookup_sim.py --by-match), so one curve for all would refuse the long matches' drafts or admit
    the short ones'."""

    needs_features = False
    calls = None
    graph = None
    picks = False
    backlog_rounds = 1

    def __init__(self, steps: int, *, max_n: int = 3, later: float = 0.5, width: int = 1, branch: int = 2) -> None:
        from specrt.runtime.schedulers import AcceptanceHistory  # (schedulers imports this module)

        if steps < 1 or max_n < 1 or width < 1 or branch < 1:
            raise SpecrtError(f"n-gram drafting needs gamma >= 1, n >= 1 and a tree width >= 1, got gamma {steps}, "
                              f"n {max_n}, width {width}")
        self.steps, self.max_n, self.width, self.branch = steps, max_n, width, min(branch, steps)
        # per match length (0: none); `later`: the prior acceptance of the drafts after a lookup's first
        self.histories = [AcceptanceHistory(steps, later=later) for _ in range(max_n + 1)]
        # a tree's other continuations, by rank: their acceptance when the best one's first draft was rejected
        self.branches = [AcceptanceHistory(self.branch, later=later) for _ in range(width - 1)]
        self.nodes = steps + (width - 1) * self.branch  # drafts a proposal may hold
        self._tokens = np.zeros((0, self.nodes), np.int64)
        self._counts = np.zeros(0, np.int64)
        self._survival = np.zeros((0, self.nodes), np.float32)
        self._parents = np.zeros((0, self.nodes), np.int64)
        self._branch_of = np.zeros((0, self.nodes), np.int64)  # each node's continuation (0: the best one)
        self.match = np.zeros(0, np.int64)  # each slot's last lookup's match length

    def allocate(self, slots: int) -> None:
        if len(self._counts) != slots:
            self._tokens = np.zeros((slots, self.nodes), np.int64)
            self._counts = np.zeros(slots, np.int64)
            self._survival = np.zeros((slots, self.nodes), np.float32)
            self._parents = np.zeros((slots, self.nodes), np.int64)
            self._branch_of = np.zeros((slots, self.nodes), np.int64)
            self.match = np.zeros(slots, np.int64)

    def prefill(self, slot: int, ctx: Context) -> None:
        return None

    def propose(self, slots: list[SlotView | None]) -> Proposal:
        n = len(slots)
        if len(self._counts) < n:
            self.allocate(n)
        tokens, counts, survival, match = self._tokens[:n], self._counts[:n], self._survival[:n], self.match[:n]
        counts[:], survival[:], match[:] = 0, 0.0, 0
        if self.width > 1:
            return self._propose_trees(slots)
        for i, s in enumerate(slots):
            if s is not None:
                follow, match[i] = lookup_match(s.history(), self.max_n, self.steps)
                counts[i] = len(follow)
                tokens[i, :len(follow)] = follow
                if len(follow):
                    survival[i] = self.histories[match[i]].survival()
        return Proposal(tokens=tokens, counts=counts, probs=None, survival=survival)

    def _propose_trees(self, slots: list[SlotView | None]) -> Proposal:
        """The best continuation and up to width - 1 others with other first tokens (`lookup_tree`), as one tree per
        slot, its nodes in order of survival: the best continuation's from its match length's history, another's its
        rank's history times the chance the best one's first draft is rejected."""
        n = len(slots)
        tokens, counts, survival, match = self._tokens[:n], self._counts[:n], self._survival[:n], self.match[:n]
        parents, branch_of = self._parents[:n], self._branch_of[:n]
        parents[:] = np.arange(self.nodes) - 1
        for i, s in enumerate(slots):
            if s is None:
                continue
            follows, match[i] = lookup_tree(s.history(), self.max_n, self.steps, self.width, self.branch)
            if not follows:
                continue
            best = self.histories[match[i]].survival()
            nodes = []  # (survival, branch, parent, token), branches in rank order, each in depth order
            for r, follow in enumerate(follows):
                surv = best if r == 0 else (1.0 - best[0]) * self.branches[r - 1].survival()
                nodes += [(float(surv[d]), r, len(nodes) + d - 1 if d else -1, int(t)) for d, t in enumerate(follow)]
            order, up = tree.by_survival([x[0] for x in nodes], [x[2] for x in nodes])
            k = len(nodes)
            tokens[i, :k] = [nodes[x][3] for x in order]
            survival[i, :k] = [nodes[x][0] for x in order]
            branch_of[i, :k] = [nodes[x][1] for x in order]
            parents[i, :k] = up
            counts[i] = k
        return Proposal(tokens=tokens, counts=counts, probs=None, survival=survival, parents=parents)

    def observe(self, slot: int, verified: int, accepted: int, path: np.ndarray | None = None) -> None:
        """A round's outcome for `slot`: the acceptance of lookups of its match length (a tree's: of each
        continuation it verified; `path`, the accepted cells, says which one they followed)."""
        if self.width == 1 or verified == 0:
            self.histories[self.match[slot]].observe(verified, accepted)
            return
        admitted = self._branch_of[slot, :verified]
        first = path[1] - 1 if path is not None else 0  # no path: the admitted nodes were a chain
        taken = int(admitted[first]) if accepted else -1
        self.histories[self.match[slot]].observe(int((admitted == 0).sum()), accepted if taken == 0 else 0)
        if taken != 0:  # the best continuation's first draft was rejected: the others were tried
            for r in range(1, self.width):
                self.branches[r - 1].observe(int((admitted == r).sum()), accepted if taken == r else 0)

    def plan(self, slots: list[SlotView | None], scheduler) -> DraftPlan:
        found = self.propose(slots)
        return DraftPlan(found, scheduler.survival(found) if scheduler.traits.reads_survival else None, False)

    def drafted_by(self, lookup: np.ndarray) -> None:
        pass


def lookup(history: np.ndarray, max_n: int, steps: int) -> np.ndarray:
    """Up to `steps` tokens that followed the latest earlier occurrence of the longest suffix (n <= max_n).

    An occurrence ends at some j <= size - 2 (a token follows it), so the candidates are the earlier positions of
    the last token; each one's match is grown backwards over the suffix, latest candidate first, stopping at the
    first full-length match. This runs for every slot every round: one vectorized pass, then the few candidates."""
    return lookup_match(history, max_n, steps)[0]


def lookup_match(history: np.ndarray, max_n: int, steps: int) -> tuple[np.ndarray, int]:
    """`lookup`'s tokens and the length of the suffix they follow (0: none found)."""
    size = len(history)
    ends = np.flatnonzero(history[:size - 1] == history[size - 1]) if size > 1 else ()
    if not len(ends):
        return history[:0], 0
    top = min(max_n, size - 1)
    suffix = history[size - top:].tolist()[::-1]  # the last token first
    best, best_n = int(ends[-1]), 1
    for j in ends[::-1].tolist() if top > 1 else ():
        n = 1
        while n < top and j >= n and history[j - n] == suffix[n]:
            n += 1
        if n > best_n:
            best, best_n = j, n
            if n == top:
                break
    return history[best + 1:best + 1 + steps], best_n


def lookup_tree(history: np.ndarray, max_n: int, steps: int, width: int, branch: int
                ) -> tuple[list[np.ndarray], int]:
    """`lookup_match`'s continuation (up to `steps` tokens) and up to width - 1 others (up to `branch` tokens each),
    each after an earlier occurrence of the suffix whose next token no chosen continuation starts with, by match length
    then recency; and the best one's match length (0: none found)."""
    size = len(history)
    ends = np.flatnonzero(history[:size - 1] == history[size - 1]) if size > 1 else np.zeros(0, np.int64)
    if not len(ends):
        return [], 0
    top = min(max_n, size - 1)
    n = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for k in range(1, top):  # grow every candidate's match backwards at once
        alive &= (ends >= k) & (history[np.maximum(ends - k, 0)] == history[size - 1 - k])
        n += alive
    order = np.lexsort((-ends, -n))  # longest match first, then the latest
    best = int(ends[order[0]])
    follows = [history[best + 1:best + 1 + steps]]
    firsts = {int(history[best + 1])}
    for k in order[1:].tolist():
        if len(follows) == width:
            break
        j = int(ends[k])
        if int(history[j + 1]) not in firsts:
            firsts.add(int(history[j + 1]))
            follows.append(history[j + 1:j + 1 + branch])
    return follows, int(n[order[0]])


def make_drafter(method: Method, art_dir: Path, manifest: io.Manifest, *, gamma: int, backend: str = "ort",
                 threads: int | None = None, ngram: int = 3, costs: Costs | None = None, gated: bool = False,
                 tree: int = 1, **where) -> Drafter:
    """The drafter of a speculative method: n-gram lookups, a head ("mtp", "dspark"), or a head with lookups
    ("dspark+ngram", "mtp+ngram": runtime/hybrid.py, which needs the cost profile `costs`). `gated`: a head alone is
    called only on the rounds where it promises more committed tokens per ms than a plain decoding step (the hybrid's
    choice without lookups; the engine asks for it under sps and sps-async), and a hybrid looks up only on the rounds
    where a lookup could be admitted or the head is called. `where`: load_runner's device, dtype."""
    if method.head is None:
        return NGramDrafter(gamma, max_n=ngram, width=tree)
    name = method.head
    if name not in manifest.heads:
        have = ", ".join(manifest.heads) or "none"
        raise SpecrtError(f"--method {method.name} needs an artifact exported with a {name} head "
                          f"(this one has: {have}); export with --draft or --mtp, or use --method ngram")
    head = GraphDrafter(art_dir, manifest, name, backend=backend, threads=threads, **where)
    if not method.hybrid and not gated:
        return head
    from specrt.runtime.hybrid import EXPLORE, EXPLORE_MAX, HybridDrafter

    # the device round (torch) keeps the backlog on the device: the prompt must reach the head at prefill there, and
    # the buffer holds EXPLORE rounds
    device = backend == "torch"
    return HybridDrafter(head, costs, max_n=ngram, temperatures=manifest.heads[name].temperatures,
                         lookups=method.hybrid, lazy=gated, defer_prefill=not device,
                         explore_max=EXPLORE if device else EXPLORE_MAX, hold=not device)
