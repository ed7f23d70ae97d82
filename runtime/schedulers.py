"""Schedulers: plug-ins that choose how many drafts each slot verifies this round.

A scheduler is its `rule`, written once on the array API: from the prefix survivals of a round's drafts (and, for
the cost-aware ones, what the draft and verify calls cost) it returns verify lengths, in the host's round on numpy and
inside the device round's graph on torch (runtime/round.py). The round then caps every length by the drafts proposed
and by the request's remaining token budget, so a scheduler only expresses its policy.

    fixed      verify every draft (up to gamma)
    threshold  cut each slot where the calibrated prefix survival a_k = Π_{i<=k} sigmoid(c_i / T_i) falls
               below a threshold (specrt::ConfidenceTruncate, threshold mode)
    sps        the DSpark paper's Algorithm 1: admit (slot, k) pairs in order of survival while the expected
               committed tokens per second of the round, on the profiled cost curve (`specrt profile`),
               improve; stop at the first pair that does not improve it
    sps-async  §5.2: the round's capacity (total drafts) is planned from the previous round's survivals, and
               this round's survivals only pick which pairs fill it (ConfidenceTruncate, budget mode)

Heads without a confidence head (MTP, n-gram lookups) use the per-position acceptance measured so far in
the run as their survival. No scheduler looks at whether this round's drafts will be accepted, only at draft-
side confidences and past rounds, which keeps the loop exact (paper, Appendix A).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt.errors import SpecrtError
from specrt.plugins.confidence_truncate import survival
from specrt.runtime import steps
from specrt.runtime.arrays import Array, namespace
from specrt.runtime.config import SCHEDULER_TRAITS, SchedulerTraits
from specrt.runtime.drafters import Proposal


@dataclass(frozen=True, slots=True)
class Load:
    """How busy the engine is this round."""

    active: int  # slots with a request
    slots: int  # slots the engine serves
    waiting: int  # requests queued for a slot


class Scheduler(Protocol):
    name: str
    traits: SchedulerTraits  # what its rule reads (survivals, costs) and whether it gates a head

    def rule(self, a: Array, counts: Array, active: Array, draft_ms: Array | float, curve: Array | None,
             capacity: Array, explore: Array | None = None) -> Array:
        """Verify lengths [n] (0: a plain decode step for that slot) from survivals a [n, γ] (zero past counts) of
        the `active` rows, the draft side's cost and the verify cost curve (`verify_curve`; the cost-aware rules),
        `capacity`, a 0-d state array that lives with the round (sps-async's planned drafts, -1: none yet), and
        `explore`, the calls whose cost the table wants measured (host rounds; runtime/costs.py)."""

    def survival(self, proposal: Proposal) -> np.ndarray:
        """[n, γ] prefix survival of a host proposal's drafts (`prefix_survival`: the graph's, its calibrated
        confidences, or the acceptance measured so far), 0 past the drafts each slot has."""

    def observe(self, verified: int, accepted: int) -> None:
        """One slot's round outcome, after the round (the acceptance history schedulers may learn from)."""


class Costs(Protocol):
    """What the cost-aware schedulers read from a profile (runtime/profile.py)."""

    def verify_ms(self, batch: int, tokens: int) -> float: ...

    def draft_ms(self, head: str, batch: int) -> float: ...


class AcceptanceHistory:
    """Per draft position, the conditional acceptance measured so far: a prior worth two tries, 0.5 at the first
    position and `later` at the others (untried positions start there)."""

    def __init__(self, gamma: int, *, later: float = 0.5) -> None:
        self.hits = np.full(gamma, 2.0 * later)
        self.hits[0] = 1.0
        self.tries = np.full(gamma, 2.0)
        self._survival: np.ndarray | None = None  # kept until the next round that verified something

    def observe(self, verified: int, accepted: int) -> None:
        if verified <= 0:
            return  # nothing tried
        reached = np.arange(min(verified, accepted + 1))  # positions tried with all earlier ones accepted
        self.tries[reached] += 1
        self.hits[reached[reached < accepted]] += 1
        self._survival = None

    def survival(self) -> np.ndarray:
        """[gamma] (read-only): P(the first k+1 drafts are all accepted)."""
        if self._survival is None:
            self._survival = np.cumprod(self.hits / self.tries)
            self._survival.flags.writeable = False
        return self._survival


def prefix_survival(proposal: Proposal, temperatures: np.ndarray, history: AcceptanceHistory, gamma: int
                    ) -> np.ndarray:
    """[n, gamma] prefix survival of a proposal's drafts: the draft graph's own (specrt::ConfidenceTruncate), else
    its confidence logits calibrated by `temperatures`, else the run's per-position acceptance `history`."""
    conf = proposal.confidence_logits
    if proposal.survival is not None:
        return proposal.survival[:, :gamma]
    if conf is not None and len(temperatures) >= gamma:
        return survival(conf[:, :gamma], temperatures[:gamma])
    return np.broadcast_to(history.survival()[:gamma], (len(proposal.counts), gamma)).astype(np.float32)


