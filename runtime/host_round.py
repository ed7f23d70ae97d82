"""The host's executor of the round (runtime/round.py): eager on numpy, each slot's drafts and verify rows packed.

    draft     the drafter's `propose` over the slots (a graph head first writes each slot's pending context rows into
              its own cache); its survivals, and the cost-aware rules' inputs from the cost table the rounds refine
    verify    one target call over only the active slots' anchors and admitted drafts, packed into the smallest
              exported token budget that holds them (`artifact.token_budgets`); a round that admits no draft runs
              the decoding step's bucket, the same bits per row
    sample    each sampled slot by rejection sampling on its own rows, its uniforms drawn from its rng as it goes
              (`acceptance.accept_sampled`: the target's distribution only up to the first rejection)
    commit    nothing here: the slots are the engine's sequences, which it commits from each outcome (its tokens, and
              its verified rows' features as the head's next context rows)

It is the engine's executor on ONNX Runtime and TensorRT; runtime/device_round.py is the torch backend's.
"""
from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from specrt import artifact as io
from specrt.runtime import calls, round as rounds, steps, tree
from specrt.runtime.acceptance import accept_sampled, accept_tree_sampled
from specrt.runtime.backends import Runner
from specrt.runtime.costs import CostTable
from specrt.runtime.drafters import Drafter, Proposal, SlotView
from specrt.runtime.round import Drafted, Round, RoundState, Verified
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.schedulers import Load, Scheduler


class SlotState(SlotView, Protocol):
    """What the round reads from a slot, beyond what drafters read."""

    length: int  # tokens in the target cache
    params: SamplingParams
    budget: int  # tokens the request may still generate


