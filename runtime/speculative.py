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
from specrt.runtime import calls, steps
from specrt.runtime.acceptance import Verdict, accept_sampled
from specrt.runtime.backends import Runner
from specrt.runtime.costs import CostTable
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


@dataclass(frozen=True, slots=True)
class Verified:
    """One verify call: logits [P, V] (the computed cells in slot order), the argmax of every grid cell [n, T], each
    slot's first row in the logits [n], the drafts verified [n, T - 1] (zero past each slot's length), and the
    target's features [n, T, F] (or None)."""

    logits: np.ndarray
    best: np.ndarray
    first: np.ndarray
    drafts: np.ndarray
    features: np.ndarray | None


class SlotState(SlotView, Protocol):
    """What the round reads from a slot, beyond what drafters read."""

    length: int  # tokens in the target cache
    params: SamplingParams
    budget: int  # tokens the request may still generate


class Speculator:
    """Runs draft/verify rounds over a target runner with a drafter and a scheduler, on the host (the engine's
    executor on ONNX Runtime and TensorRT; runtime/device_round.py is the torch backend's). Without a drafter (AR)
    every round is a plain decoding step. `costs`: the cost table the rounds' timings refine (runtime/costs.py)."""

    def __init__(self, target: Runner, drafter: Drafter | None, scheduler: Scheduler | None, *, gamma: int,
                 costs: CostTable | None = None) -> None:
        self.target, self.drafter, self.scheduler, self.gamma, self.costs = target, drafter, scheduler, gamma, costs
        self._none: dict[int, Proposal] = {}

    def round(self, slots: list[SlotState | None], load: Load) -> Round:
        """One round over slots [0, n) (None: idle)."""
        rnd = self._round(slots, load)
        if self.costs is not None:  # what the round's calls cost, for the next rounds' plans
            self.costs.observe_verify(len(slots), rnd.verified, rnd.call_s * 1e3)
            if rnd.proposal.head and not rnd.proposal.catch_up:
                self.costs.observe_draft(rnd.proposal.head, len(slots), rnd.draft_s * 1e3)
        return rnd

    def _round(self, slots: list[SlotState | None], load: Load) -> Round:
        t0 = time.perf_counter()
        proposal = self.drafter.propose(slots) if self.drafter is not None else self._nothing(len(slots))
        t1 = time.perf_counter()
        if not proposal.counts.any():  # nothing drafted (a gated head not called, no lookup found)
            return self.decode(slots, proposal, draft_s=t1 - t0)
        lengths = self.schedule(slots, proposal, load)
        if not lengths.any():  # drafts, none admitted (most rounds under load): a decoding step, observed as a round
            done = self.decode(slots, proposal, draft_s=t1 - t0)
            self.observe(done.outcomes)
            return done
        ts = time.perf_counter()
        call = self.verify(slots, proposal, lengths)
        t2 = time.perf_counter()
        verified = sum(int(lengths[i]) + 1 for i, s in enumerate(slots) if s is not None)
        outcomes = self.accept(slots, proposal, lengths, call)
        self.observe(outcomes)
        return Round(proposal, outcomes, draft_s=t1 - t0, verify_s=t2 - t1, verified=verified, call_s=t2 - ts)

    def _nothing(self, n: int) -> Proposal:
        """No drafts for n slots (AR)."""
        if n not in self._none:
            self._none[n] = Proposal(tokens=np.zeros((n, 0), np.int64), counts=np.zeros(n, np.int64), probs=None)
        return self._none[n]

    def observe(self, outcomes: list[Outcome | None]) -> None:
        """Each slot's verify length and acceptance, to the scheduler and the drafter."""
        for i, o in enumerate(outcomes):
            if o is not None:
                self.scheduler.observe(o.verify_len, o.verdict.accepted)
                self.drafter.observe(i, o.verify_len, o.verdict.accepted)

    def decode(self, slots: list[SlotState | None], proposal: Proposal, *, draft_s: float) -> Round:
        """A round without drafts as the plain decoding step it is: the decode bucket, each slot's row of logits
        (the same bits a verify call gives it: rows never depend on the call) and features, no scheduling. Nothing
        was verified, so the scheduler and drafter observe nothing (no acceptance history counts a round without
        drafts), which keeps the host's work per round near plain decoding's."""
        t0 = time.perf_counter()
        bucket = self.target.spec.bucket("decode", B=len(slots))
        anchor, start = calls.target.anchors(slots, bucket["B"])
        calls.target.grid(self.target.inputs(0, bucket), anchor, start, None, calls.target.dense_rows(bucket))
        out = self.target.run(0, bucket)
        call_s = time.perf_counter() - t0
        logits, features = out[io.LOGITS], out.get(io.FEATURES)
        none = np.zeros(0, np.int64)
        outcomes: list[Outcome | None] = []
        for i, s in enumerate(slots):
            if s is None:
                outcomes.append(None)
                continue
            if s.params.greedy:
                verdict = Verdict(0, int(np.argmax(logits[i])))
            else:  # the bonus draw of a round that verified nothing, uniforms included
                verdict = accept_sampled(none, None, logits[i:i + 1], s.params, s.rng, gamma=self.gamma)
            outcomes.append(Outcome(verify_len=0, verdict=verdict, tokens=[verdict.bonus],
                                    features=features[i, :1] if features is not None else None))
        verified = sum(s is not None for s in slots)
        return Round(proposal, outcomes, draft_s=draft_s, verify_s=time.perf_counter() - t0, verified=verified,
                     call_s=call_s)

    def schedule(self, slots: list[SlotState | None], proposal: Proposal, load: Load) -> np.ndarray:
        """The scheduler's lengths, capped by the drafts proposed, gamma and each request's budget."""
        active = np.array([s is not None for s in slots])
        budget = np.array([s.budget if s is not None else 0 for s in slots], np.int64)
        planned = np.asarray(self.scheduler.schedule(slots, proposal, load), np.int64)
        return steps.cap(planned, proposal.counts, budget, active, self.gamma)

    def verify(self, slots: list[SlotState | None], proposal: Proposal, lengths: np.ndarray) -> Verified:
        """One packed target call over [anchor, drafts] of every active slot (runtime/calls/target.py).

        Only the slots' tokens are computed: they are packed into the smallest exported token budget P that holds
        them (`artifact.token_budgets`), so a short verify costs its own tokens, not the longest slot's."""
        n, t = len(slots), int(lengths.max()) + 1
        active = np.array([s is not None for s in slots])
        count = int((lengths + 1)[active].sum())
        spec = self.target.spec
        bucket = spec.bucket("verify", B=n, T=t, P=count) if t > 1 else spec.bucket("decode", B=n)
        b, T = bucket["B"], bucket["T"]
        anchor, start = calls.target.anchors(slots, b)
        drafts = np.zeros((b, T - 1), np.int64)
        for i, s in enumerate(slots):
            if s is not None:
                drafts[i, :int(lengths[i])] = proposal.tokens[i, :int(lengths[i])]
        rows = calls.target.packed_rows(lengths, active, bucket)
        calls.target.grid(self.target.inputs(0, bucket), anchor, start, drafts, rows)
        out = self.target.run(0, bucket)
        logits = out[io.LOGITS]
        first = np.concatenate([[0], np.cumsum(np.where(active, lengths + 1, 0))[:-1]])
        return Verified(logits, steps.best(logits, rows, b, T)[:n], first, drafts[:n], out.get(io.FEATURES))

    def accept(self, slots: list[SlotState | None], proposal: Proposal, lengths: np.ndarray, call: Verified
               ) -> list[Outcome | None]:
        """Greedy slots by steps.accept, all at once; sampled ones by rejection sampling, each with its own rng."""
        logits, first, drafts, features = call.logits, call.first, call.drafts, call.features
        accepted, tokens = steps.accept(drafts, call.best, lengths)
        outcomes: list[Outcome | None] = []
        for i, s in enumerate(slots):
            if s is None:
                outcomes.append(None)
                continue
            ell = int(lengths[i])
            if s.params.greedy:
                verdict = Verdict(int(accepted[i]), int(tokens[i, accepted[i]]))
            else:
                probs = proposal.draft_probs(i, ell, logits.shape[-1])
                verdict = accept_sampled(drafts[i, :ell], probs, logits[first[i]:first[i] + ell + 1], s.params, s.rng,
                                         gamma=self.gamma)
            a = verdict.accepted
            rows = features[i, :a + 1] if features is not None else None
            outcomes.append(Outcome(verify_len=ell, verdict=verdict, tokens=[*drafts[i, :a].tolist(), verdict.bonus],
                                    features=rows))
        return outcomes
