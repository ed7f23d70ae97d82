"""A drafter that combines n-gram lookups with a draft head: per round, whichever promises more.

    lookup    every active slot looks its history up (no graph call). Under a cost-aware scheduler (`lazy`), not on
              a round where no lookup could be admitted (the lookups' first-position acceptance does not beat a
              plain step at this batch's costs) unless the head is called: on chat text under load most rounds
              are such, and a lookup, its survivals and their admission cost host time a decoding step does not
    decide    Algorithm 1's expected rate (committed tokens per ms on the cost profile; runtime/schedulers.py
              `admission`) of the lookups alone, against the rate the rounds that called the head have realized
              lately: the head's value shows only after its call (the confidences that choose what to verify), so
              its past rounds are the estimate, kept per request (`Record`: tokens committed and verified per head
              round the request was drafted for, decayed; a new request starts from the record of every request
              before it, at the weight of PRIOR_ROUNDS rounds, so its own text soon decides: code the head
              drafts well and chat it does not are priced apart, in turn or side by side). A slot that kept its
              lookup on a head round, or that an exploration left out, adds nothing: what lookups commit on the
              head's rounds would credit the head most where lookups need it least. A round's price sums its
              active requests' records at this round's batch: a call for n slots costs the head's draft call for
              n and a verify of the tokens the active requests verified (so idle slots, as a batch drains, neither
              dilute nor inflate it). After
              EXPLORE rounds without it, the head is called anyway, so its estimate follows the text; each such
              exploration that does not win the head back doubles the wait before the next (up to
              EXPLORE_MAX rounds: a head that never pays, as under load, costs 1/256 of the rounds, not 1/32, and
              each of its calls first writes the skipped rounds' backlog); a round the head wins resets it.
    head      when called, the head drafts for every slot; each slot keeps whichever block's survival sums higher
              (`pick`)

Without lookups (`lookups=False`) the same choice gates a head alone: `dspark` or `mtp` under a cost-aware scheduler
(sps, sps-async) call the head only on the rounds where its realized rate beats a plain decoding step's, so a draft
call that would go unverified under load is not made (`drafters.make_drafter`'s `gated`), with the same explorations.

`choose` (lookup and decide) runs on the host on both paths; the device round (runtime/device_round.py) runs the
head and `pick` on the device, keeping the backlog there. A skipped head does not see the rounds' verified
positions: they wait in the slot's backlog, and the next head call writes them first (rows beyond what one
propose call takes go through the head's prefill bucket). The choice
reads only draft-side information and past rounds, never this round's verification, so the loop stays exact; a
lookup row is a one-hot draft (`Proposal.onehot`) beside the head's distributions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime import steps
from specrt.runtime.arrays import Array, namespace
from specrt.runtime.drafters import Context, DraftPlan, GraphDrafter, NGramDrafter, Proposal, SlotView
from specrt.runtime.schedulers import (AcceptanceHistory, Costs, admission, first_pair, prefix_survival,
                                      verify_curve)

LOOKUP, HEAD = 0, 1
LOOKUP_LATER = 0.8  # prior conditional acceptance of a lookup's drafts after its first
EXPLORE = 32  # rounds without the head before it is first called regardless of its estimate
EXPLORE_MAX = 256  # the longest wait, after explorations that did not win the head back
DECAY = 0.95  # weight of the head's older rounds in its realized rate, per head round
# before any head round: as if PRIOR_ROUNDS slot rounds had each verified one draft and committed PRIOR_TOKENS; they
# decay with the head's rounds like any other, so a head's own record soon decides (a prior that stayed would hold a
# head whose drafts are never accepted at 1/6 of its rounds at 1.5 tokens, enough to call it at every round at
# one request in flight, where a verify of 2 tokens costs ~1.1 decoding steps)
PRIOR_ROUNDS, PRIOR_TOKENS = 4.0, 1.5


class Record:
    """Decayed sums of a head's slot rounds and the tokens they committed and verified."""

    __slots__ = ("rounds", "committed", "verified")

    def __init__(self, rounds: float = PRIOR_ROUNDS, committed: float = PRIOR_ROUNDS * PRIOR_TOKENS,
                 verified: float = PRIOR_ROUNDS * 2.0) -> None:
        self.rounds, self.committed, self.verified = rounds, committed, verified

    def add(self, rows: list[tuple[int, int]]) -> None:
        """One head round's (verified, accepted) rows, after decaying the older ones."""
        self.rounds = DECAY * self.rounds + len(rows)
        self.committed = DECAY * self.committed + sum(a + 1 for _, a in rows)
        self.verified = DECAY * self.verified + sum(v + 1 for v, _ in rows)

    def per_round(self) -> tuple[float, float]:
        """Tokens committed and verified per slot round."""
        return self.committed / self.rounds, self.verified / self.rounds

    def prior(self, weight: float = PRIOR_ROUNDS) -> "Record":
        """This record's means at the weight of `weight` rounds: where a new request's record starts."""
        c, v = self.per_round()
        return Record(weight, weight * c, weight * v)


