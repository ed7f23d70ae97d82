"""The lossless draft/verify round, written once over array state; an executor runs it on its arrays.

    slot i: its cache holds positions 0..length[i]-1; anchor[i] (its last committed token) goes at length[i]
    draft     ex.draft(state) -> Drafted: up to K drafts per slot and their prefix survivals (None: nothing drafted,
              the round is a decoding step)
    schedule  the scheduler's `rule` on the survivals (runtime/schedulers.py), capped by the drafts proposed, gamma and
              each request's remaining budget (runtime/steps.py `cap`; 0: a plain decode step for that slot)
    verify    ex.verify(state, drafts, lengths) -> Verified: one target call over [anchor, d_1..d_l] at positions
              length..length+l of every slot; the target's argmax at every cell
    accept    greedy: the longest prefix of drafts equal to the argmax (steps.accept); sampled rows: rejection sampling
              with the request's uniforms (ex.sample: runtime/acceptance.py), the bonus at index accepted
    commit    ex.commit(state, verified, accepted, tokens, bonus): the verified rows become the head's next context
              rows, and where the executor keeps the slots' state, length += a + 1, budget -= a + 1, anchor = bonus
              (steps.advance; the host's slots are the engine's sequences, which it commits from each outcome);
              rejected drafts' K/V stay beyond the length and are overwritten later, so rollback is free

Two executors run it: the host's, eager on numpy with packed verify rows (ONNX Runtime, TensorRT:
runtime/host_round.py), and the torch backend's, captured with dense rows in one CUDA graph per round variant
(runtime/device_round.py). What a round run on the device cannot ask the host while it runs, the host decides before it
(`plan`): which slots are active, the drafter's lookups and its choice to call its head, survivals measured so far,
the cost curve the cost-aware rules read, and each sampled request's uniforms, drawn from its rng in the host round's
order (the head's draft noise, gamma acceptance uniforms, the bonus's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt.runtime import steps, tree
from specrt.runtime.acceptance import Verdict
from specrt.runtime.arrays import Array, device, namespace
from specrt.runtime.drafters import Drafter, Proposal
from specrt.runtime.schedulers import Costs, Scheduler, verify_curve


@dataclass
class RoundState:
    """The slots of a round as arrays of one namespace ([b] rows: a bucket's; idle rows inactive)."""

    active: Array  # [b] bool: the slot holds a request
    length: Array  # [b] i64: tokens in the slot's target cache
    anchor: Array  # [b] i64: its last committed token
    budget: Array  # [b] i64: tokens its request may still generate
    capacity: Array  # 0-d i64: the scheduler's state across rounds (sps-async's planned drafts; -1: none yet)
    draft_ms: Array | float = 0.0  # the cost-aware rules' inputs: the draft side's cost this round,
    curve: Array | None = None  # a verify call's cost over 0..P tokens (schedulers.verify_curve),
    explore: Array | None = None  # and the calls whose cost the table wants measured (host rounds only)


@dataclass
class Drafted:
    """A round's proposal as arrays: row i holds slot i's first counts[i] drafts."""

    tokens: Array  # [b, K] i64
    counts: Array  # [b] i64
    survival: Array  # [b, γ] prefix survival of each slot's drafts (what the scheduler's rule reads)
    lookup: Array | None = None  # [b] bool: rows that kept the host's lookups (a hybrid's pick)
    parents: Array | None = None  # [b, K] i64: a draft tree's (runtime/tree.py; host rounds only); None: chains


@dataclass
class Verified:
    """One verify call: the target's argmax best [b, T] at every cell, the drafts it verified [b, T - 1] (zero past
    each slot's length on the host), its logits and features [b, T, F] as the executor laid them out (packed on the
    host: `first[i]`, slot i's first row of logits; dense on the device)."""

    best: Array
    drafts: Array
    logits: Array
    features: Array | None
    first: Array | None = None


@dataclass
class Result:
    drafted: Drafted | None  # None: a decoding step
    lengths: Array  # [b] drafts verified
    accepted: Array  # [b]
    tokens: Array  # [b, T]: the accepted drafts, then the bonus at index accepted
    verified: Verified
    cells: Array | None = None  # [b, T]: a tree's accepted path, the grid cell of each (None: a chain's, 0..a)


class Executor(Protocol):
    """Where a round's calls run and how its arrays are laid out."""

    gamma: int  # drafts verified per round at most
    scheduler: Scheduler | None
    sampled: bool  # some slot samples this round

    def draft(self, state: RoundState) -> Drafted | None:
        """This round's drafts (None: no slot has any)."""

    def verify(self, state: RoundState, drafts: Array, lengths: Array, parents: Array | None) -> Verified:
        """The target over each active slot's anchor and its first lengths[i] drafts (a tree's nodes: `parents`)."""

    def sample(self, state: RoundState, drafted: Drafted | None, verified: Verified, lengths: Array, accepted: Array,
               tokens: Array, cells: Array | None) -> tuple[Array, Array, Array | None]:
        """The sampled rows' verdicts by rejection sampling; greedy rows keep `accepted`, `tokens` and `cells`."""

    def commit(self, state: RoundState, verified: Verified, accepted: Array, tokens: Array, bonus: Array,
               cells: Array | None) -> None:
        """Keep the verified rows' features as the head's next context rows (a tree's: its path's, which also
        become the cache rows after the anchor); advance the state it keeps."""


def run(ex: Executor, state: RoundState) -> Result:
    """One round over every row of `state`."""
    xp = namespace(state.length)
    drafted = ex.draft(state)
    parents = None
    if drafted is None:
        lengths = xp.zeros_like(state.length)
        drafts = xp.zeros((state.length.shape[0], 0), dtype=xp.int64, device=device(state.length))
    else:
        a = steps.survive(drafted.survival, drafted.counts)
        planned = ex.scheduler.rule(a, drafted.counts, state.active, state.draft_ms, state.curve, state.capacity,
                                    state.explore)
        lengths = steps.cap(planned, drafted.counts, state.budget, state.active, ex.gamma)
        drafts = drafted.tokens
        if drafted.parents is not None and not tree.is_chain(drafted.parents, lengths):
            parents = drafted.parents  # the admitted nodes branch somewhere: a tree's verify and walk
    verified = ex.verify(state, drafts, lengths, parents)
    if parents is None:
        accepted, tokens = steps.accept(verified.drafts, verified.best, lengths)
        cells = None
    else:
        accepted, tokens, cells = tree.accept(verified.drafts, verified.best, parents, lengths)
    if ex.sampled:
        accepted, tokens, cells = ex.sample(state, drafted, verified, lengths, accepted, tokens, cells)
    bonus = tokens[:, 0] if tokens.shape[1] == 1 else xp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
    ex.commit(state, verified, accepted, tokens, bonus, cells)
    return Result(drafted, lengths, accepted, tokens, verified, cells)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One slot's round: what was verified and accepted, and the tokens to commit."""

    verify_len: int
    verdict: Verdict
    tokens: list[int]  # the accepted drafts, then the bonus token
    features: np.ndarray | None  # [a + 1, F] target features of the anchor and accepted rows (a view; None: the
    # executor keeps them where the head reads them)


@dataclass
class Round:
    """Everything one round produced, for the engine to commit and observers to record."""

    proposal: Proposal
    outcomes: list[Outcome | None]  # per slot in [0, n); None for idle slots
    draft_s: float
    verify_s: float  # scheduling, the verify call and acceptance
    verified: int = 0  # tokens verified in all (anchors and drafts of the active slots)
    call_s: float = 0.0  # the verify call alone (filling and running it): what the cost table learns from


def outcomes(slots: list, lengths: np.ndarray, accepted: np.ndarray, tokens: np.ndarray,
             features: np.ndarray | None, drafter: Drafter | None, scheduler: Scheduler | None, *, drafted: bool,
             cells: np.ndarray | None = None) -> list[Outcome | None]:
    """Each slot's outcome from a round's host arrays (a tree's features: its path's `cells`); the scheduler and
    drafter told how a round with drafts fared (a round without drafts verified nothing: no acceptance history counts
    it)."""
    out: list[Outcome | None] = []
    for i, s in enumerate(slots):
        if s is None:
            out.append(None)
            continue
        ell, a = int(lengths[i]), int(accepted[i])
        row = tokens[i, :a + 1].tolist()
        if drafted:
            scheduler.observe(ell, a)
            drafter.observe(i, ell, a) if cells is None else drafter.observe(i, ell, a, cells[i])
        if features is None:
            rows = None
        else:
            rows = features[i, :a + 1] if cells is None else features[i, cells[i, :a + 1]]
        out.append(Outcome(ell, Verdict(a, row[-1]), row, rows))
    return out


def cost_inputs(costs: Costs, n: int, tokens: int, head: str) -> tuple[float, np.ndarray]:
    """The cost-aware rules' inputs for a round of n slots: the draft call's cost (`head`'s; "": no graph call) and the
    verify curve over 0..tokens tokens."""
    return costs.draft_ms(head, n) if head else 0.0, verify_curve(costs, n, tokens)


@dataclass
class Plan:
    """What the host decides before a round that runs elsewhere, in host arrays of the round's rows (filled in place
    from buffers that live as long as the executor)."""

    head: bool  # the head drafts (else the lookups are the proposal)
    drafting: bool  # some slot has drafts (else the round is a decoding step)
    sampled: bool  # some slot samples
    filters: tuple[bool, bool]  # some sampled slot uses top-k, top-p


def plan(slots: list, drafter: Drafter | None, scheduler: Scheduler | None, costs: Costs | None, gamma: int,
         into: dict[str, np.ndarray], *, head_name: str, confident: bool, proposed: int) -> Plan:
    """Fill `into` (active [b], drafts [b, K] and counts [b] of the lookups, survival [b, γ] of the lookups,
    head_survival [b, γ] for a head without a confidence head, curve and draft_ms for the cost-aware rules, noise
    [b, K], u [b, γ] and v [b] for sampled slots) for a round over slots [0, n) (None: idle)."""
    n = len(slots)
    into["active"][:] = False
    into["active"][:n] = [s is not None for s in slots]
    head = looked = False
    if drafter is not None:
        p = drafter.plan(slots, scheduler)  # the drafter's own host knowledge: lookups, its choice, survivals
        head = p.head and bool(head_name)
        if p.survival is not None:
            into["survival"][:n, :gamma] = p.survival[:, :gamma]
        if p.lookups is not None:
            into["drafts"][:], into["counts"][:] = 0, 0
            into["drafts"][:n, :p.lookups.tokens.shape[1]], into["counts"][:n] = p.lookups.tokens, p.lookups.counts
            looked = bool(p.lookups.counts.any())
        if head and not confident and p.head_survival is not None:
            into["head_survival"][:] = p.head_survival[:gamma]
    if gamma and scheduler.traits.plans_on_costs:
        into["draft_ms"][...], into["curve"][:] = cost_inputs(costs, n, len(into["curve"]) - 1,
                                                             head_name if head else "")
    filters = [False, False]
    for i, s in enumerate(slots):
        if s is None or s.params.greedy:
            continue
        if head:  # the host round's order: the head's draft noise, gamma acceptance uniforms, the bonus's
            into["noise"][i] = s.rng.random(proposed, dtype=np.float32)
        into["u"][i, :gamma] = s.rng.random(gamma)
        into["v"][i] = s.rng.random()
        filters[0] |= s.params.top_k > 0
        filters[1] |= s.params.top_p < 1.0
    sampled = any(s is not None and not s.params.greedy for s in slots)
    return Plan(head, bool(gamma) and (head or looked), sampled, (filters[0], filters[1]))