class _Base:
    name = "base"

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        cls.traits = SCHEDULER_TRAITS.get(cls.name)

    def __init__(self, gamma: int, *, temperatures=(), **_) -> None:
        self.gamma = gamma
        self.temperatures = np.asarray(temperatures if len(temperatures) else [], np.float32)
        self.history = AcceptanceHistory(gamma)

    def observe(self, verified: int, accepted: int) -> None:
        self.history.observe(verified, accepted)

    def survival(self, proposal: Proposal) -> np.ndarray:
        """[n, gamma] prefix survival of every slot's drafts; 0 past the drafts a slot has."""
        return steps.survive(prefix_survival(proposal, self.temperatures, self.history, self.gamma), proposal.counts)


class FixedScheduler(_Base):
    """Verify every proposed draft, up to gamma."""

    name = "fixed"

    def rule(self, a: Array, counts: Array, active: Array, draft_ms, curve, capacity, explore=None) -> Array:
        return counts


class ThresholdScheduler(_Base):
    """Cut each slot's drafts where the calibrated prefix survival falls below `threshold`."""

    name = "threshold"

    def __init__(self, gamma: int, *, threshold: float = 0.3, **kw) -> None:
        super().__init__(gamma, **kw)
        if not 0.0 <= threshold <= 1.0:
            raise SpecrtError(f"--threshold must be a probability in [0, 1], got {threshold}")
        self.threshold = threshold

    def rule(self, a: Array, counts: Array, active: Array, draft_ms, curve, capacity, explore=None) -> Array:
        return steps.threshold(a, float(np.float32(self.threshold)))


def verify_curve(costs: Costs, batch: int, tokens: int) -> np.ndarray:
    """[tokens + 1] float64: the cost of a verify call of `batch` slots over 0..tokens tokens (what steps.admission
    reads; a CostTable keeps it until its next observation)."""
    curve = getattr(costs, "verify_curve", None)
    if curve is not None:
        return curve(batch, tokens)
    return np.array([costs.verify_ms(batch, p) for p in range(tokens + 1)], np.float64)


def admission(a: np.ndarray, active: np.ndarray, fixed_ms: float, costs: Costs, *, explore: bool = False
              ) -> tuple[np.ndarray, float]:
    """Algorithm 1 (runtime/steps.py `admission`) on survivals a [n, gamma] of the `active` rows, for a round whose
    draft side cost `fixed_ms`, on the cost table `costs`: the admitted lengths [n] and the round's expected
    committed tokens per millisecond. `explore`: admit one pair past the stopping point when the table wants that
    call's cost measured (runtime/costs.py)."""
    n, gamma = a.shape
    tokens = n * (gamma + 1)
    wants = getattr(costs, "exploring", None) if explore else None
    return admit_on(a, active, fixed_ms, verify_curve(costs, n, tokens), wants(n, tokens) if wants else None, costs)


def admit_on(a: np.ndarray, active: np.ndarray, fixed_ms: float, curve: np.ndarray, cells: np.ndarray | None,
             costs: Costs) -> tuple[np.ndarray, float]:
    """`admission` on a verify curve and the cells to explore (None: none), on numpy: the table is told when a pair
    was admitted to explore."""
    one = _admit_one(a, active, fixed_ms, curve, cells)
    if one is not None:
        lengths, rate, explored = one
    else:
        nothing = _admits_nothing(a, active, fixed_ms, curve, cells)
        if nothing is not None:
            return np.zeros(len(a), np.int64), nothing
        lengths, rate, explored = steps.admission(a, active, fixed_ms, curve, cells)
    if explored:
        costs.explored()
    return lengths, float(rate)


