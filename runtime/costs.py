"""The cost table the schedulers plan on: a stored profile, refined online from the rounds the engine times.

A profile (`specrt profile`, stored by `specrt export`) is measured once, at one moment of a machine whose
speed drifts; a quick one measured at start-up can be far off. `CostTable` starts from it and corrects it
with what each round actually cost:

    observed cell   (batch, verified tokens) or (head, batch) seen in a round: the lower median of its last
                    WINDOW observations and PRIOR copies of the profile's value. Two observations outvote a
                    profile that overstates a cost, three one that understates it, and one stall moves nothing.
                    Erring low is deliberate: a cost believed too low gets admitted and so measured, while one
                    believed too high would never be
    forgetting      an observation older than FORGET observations of the whole table is dropped, and a cell
                    left with none reads as unseen again. These hosts' speed swings by 30% within minutes: a cell
                    measured while the host was slow, beside a decoding step measured since it got fast, would
                    otherwise keep a verify looking dear for good: a 2-token verify believed ~1.7 steps is
                    admitted for no lookup, and a call never made is never measured again (one load run's hybrid
                    verified no draft at one request, which this allows)
    unseen cell     the profile's value scaled as the nearest observed cell below it in the same row was scaled
                    (the profile's shape, anchored where the rounds measured), or by the table's overall drift
                    (the running geometric mean of observed / profiled) where nothing in the row was observed
    monotone        a verify of more tokens costs at least what one of fewer does: each cell at least the one
                    before it in its row. A profile measured in a noisy moment can say a 2-token verify is cheaper
                    than a decoding step (one stored profile: 3.84 against 4.01 ms), and a head whose drafts are
                    rarely accepted then looks as if it paid
    exploration     a cost-aware scheduler stops admitting drafts where the table says the next one does not
                    pay, so a table that overstates a verify would never be corrected by the rounds it
                    prevents: `exploring` lets the scheduler admit one pair past its stopping point, once every
                    EXPLORE_EVERY rounds, until that cell has been seen SEEN times. The same holds below the
                    stopping point: a table that overstates the decoding step (a profile made on a slower host)
                    makes every round draft, and a round that drafts never measures a step; so an exploration
                    verifies one pair fewer where that call's cell is wanted (first), else one pair more. Verify
                    lengths never affect which tokens are committed, so exploring costs time, never exactness.

`describe()` says which table decided: its source, the observations, and the table before and after, in
decoding steps.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from specrt.runtime.profile import Profile, ceil_key

PRIOR = 2  # the profile's value counts as this many observations
WINDOW = 16  # observations kept per cell
SEEN = 6  # observations after which a cell is no longer explored
FORGET = 1024  # the table's observations after which one is dropped (checked every FORGET // 4)
EXPLORE_EVERY = 8  # rounds between explorations
LOG4 = math.log(4)


class CostTable:
    """A profile's verify and draft costs (ms), corrected online; read by the schedulers and the hybrid."""

    def __init__(self, profile: Profile, source: str) -> None:
        self.profile, self.source = profile, source
        self.seen: dict[tuple, deque[tuple[int, float]]] = {}  # cell -> its last observations (number, ms)
        self.estimate: dict[tuple, float] = {}  # cell -> median of its observations and the prior
        self.log_drift, self.observations, self.explored_rounds = 0.0, 0, 0
        self._since_explore = 0
        self._cells_of: dict[tuple[int, int], tuple[int, int]] = {}  # (batch, tokens) -> its cell (`_cell`)
        self._draft_cells: dict[tuple[str, int], int] = {}  # (head, batch) -> its profiled batch (`draft_ms`)
        self._order = {b: sorted(row) for b, row in profile.verify.items()}  # each verify row's cells, ascending
        self._drift = 1.0  # exp(log_drift)
        self._rows: dict[int, dict[int, float]] = {}  # a batch's verify cells (`_row`), until the next observation
        self._curves: dict[tuple[int, int], np.ndarray] = {}
        self._cells: dict[tuple[int, int], tuple[list[int], np.ndarray]] = {}  # a curve's cells, each count's cell
        self._wants: dict[tuple[int, int], np.ndarray] = {}

    # -- what the schedulers read (runtime/schedulers.py Costs) ---------------------------------------

    def verify_ms(self, batch: int, tokens: int) -> float:
        b, p = self._cell(batch, tokens)
        return self._row(b)[p]

    def _cell(self, batch: int, tokens: int) -> tuple[int, int]:
        """The profiled (batch, tokens) cell a call of `batch` slots over `tokens` tokens takes (read every round)."""
        key = (batch, tokens)
        if key not in self._cells_of:
            b = ceil_key(self.profile.verify, batch)
            self._cells_of[key] = (b, ceil_key(self.profile.verify[b], tokens))
        return self._cells_of[key]

    def _row(self, b: int) -> dict[int, float]:
        """Profiled batch b's cells -> ms, kept until the next observation: each cell its estimate if observed, else
        the profile's value scaled like the nearest observed cell below it, else by the drift; then at least the
        cell before it (a call of more tokens never costs less: a profile measured in a noisy moment, or cells
        observed at different moments, can say otherwise, and a verify believed cheaper than a decoding step
        would be admitted where it cannot pay)."""
        out = self._rows.get(b)
        if out is None:
            row, estimate, out, floor = self.profile.verify[b], self.estimate, {}, 0.0
            below = None  # the nearest observed cell's (estimate, profiled value)
            for p in self._order[b]:
                ms = estimate.get(("verify", b, p))
                if ms is not None:
                    below = (ms, row[p])
                elif below is not None:
                    ms = row[p] * below[0] / below[1]
                else:
                    ms = row[p] * self._drift
                out[p] = floor = max(floor, ms)
            self._rows[b] = out
        return out

    def draft_ms(self, head: str, batch: int) -> float:
        b = self._draft_cell(head, batch)
        if b is None:
            return 0.0  # n-gram lookups: no graph call
        ms = self.estimate.get(("draft", head, b))
        return ms if ms is not None else self.profile.draft[head][b] * self._drift

    def _draft_cell(self, head: str, batch: int) -> int | None:
        """The profiled batch a draft call of `batch` slots takes (None: `head` has no graph call)."""
        key = (head, batch)
        if key not in self._draft_cells:
            row = self.profile.draft.get(head)
            self._draft_cells[key] = ceil_key(row, batch) if row else None
        return self._draft_cells[key]

    def step_ms(self, batch: int) -> float:
        b = ceil_key(self.profile.verify, batch)
        return self.verify_ms(b, min(self.profile.verify[b]))

    def verify_curve(self, batch: int, tokens: int) -> np.ndarray:
        """[tokens + 1] float64: verify_ms(batch, p) for p = 0..tokens, kept until the next observation."""
        key = (batch, tokens)
        if key not in self._curves:  # each profiled cell once; each token count takes its cell's (ceil_key)
            b = ceil_key(self.profile.verify, batch)
            if key not in self._cells:
                cells = sorted(self.profile.verify[b])
                self._cells[key] = (cells, np.minimum(np.searchsorted(cells, np.arange(tokens + 1)), len(cells) - 1))
            cells, at = self._cells[key]
            row = self._row(b)
            self._curves[key] = np.array([row[p] for p in cells], np.float64)[at]
        return self._curves[key]

    def exploring(self, batch: int, tokens: int) -> np.ndarray | None:
        """[tokens + 1] bool: the calls of p tokens in all whose cost this round may verify to learn it (see above);
        None between explorations."""
        if self._since_explore < EXPLORE_EVERY:
            return None
        key = (batch, tokens)
        if key not in self._wants:  # kept until a cell's count changes
            b = ceil_key(self.profile.verify, batch)
            row = self.profile.verify[b]
            self._wants[key] = np.array([p <= max(row) and len(self.seen.get(("verify", b, ceil_key(row, p)), ()))
                                         < SEEN for p in range(tokens + 1)])
        return self._wants[key]

    def explored(self) -> None:
        """A scheduler admitted a pair to explore: the next exploration waits EXPLORE_EVERY rounds."""
        self._since_explore = 0
        self.explored_rounds += 1

    # -- what the engine feeds it ----------------------------------------------------------------------

    def observe_verify(self, batch: int, tokens: int, ms: float) -> None:
        """A verify (or decode) call of `batch` slots over `tokens` tokens in all took `ms`."""
        b, p = self._cell(batch, tokens)
        self._observe(("verify", b, p), ms)
        self._since_explore += 1

    def observe_draft(self, head: str, batch: int, ms: float) -> None:
        """A call of `head`'s draft graph for `batch` slots took `ms`."""
        b = self._draft_cell(head, batch)
        if b is not None:
            self._observe(("draft", head, b), ms)

    def _observe(self, cell: tuple, ms: float) -> None:
        if not (ms > 0 and math.isfinite(ms)):
            return
        profiled = self._profiled(cell)
        self._rows.clear()
        self._curves.clear()
        seen = self.seen.get(cell)
        if seen is None:
            seen = self.seen[cell] = deque(maxlen=WINDOW)
        self.observations += 1
        seen.append((self.observations, ms))
        if len(seen) <= SEEN:  # a count exploring reads changed
            self._wants.clear()
        self.estimate[cell] = _lower_median(profiled, seen)
        if profiled > 0:  # clipped: one stall moves the drift by at most log(4) / its weight
            ratio = max(-LOG4, min(LOG4, math.log(ms / profiled)))
            self.log_drift += (ratio - self.log_drift) / min(self.observations, 4 * WINDOW)
            self._drift = math.exp(self.log_drift)
        if self.observations % (FORGET // 4) == 0:
            self._forget()

    def _forget(self) -> None:
        """Drop the observations older than FORGET; a cell left with none reads as unseen (and is explored) again."""
        old = self.observations - FORGET
        for cell in [c for c, seen in self.seen.items() if seen[0][0] <= old]:
            seen = self.seen[cell]
            while seen and seen[0][0] <= old:
                seen.popleft()
            if seen:
                self.estimate[cell] = _lower_median(self._profiled(cell), seen)
            else:
                del self.seen[cell], self.estimate[cell]
        self._rows.clear()
        self._curves.clear()
        self._wants.clear()

    def _profiled(self, cell: tuple) -> float:
        kind, a, b = cell
        return self.profile.verify[a][b] if kind == "verify" else self.profile.draft[a][b]

    # -- reporting --------------------------------------------------------------------------------------

    def current(self) -> Profile:
        """The table as it stands, as a Profile (unseen cells with the drift applied)."""
        verify = {b: {p: round(self.verify_ms(b, p), 3) for p in row} for b, row in self.profile.verify.items()}
        draft = {h: {b: round(self.draft_ms(h, b), 3) for b in row} for h, row in self.profile.draft.items()}
        p = self.profile
        return Profile(backend=p.backend, threads=p.threads, position=p.position, machine=p.machine,
                       created=p.created, verify=verify, draft=draft)

    def describe(self) -> dict:
        """Which table decided: its source, how many rounds refined it, and the table before and after."""
        return {"source": self.source, "created": self.profile.created, "threads": self.profile.threads,
                "observations": self.observations, "explored_rounds": self.explored_rounds,
                "drift": round(math.exp(self.log_drift), 4), "initial": self.profile.summary(),
                "refined": self.current().summary()}


def _lower_median(profiled: float, seen: deque[tuple[int, float]]) -> float:
    """The lower median of a cell's observations and PRIOR copies of the profile's value (see above)."""
    values = sorted([profiled] * PRIOR + [ms for _, ms in seen])
    return values[(len(values) - 1) // 2]
