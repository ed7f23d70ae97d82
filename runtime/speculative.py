"""The lossless draft/verify round: propose, schedule, verify, accept (the engine commits).

    slot: cache holds positions 0..L-1; `pending` (the anchor) is the token at position L
    propose   the drafter proposes up to K drafts per slot (a graph head first writes the slot's
              pending context rows into its own cache)
    schedule  verify length l per slot: the scheduler's choice, capped by the drafts proposed and
              by the request's remaining token budget (l = 0 is a plain decode step)
    verify    one target call over [anchor, d_1..d_l] at positions L..L+l for every slot, packed: only
              the slots' tokens are computed, in a token budget rounded up to a bucket
    accept    greedy prefix match or rejection sampling -> a accepted drafts + one bonus token
    commit    (engine) L += a + 1; rejected drafts' K/V stay beyond L and are overwritten later, so
              rollback is free; the verified rows L..L+a become the draft's next context rows
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt import artifact as io
from specrt.runtime.acceptance import Verdict, accept_greedy, accept_sampled
from specrt.runtime.backends import Runner
from specrt.runtime.drafters import Drafter, Proposal, SlotView
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.schedulers import Load, Scheduler


@dataclass(frozen=True, slots=True)
class Outcome:
    """One slot's round: what was verified and accepted, and the tokens to commit."""

    verify_len: int
    verdict: Verdict
    tokens: list[int]  # the accepted drafts, then the bonus token
    features: np.ndarray | None  # [a + 1, F] target features of the anchor and accepted rows (a view)


@dataclass
class Round:
    """Everything one round produced, for the engine to commit and observers to record."""

    proposal: Proposal
    outcomes: list[Outcome | None]  # per slot in [0, n); None for idle slots
    draft_s: float
    verify_s: float  # scheduling and the verify call
    verified: int = 0  # tokens verified in all (anchors and drafts of the active slots)
    call_s: float = 0.0  # the verify call alone (filling and running it): what the cost table learns from


class SlotState(SlotView, Protocol):
    """What the round reads from a slot, beyond what drafters read."""

    length: int  # tokens in the target cache
    params: SamplingParams
    budget: int  # tokens the request may still generate


class Speculator:
    """Runs draft/verify rounds over a target runner with a drafter and a scheduler."""

    def __init__(self, target: Runner, drafter: Drafter, scheduler: Scheduler, *, gamma: int) -> None:
        self.target, self.drafter, self.scheduler, self.gamma = target, drafter, scheduler, gamma

    def round(self, slots: list[SlotState | None], load: Load) -> Round:
        t0 = time.perf_counter()
        proposal = self.drafter.propose(slots)
        t1 = time.perf_counter()
        lengths = self.schedule(slots, proposal, load)
        ts = time.perf_counter()
        logits, features = self.verify(slots, proposal, lengths)
        t2 = time.perf_counter()
        verified = sum(int(lengths[i]) + 1 for i, s in enumerate(slots) if s is not None)
        outcomes = [self.accept(s, proposal, i, int(lengths[i]), logits[i], features)
                    if s is not None else None for i, s in enumerate(slots)]
        for i, o in enumerate(outcomes):
            if o is not None:
                self.scheduler.observe(o.verify_len, o.verdict.accepted)
                self.drafter.observe(i, o.verify_len, o.verdict.accepted)
        return Round(proposal, outcomes, draft_s=t1 - t0, verify_s=t2 - t1, verified=verified, call_s=t2 - ts)

    def schedule(self, slots: list[SlotState | None], proposal: Proposal, load: Load) -> np.ndarray:
        """The scheduler's lengths, capped by the drafts proposed and each request's budget."""
        lengths = np.minimum(self.scheduler.schedule(slots, proposal, load), proposal.counts)
        for i, s in enumerate(slots):
            # the bonus token is always committed, so at most budget - 1 drafts can be
            lengths[i] = max(0, min(lengths[i], s.budget - 1, self.gamma)) if s is not None else 0
        return lengths

    def verify(self, slots: list[SlotState | None], proposal: Proposal, lengths: np.ndarray
               ) -> tuple[list[np.ndarray | None], np.ndarray | None]:
        """One packed target call over [anchor, drafts] of every active slot: per slot its logits [l+1, V]
        (None for idle slots), and features [n,T,F] (or None).

        The slots' tokens fill a [n, T] grid (T = the longest verify + 1), and only they are computed: they are
        packed into the smallest exported token budget P that holds them (`artifact.token_budgets`), so a
        short verify costs its own tokens, not the longest slot's. Budget padding computes unused grid cells."""
        n, t = len(slots), int(lengths.max()) + 1
        spec = self.target.spec
        active = [i for i, s in enumerate(slots) if s is not None]
        count = sum(int(lengths[i]) + 1 for i in active)
        bucket = spec.bucket("verify", B=n, T=t, P=count) if t > 1 else spec.bucket("decode", B=n)
        feeds = self.target.inputs(0, bucket)  # bound buffers: filled in place
        ids, start, rows = feeds[io.INPUT_IDS], feeds[io.WRITE_INDEX], feeds[io.TOKEN_ROWS]
        T, P = bucket["T"], bucket["P"]
        ids[:] = 0
        start[:] = 0  # idle slots (and bucket padding) write a dummy row at position 0 of their own row
        cells = np.zeros(bucket["B"] * T, bool)
        offsets, k = {}, 0
        for i in active:
            s, ell = slots[i], int(lengths[i])
            start[i] = s.length
            ids[i, 0] = s.pending
            ids[i, 1:ell + 1] = proposal.tokens[i, :ell]
            rows[k:k + ell + 1] = i * T + np.arange(ell + 1)
            cells[i * T:i * T + ell + 1] = True
            offsets[i] = k
            k += ell + 1
        rows[k:] = np.flatnonzero(~cells)[:P - k]  # budget padding: distinct cells no real token uses
        np.add(start[:, None], np.arange(T), out=feeds[io.POSITION_IDS])
        feeds[io.LOGIT_ROWS][:] = np.arange(bucket["R"])
        out = self.target.run(0, bucket)
        logits = out[io.LOGITS]
        per_slot = [logits[offsets[i]:offsets[i] + int(lengths[i]) + 1] if i in offsets else None for i in range(n)]
        return per_slot, out.get(io.FEATURES)

    @staticmethod
    def accept(slot: SlotState, proposal: Proposal, i: int, ell: int, logits: np.ndarray,
               features: np.ndarray | None) -> Outcome:
        drafts = proposal.tokens[i, :ell]
        if slot.params.greedy:
            verdict = accept_greedy(drafts, logits[:ell + 1])
        else:
            probs = proposal.draft_probs(i, ell, logits.shape[-1])
            verdict = accept_sampled(drafts, probs, logits[:ell + 1], slot.params, slot.rng)
        a = verdict.accepted
        rows = features[i, :a + 1] if features is not None else None
        return Outcome(verify_len=ell, verdict=verdict, tokens=[*drafts[:a].tolist(), verdict.bonus], features=rows)