def _admit_one(a: np.ndarray, active: np.ndarray, fixed_ms: float, curve: np.ndarray, cells: np.ndarray | None
               ) -> tuple[np.ndarray, float, bool] | None:
    """steps.admission for a round with one active slot whose survivals do not increase along its row (a prefix's
    survival, a tree's nodes in order of survival): its pairs are admitted in row order, so Algorithm 1 is a walk
    along the row in Python floats (the same float64 sums, divisions and comparisons in the same order: the same
    lengths, rate and exploration) instead of the batch's sort, ~15x cheaper; None for any other round. Every round
    at one request in flight is one."""
    which = np.flatnonzero(active)
    if len(which) != 1:
        return None
    i = int(which[0])
    row = a[i]
    if len(row) > 1 and (row[1:] > row[:-1]).any():
        return None
    v = row.astype(np.float64).tolist()
    c = curve.tolist()
    last, g = len(c) - 1, len(v)
    expected, rate, m = 1.0, 1.0 / (fixed_ms + c[min(1, last)]), 0
    while m < g and v[m] > 0:
        e = expected + v[m]
        r = e / (fixed_ms + c[min(2 + m, last)])
        if not r > rate:
            break
        expected, rate, m = e, r, m + 1
    fewer = more = False
    if cells is not None:
        top = len(cells) - 1
        nxt = min(m, g - 1)
        fewer = m > 0 and bool(cells[min(1 + max(m - 1, 0), top)])
        more = not fewer and m < g and v[nxt] > 0 and bool(cells[min(2 + nxt, top)])
    lengths = np.zeros(len(a), np.int64)
    lengths[i] = m + more - fewer
    return lengths, rate, fewer or more


def _admits_nothing(a: np.ndarray, active: np.ndarray, fixed_ms: float, curve: np.ndarray,
                    cells: np.ndarray | None) -> float | None:
    """The rate of a round Algorithm 1 admits nothing to (its best pair does not improve a plain step's rate, and
    is not one to explore), else None. Most rounds under load, found with a few scalar operations instead of
    steps.admission's sort; the same float64 arithmetic, so the same decision."""
    flat = np.where(active[None, :], a.T, np.float32(0.0)).reshape(-1)  # k-major, as steps.admission orders pairs
    j = int(np.argmax(flat))  # the first pair admitted: the highest survival, ties to the lowest k-major index
    v = np.float64(flat[j])
    base = np.float64(np.count_nonzero(active))
    rate0, pays = first_pair(v, base, fixed_ms, curve)
    if v > 0 and (pays or (cells is not None and cells[min(int(base) + 1, len(cells) - 1)])):
        return None
    return float(rate0)


def first_pair(v: np.float64, base: np.float64, fixed_ms: float, curve: np.ndarray) -> tuple[np.float64, bool]:
    """Algorithm 1's first test for a round of `base` active slots: the rate of a plain step, and whether a first pair
    of survival v improves it (float64, as steps.admission computes it)."""
    start, last = int(base), len(curve) - 1
    rate0 = base / (fixed_ms + curve[min(start, last)])
    return rate0, bool((base + v) / (fixed_ms + curve[min(start + 1, last)]) > rate0)


class SPSScheduler(_Base):
    """Algorithm 1: greedy admission by survival while expected committed tokens per second improve."""

    name = "sps"

    def __init__(self, gamma: int, *, costs: Costs | None = None, **kw) -> None:
        super().__init__(gamma, **kw)
        if costs is None:
            raise SpecrtError(f"--scheduler {self.name} needs a cost profile (run `specrt profile ART`)")
        self.costs = costs

    def rule(self, a: Array, counts: Array, active: Array, draft_ms, curve, capacity, explore=None) -> Array:
        if isinstance(a, np.ndarray):  # eager: a round that admits nothing is found without a sort; explorations
            return admit_on(a, active, float(draft_ms), curve, explore, self.costs)[0]
        return steps.admission(a, active, draft_ms, curve)[0]


class AsyncSPSScheduler(SPSScheduler):
    """§5.2: this round admits as many drafts as Algorithm 1 chose on the previous round's survivals; the
    current survivals only choose which (ConfidenceTruncate's budget mode). The first round plans for itself; a round
    with no drafts at all never reaches the scheduler (runtime/round.py), so the plan waits for the next that has
    some."""

    name = "sps-async"

    def rule(self, a: Array, counts: Array, active: Array, draft_ms, curve, capacity, explore=None) -> Array:
        xp = namespace(a)
        planned = xp.sum(super().rule(a, counts, active, draft_ms, curve, capacity, explore))
        budget = xp.where(capacity >= 0, capacity, planned)
        capacity[...] = planned  # the next round's capacity
        return steps.admit(xp.where(active[:, None], a, xp.zeros_like(a)), budget)  # idle rows: never admitted


# the implementation of each name in runtime/config.py's SCHEDULERS (a test ties the two)
SCHEDULER_CLASSES = {s.name: s for s in (FixedScheduler, ThresholdScheduler, SPSScheduler, AsyncSPSScheduler)}


def scheduler_class(name: str) -> type:
    """The implementation of a scheduler name (its `traits`, its rules)."""
    if name not in SCHEDULER_CLASSES:
        raise SpecrtError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULER_CLASSES)}")
    return SCHEDULER_CLASSES[name]


def make_scheduler(name: str, *, gamma: int, **kw) -> Scheduler:
    """A scheduler by name; kw: temperatures (the head's STS temperatures), threshold, costs."""
    return scheduler_class(name)(gamma, **kw)