class HostRounds:
    """Runs rounds over a target runner with a drafter and a scheduler, on the host. Without a drafter (AR) every
    round is a plain decoding step. `costs`: the cost table the rounds' timings refine (runtime/costs.py)."""

    def __init__(self, target: Runner, drafter: Drafter | None, scheduler: Scheduler | None, *, gamma: int,
                 costs: CostTable | None = None, tree: int = 1) -> None:
        self.target, self.drafter, self.scheduler, self.gamma, self.costs = target, drafter, scheduler, gamma, costs
        self.tree = tree  # a head's drafts get up to tree - 1 alternatives beside their first (tree.graft)
        self._chain: np.ndarray | None = None  # this round's grafted nodes' chain positions (-1: alternatives)
        self.plans_on_costs = scheduler is not None and scheduler.traits.plans_on_costs
        self.capacity = np.full((), -1, np.int64)  # the scheduler's state across rounds (RoundState.capacity)
        self.sampled = False
        self._none: dict[int, Proposal] = {}
        self._states: dict[int, RoundState] = {}
        # this round's: its slots, the drafter's proposal, the draft and verify calls' times
        self._slots: list[SlotState | None] = []
        self._proposal: Proposal | None = None
        self._draft_s = self._call_s = 0.0
        self._masked: set[int] = set()  # tree_mask buffers a tree call left nonzero

    def run(self, slots: list[SlotState | None], load: Load) -> Round:
        """One round over slots [0, n) (None: idle): each slot's outcome, the scheduler and drafter told how it fared,
        the cost table what its calls cost."""
        n = len(slots)
        self._slots, self._proposal, self._draft_s, self._call_s, self._chain = slots, None, 0.0, 0.0, None
        state = self._state(slots)
        t0 = time.perf_counter()
        res = rounds.run(self, state)
        elapsed = time.perf_counter() - t0
        outcomes = rounds.outcomes(slots, res.lengths, res.accepted, res.tokens, res.verified.features, self.drafter,
                                   self.scheduler, drafted=res.drafted is not None, cells=res.cells)
        proposal = self._proposal if self._proposal is not None else self._nothing(n)
        verified = int(res.lengths.sum()) + sum(s is not None for s in slots)  # idle slots' lengths are 0
        rnd = Round(proposal, outcomes, draft_s=self._draft_s, verify_s=elapsed - self._draft_s, verified=verified,
                    call_s=self._call_s)
        if self.costs is not None:  # what the round's calls cost, for the next rounds' plans
            self.costs.observe_verify(n, verified, self._call_s * 1e3)
            if proposal.head and not proposal.catch_up:
                self.costs.observe_draft(proposal.head, n, self._draft_s * 1e3)
        return rnd

    def _state(self, slots: list[SlotState | None]) -> RoundState:
        """The round's state, in arrays kept per slot count (a round reads them, the engine commits the slots)."""
        n = len(slots)
        if n not in self._states:
            self._states[n] = RoundState(np.zeros(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64),
                                         np.zeros(n, np.int64), self.capacity)
        state = self._states[n]
        state.draft_ms, state.curve, state.explore = 0.0, None, None
        self.sampled = False
        for i, s in enumerate(slots):
            if s is None:
                state.active[i] = False
                state.length[i] = state.anchor[i] = state.budget[i] = 0
            else:
                state.active[i], state.length[i], state.anchor[i], state.budget[i] = True, s.length, s.pending, s.budget
                self.sampled |= not s.params.greedy
        return state

    def _nothing(self, n: int) -> Proposal:
        """No drafts for n slots (AR)."""
        if n not in self._none:
            self._none[n] = Proposal(tokens=np.zeros((n, 0), np.int64), counts=np.zeros(n, np.int64), probs=None)
        return self._none[n]

    # -- the round's calls (runtime/round.py `Executor`) -----------------------------------------------

    def draft(self, state: RoundState) -> Drafted | None:
        if self.drafter is None:
            return None
        t0 = time.perf_counter()
        p = self._proposal = self.drafter.propose(self._slots)
        self._draft_s = time.perf_counter() - t0
        if not p.counts.any():  # nothing drafted (a gated head not called, no lookup found): a decoding step
            return None
        if self.plans_on_costs:
            n = len(self._slots)
            tokens = n * (self.gamma + 1)
            state.draft_ms, state.curve = rounds.cost_inputs(self.costs, n, tokens, p.head)
            state.explore = self.costs.exploring(n, tokens)
        survival = self.scheduler.survival(p)
        if self.tree > 1 and p.first_top is not None and p.parents is None:
            tokens, counts, survival, parents, self._chain = tree.graft(p.tokens, p.counts, survival, p.first_top,
                                                                        p.first_probs, self.tree)
            return Drafted(tokens, counts, survival, parents=parents)
        return Drafted(p.tokens, p.counts, survival, parents=p.parents)

    def verify(self, state: RoundState, drafts: np.ndarray, lengths: np.ndarray, parents: np.ndarray | None
               ) -> Verified:
        """One target call over [anchor, drafts] of every active slot (runtime/calls/target.py), packed: only the
        slots' tokens are computed, in the smallest exported token budget P that holds them, so a short verify costs
        its own tokens, not the longest slot's. A tree's nodes (`parents`) sit at their depths' positions, each
        seeing only its ancestors (runtime/tree.py)."""
        t0 = time.perf_counter()
        n, active = len(lengths), state.active
        t = int(lengths.max()) + 1 if n else 1
        spec = self.target.spec
        if t > 1:
            bucket = spec.bucket("verify", B=n, T=t, P=int((lengths + 1)[active].sum()))
        else:  # no draft admitted: the decoding step's call
            bucket = spec.bucket("decode", B=n)
        b, T = bucket["B"], bucket["T"]
        anchor, start, grid = np.zeros(b, np.int64), np.zeros(b, np.int64), np.zeros((b, T - 1), np.int64)
        anchor[:n], start[:n] = state.anchor, np.where(active, state.length, 0)
        g = min(T - 1, drafts.shape[1])
        grid[:n, :g] = np.where(np.arange(g)[None, :] < lengths[:, None], drafts[:, :g], 0)
        if t > 1:
            rows = calls.target.packed_rows(lengths, active, bucket)
            first = np.concatenate([[0], np.cumsum(np.where(active, lengths + 1, 0))[:-1]])
        else:
            rows, first = calls.target.dense_rows(bucket), np.arange(n)
        feeds = self.target.inputs(0, bucket)
        calls.target.grid(feeds, anchor, start, grid, rows)
        if parents is not None:
            feeds[io.POSITION_IDS][:n] = tree.positions(start[:n], parents, T)
            tree.mask(parents, lengths, T, feeds[io.TREE_MASK])
            self._masked.add(id(feeds[io.TREE_MASK]))
        elif self._masked and io.TREE_MASK in feeds and id(feeds[io.TREE_MASK]) in self._masked:
            feeds[io.TREE_MASK][...] = 0  # a bucket a tree used: a chain again
            self._masked.discard(id(feeds[io.TREE_MASK]))
        out = self.target.run(0, bucket)
        self._call_s = time.perf_counter() - t0
        logits = out[io.LOGITS]
        # a decoding step's rows are its slots: the argmax of each, without the grid's scatter
        best = logits[:n].argmax(-1)[:, None] if t == 1 else steps.best(logits, rows, b, T)[:n]
        return Verified(best, grid[:n], logits, out.get(io.FEATURES), first)

    def sample(self, state: RoundState, drafted: Drafted | None, verified: Verified, lengths: np.ndarray,
               accepted: np.ndarray, tokens: np.ndarray, cells: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Each sampled slot on its own rows (`accept_sampled`, a tree's `accept_tree_sampled`; its uniforms drawn from
        its rng: gamma, then the bonus's); greedy ones keep the prefix match (a tree's walk)."""
        logits, first, p = verified.logits, verified.first, self._proposal
        for i, s in enumerate(self._slots):
            if s is None or s.params.greedy:
                continue
            ell, f = int(lengths[i]), int(first[i])
            if self._chain is not None and ell:  # grafted nodes: each chain node's distribution, alternatives none
                chain = self._chain[i, :ell]
                q = p.draft_probs(i, int(chain.max()) + 1, logits.shape[-1]) if (chain >= 0).any() else None
                probs = None if q is None else np.where((chain >= 0)[:, None], q[np.maximum(chain, 0)], 0.0)
            else:
                probs = p.draft_probs(i, ell, logits.shape[-1]) if ell else None
            if cells is None:
                v = accept_sampled(verified.drafts[i, :ell], probs, logits[f:f + ell + 1], s.params, s.rng,
                                   gamma=self.gamma)
                tokens[i, :-1] = verified.drafts[i]  # the drafts, the bonus at index accepted
            else:
                v, path = accept_tree_sampled(verified.drafts[i, :ell], drafted.parents[i, :ell], probs,
                                              logits[f:f + ell + 1], s.params, s.rng, gamma=self.gamma)
                cells[i] = 0
                cells[i, :len(path)] = path
                tokens[i, :v.accepted] = verified.drafts[i, np.asarray(path[1:], np.int64) - 1]
            accepted[i] = v.accepted
            tokens[i, v.accepted] = v.bonus
        return accepted, tokens, cells

    def commit(self, state: RoundState, verified: Verified, accepted: np.ndarray, tokens: np.ndarray,
               bonus: np.ndarray, cells: np.ndarray | None) -> None:
        """A tree's accepted path moves to the cache rows after the anchor; the engine commits each outcome to its
        sequence."""
        if cells is not None:
            moves = tree.moves(cells, accepted, state.length)
            if moves:
                self.target.move_rows(moves)