def merge(parts: list[Context]) -> Context | None:
    """Contiguous pending rows, in order, as one context (None for none)."""
    if len(parts) <= 1:
        return parts[0] if parts else None
    for a, b in zip(parts, parts[1:]):
        assert b.pos == a.pos + len(a.next_tokens), "pending context rows must be contiguous"
    return Context(parts[0].pos, np.concatenate([c.features for c in parts]),
                   np.concatenate([c.next_tokens for c in parts]))


@dataclass
class _Caught:
    """A slot as the head sees it: its backlog and this round's rows as one context."""

    view: SlotView
    ctx: Context | None

    def __getattr__(self, name):
        return getattr(self.view, name)


class HybridDrafter:
    """n-gram lookups, with `head` called only on the rounds where it promises more committed tokens per ms."""

    needs_features = True
    calls = None  # it chooses between lookups and its head on the host each round
    picks = True

    def __init__(self, head: GraphDrafter, costs: Costs | None, *, max_n: int = 3, temperatures=(),
                 lookups: bool = True, lazy: bool = False, defer_prefill: bool = False,
                 explore_max: int = EXPLORE_MAX, hold: bool = True) -> None:
        if costs is None:
            raise SpecrtError(f"--method {head.head.name}+ngram needs a cost profile (run `specrt profile ART`)")
        self.head, self.costs = head, costs
        # False: a gated head (`make_drafter`'s `gated`), no lookups: a round without the head is a plain decode step
        self.lookups = lookups
        # True (a cost-aware scheduler, which admits only drafts that pay): no lookup on a round where none could be
        # admitted, unless the head is called (its slots may keep their lookups' drafts)
        self.lazy = lazy
        # True: a prompt's rows wait in the backlog like a skipped round's, written by the head's first call (a
        # request the head never drafts for never costs its prefill); the host loop only
        self.defer_prefill = defer_prefill
        # the longest wait between explorations: the device round's backlog buffer holds explore_max + 1 rounds
        self.explore_max = max(explore_max, EXPLORE)
        # True: an exploration drafts for one slot (`_held`); the device round drafts for all (its backlogs are there)
        self.hold = hold
        self.steps = head.steps
        # blocks as wide as the head's; its drafts survive as lookups of the same match length have been accepted. A
        # lookup that starts right tends to go on (it copies a span): optimistic about untried later positions
        self.lookup = NGramDrafter(self.steps, max_n=max_n, later=LOOKUP_LATER)
        self.temperatures = np.asarray(temperatures, np.float32)
        self.head_history = AcceptanceHistory(self.steps)
        self.backlog: list[list[Context]] = []  # per slot: the rows of rounds without the head, in order
        self.source = np.zeros(0, np.int64)  # per slot: who drafted its row of the last proposal
        self.held = np.zeros(0, bool)  # per slot: left out of the last proposal's head call (an exploration's)
        self.rounds = {LOOKUP: 0, HEAD: 0}  # rounds drafted without and with the head
        # the head's rounds: every request's (a new request's prior) and, per slot, its request's own
        self.record = Record()
        self.records: list[Record] = []
        self.since_head = 0
        self.explore_every = EXPLORE  # rounds without the head before it is explored (doubles while it loses)
        self._explored = False  # the last head call was an exploration
        self._last: list = []  # this round's (slot, verified, accepted) per head-drafted slot, folded in next propose
        self._last_head = False
        self._empty: dict[int, tuple[Proposal, np.ndarray]] = {}

    @property
    def graph(self) -> GraphDrafter:
        return self.head

    @property
    def backlog_rounds(self) -> int:
        return self.explore_max + 1

    def plan(self, slots: list[SlotView | None], scheduler) -> DraftPlan:
        found, a_lookup, head = self.choose(slots)
        return DraftPlan(found, a_lookup, head, self.head_history.survival())

    def drafted_by(self, lookup: np.ndarray) -> None:
        self.source[:len(lookup)] = np.where(lookup, LOOKUP, HEAD)

    def allocate(self, slots: int) -> None:
        self.head.allocate(slots)
        self.lookup.allocate(slots)
        self.backlog = [[] for _ in range(slots)]
        self.source = np.zeros(slots, np.int64)
        self.held = np.zeros(slots, bool)
        self.records = [self.record.prior() for _ in range(slots)]

    def prefill(self, slot: int, ctx: Context) -> Context | None:
        self.records[slot] = self.record.prior()  # a new request: priced on its own rounds from here on
        if self.defer_prefill:
            self.backlog[slot] = [ctx]
            return None
        self.backlog[slot] = []
        return self.head.prefill(slot, ctx)

    def observe(self, slot: int, verified: int, accepted: int, path: np.ndarray | None = None) -> None:
        if self.source[slot] == LOOKUP:
            self.lookup.observe(slot, verified, accepted, path)  # into its match length's history
        else:
            self.head_history.observe(verified, accepted)
        if self.source[slot] == HEAD:  # a row the head's drafts were not verified for says nothing of them
            self._last.append((slot, verified, accepted))

    def head_rate(self, n: int, active: list[int]) -> float:
        """Committed tokens per ms a head round for n slots promises to the requests in the `active` slots: the
        tokens each committed and verified per head round lately (its record), at this round's costs."""
        if not active:
            return 0.0
        committed = verified = 0.0
        for i in active:
            c, v = self.records[i].per_round()
            committed += c
            verified += v
        lo = int(verified)  # the verify cost between its whole token counts
        verify = self.costs.verify_ms(n, lo) if lo > 0 else 0.0
        if verified > lo:
            verify += (verified - lo) * (self.costs.verify_ms(n, lo + 1) - verify)
        return committed / (self.costs.draft_ms(self.head.head.name, n) + verify)

    def _fold(self) -> None:
        """Add the last round, if it called the head, to the records of the requests it drafted for and of all."""
        if self._last_head and self._last:
            for slot, v, a in self._last:
                self.records[slot].add([(v, a)])
            self.record.add([(v, a) for _, v, a in self._last])
        self._last = []

    def choose(self, slots: list[SlotView | None]) -> tuple[Proposal, np.ndarray, bool]:
        """This round's lookups, their survivals [n, steps], and whether the head is called (counted as chosen)."""
        self._fold()
        n = len(slots)
        self.held[:n] = False
        live = [i for i, s in enumerate(slots) if s is not None]
        active = len(live)
        looked = self.lookups and (not self.lazy or self._lookups_may_pay(n, active))
        found, a_lookup = self._look(slots) if looked else self._nothing(n)
        if looked and found.counts.any():
            _, without = admission(a_lookup, np.array([s is not None for s in slots]), 0.0, self.costs)
        else:  # no drafts without the head: the round is a decoding step of the active slots (admission's rate)
            without = active / self.costs.verify_ms(n, active)
        wins = without < self.head_rate(n, live)
        if wins:  # back off while explorations do not win the head back; reset when it wins
            self.explore_every = EXPLORE
        elif self._explored:
            self.explore_every = min(2 * self.explore_every, self.explore_max)
        head = wins or self.since_head >= self.explore_every
        self._explored = head and not wins
        self._last_head = head
        self.rounds[HEAD if head else LOOKUP] += 1
        self.since_head = 0 if head else self.since_head + 1
        if head and self.lookups and not looked:  # the head's slots may still prefer their lookups (`pick`)
            found, a_lookup = self._look(slots)
        return found, a_lookup, head

    def _held(self, slots: list[SlotView | None]) -> np.ndarray:
        """[n] bool: the slots an exploration leaves out, all active slots but the one with the fewest pending rows.
        An exploration measures what a slot's head round commits and verifies, which one slot does; each slot it
        drafts for first writes that slot's backlog (every row since the head's last call, through its prefill
        bucket), which under load is most of the exploration's cost."""
        pending = np.array([sum(len(c.next_tokens) for c in self.backlog[i]) + (len(s.ctx.next_tokens) if s.ctx else 0)
                            if s is not None else -1 for i, s in enumerate(slots)])
        held = pending > 0  # a slot with no pending row costs no catch-up: drafted for
        if held.any() and not (pending == 0).any():
            held[int(np.argmin(np.where(held, pending, np.iinfo(np.int64).max)))] = False
        return held

    def _look(self, slots: list[SlotView | None]) -> tuple[Proposal, np.ndarray]:
        """Every slot's lookup and its survivals [n, steps], each on the history of its match length."""
        found = self.lookup.propose(slots)
        if not found.counts.any():
            return self._nothing(len(slots))
        return found, steps.survive(found.survival, found.counts)

    def _lookups_may_pay(self, n: int, active: int) -> bool:
        """Whether a lookup could be admitted this round: Algorithm 1's first pair (survival at most the best first
        position of any match length, whatever is found) improves a decoding step's rate, as
        `schedulers.admission` decides it."""
        if not active:
            return False
        v = np.float64(np.float32(max(h.survival()[0] for h in self.lookup.histories[1:])))
        curve = verify_curve(self.costs, n, n * (self.steps + 1))
        return bool(v > 0) and first_pair(v, np.float64(active), 0.0, curve)[1]

    def _nothing(self, n: int) -> tuple[Proposal, np.ndarray]:
        """A proposal without drafts and its survivals, for n slots (a gated head not called, lookups that found
        nothing; kept per n, never written: a round without drafts is a plain decoding step, which reads neither)."""
        if n not in self._empty:
            self._empty[n] = (Proposal(tokens=np.zeros((n, self.steps), np.int64), counts=np.zeros(n, np.int64),
                                       probs=None), np.zeros((n, self.steps), np.float32))
        return self._empty[n]

    def propose(self, slots: list[SlotView | None]) -> Proposal:
        found, a_lookup, head = self.choose(slots)
        if head:
            return self._with_head(slots, found, a_lookup)
        for i, s in enumerate(slots):
            if s is not None and s.ctx is not None:
                self.backlog[i].append(s.ctx)  # merged once, when the head is next called
        self.source[:len(slots)] = LOOKUP
        if not self.lookups:
            return found  # nothing drafted
        return Proposal(tokens=found.tokens, counts=found.counts, probs=None, survival=a_lookup)

    def _with_head(self, slots: list[SlotView | None], found: Proposal, a_lookup: np.ndarray) -> Proposal:
        held = self._held(slots) if self._explored and self.hold else np.zeros(len(slots), bool)
        self.held[:len(slots)] = held
        caught: list[SlotView | None] = []
        catch_up = False  # some slot's backlog is written first
        for i, s in enumerate(slots):
            if s is None:
                caught.append(None)
                continue
            if held[i]:  # its rows wait in the backlog; the call writes nothing it will read (`_Held`)
                if s.ctx is not None:
                    self.backlog[i].append(s.ctx)
                caught.append(_Held(s.pending, Context(self.backlog[i][0].pos, np.zeros((0, 0), np.float32),
                                                       np.zeros(0, np.int64))))
                continue
            catch_up = catch_up or bool(self.backlog[i])
            ctx = merge(self.backlog[i] + ([s.ctx] if s.ctx is not None else []))
            self.backlog[i] = []
            if ctx is not None and len(ctx.next_tokens) > self.head.max_rows:
                ctx = self.head.prefill(i, ctx)  # writes all but the last row
            caught.append(_Caught(s, ctx))
        p = self.head.propose(caught)
        a_head = prefix_survival(p, self.temperatures, self.head_history, self.steps)
        use = pick(a_lookup, a_head, found.counts) | held  # a held slot keeps its lookup, or drafts nothing
        self.source[:len(slots)] = np.where(use, LOOKUP, HEAD)
        out = p.tokens.copy()
        out[use] = found.tokens[use]
        top = None if p.first_top is None else np.where(use[:, None], -1, p.first_top)  # lookup rows: no alternatives
        return Proposal(tokens=out, counts=np.where(use, found.counts, p.counts), probs=p.probs,
                        confidence_logits=p.confidence_logits, vocab_ids=p.vocab_ids,
                        survival=np.where(use[:, None], a_lookup, a_head).astype(np.float32), head=p.head,
                        onehot=use, catch_up=catch_up, first_top=top, first_probs=p.first_probs)


@dataclass
class _Held:
    """A slot an exploration leaves out, as the head's call sees it: no context rows, its cache written from `ctx.pos`
    (its first pending row's position, past everything the head attends to for it) and rewritten when its backlog
    is; drafted greedily (its rng untouched), the drafts discarded."""

    pending: int
    ctx: Context
    temperature: float = 0.0


def pick(a_lookup: Array, a_head: Array, lookup_counts: Array) -> Array:
    """[n] bool: the slots whose lookups promise more than the head's block (survivals summed; a slot without a
    lookup keeps the head's)."""
    xp = namespace(a_lookup, a_head)
    return (xp.sum(a_lookup, axis=1) > xp.sum(a_head, axis=1)) & (lookup_counts > 0)
