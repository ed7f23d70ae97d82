"""The torch backend's executor of the round (runtime/round.py): the round's state lives on the target runner's
device and each round is one host synchronisation, for every method, scheduler and sampling setting.

    plan      (host) runtime/round.py `plan`, in one small copy down: active slots, the drafter's lookups and its
              choice to call the head, survivals measured so far, the cost curve, each sampled slot's uniforms
    draft     the head's modules on the context rows the previous rounds left on the device; a drafter that picks
              keeps, per slot, the host's lookups or the head's block, whichever survives better (hybrid.py `pick`)
    verify    the target over the whole dense grid [anchor, d_1..d_γ] of every slot (the torch modules compute it
              anyway, and on a GPU a short verify costs about what a long one does); a round without drafts runs the
              decoding step's bucket
    sample    every slot's rejection sampling at once (acceptance.py `accept_rows`) beside the greedy match
    commit    the verified rows' features become the head's next context rows (a round that skipped the head
              appends them to the slot's backlog), and the slots' lengths, budgets and anchors advance, all on the
              device
    copy back accepted counts, tokens, lengths, drafts and confidences into host memory (pinned on CUDA), then the
              round's one synchronisation

On CUDA each round variant (slot bucket, sampling and its filters, head called or not, drafts or none) is one CUDA
graph, captured after a warm-up whose state changes are undone. The cost table is read as it stands: the rounds are
single graphs whose calls are not timed apart, so the device path neither refines it online nor explores its cells
(runtime/costs.py; a gated head's explorations, which are the hybrid's, happen on both paths). A backlog longer than
one propose call takes is written through the head's prefill bucket before the round, outside its graph (the host
knows every backlog's length), by the head's own `GraphDrafter.write_rows`.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from specrt import artifact as io
from specrt.runtime import calls, round as rounds, steps
from specrt.runtime.acceptance import accept_rows
from specrt.runtime.backends.base import DeviceRunner
from specrt.runtime.backends.graphs import GraphedCall, GraphStats
from specrt.runtime.drafters import Context, Drafter, Proposal
from specrt.runtime.hybrid import pick
from specrt.runtime.round import Drafted, Round, RoundState, Verified
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.schedulers import Costs, Load, Scheduler


class DeviceRounds:
    """Decode steps (AR) or draft/verify rounds whose state lives on the target runner's device."""

    def __init__(self, target: DeviceRunner, drafter: Drafter | None, scheduler: Scheduler | None = None, *,
                 gamma: int, costs: Costs | None = None, capture: bool | None = None) -> None:
        """`costs`: what the cost-aware rules plan on; `capture`: each round variant in one CUDA graph (default: on
        CUDA)."""
        self.target, self.drafter, self.scheduler, self.costs = target, drafter, scheduler, costs
        self.graph_drafter = drafter.graph if drafter is not None else None  # the head that drafts here, if any
        self.head = self.graph_drafter.runner if self.graph_drafter is not None else None
        self.gamma = gamma if drafter is not None else 0
        self.device = target.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.proposed = drafter.steps if drafter is not None else 0  # drafts a proposal holds (a head's block)
        self.confident = self.head is not None and io.SURVIVAL in {o.name for o in self.head.spec.host_outputs()}
        # context rows a slot may hold: one round's, or a backlog's (rounds without the head)
        self.rows = (drafter.backlog_rounds if drafter is not None else 1) * (self.gamma + 1)
        self.graph_stats = GraphStats()
        self.target_vocab = next(o for o in target.spec.outputs if o.name == io.LOGITS).shape[-1]
        self.syncs = 0  # host synchronisations: one per round
        self.caught_up = 0  # backlogs written through the head's prefill bucket
        self.slots = 0
        self.pending = np.zeros(0, np.int64)  # each slot's context rows on the device, as the host counts them
        self.capacity = torch.full((), -1, dtype=torch.int64, device=self.device)  # RoundState.capacity
        self._rounds: dict[tuple, GraphedCall] = {}

    def allocate(self, slots: int) -> None:
        """Per-slot state and result buffers for `slots` slots (the runners' caches are allocated apart)."""
        if slots == self.slots:
            return
        self.slots, dev, t, g = slots, self.device, self.gamma + 1, max(self.gamma, 1)
        i64, f32, f64 = (dict(dtype=d, device=dev) for d in (torch.int64, torch.float32, torch.float64))
        self.length, self.anchor, self.budget = (torch.zeros(slots, **i64) for _ in range(3))
        self.ctx_pos, self.ctx_rows = torch.zeros(slots, **i64), torch.ones(slots, **i64)
        width = self.graph_drafter.width if self.graph_drafter is not None else 1
        # the head's pending context rows, and one row more that masked writes go to
        self.ctx_features = torch.zeros(slots, self.rows + 1, width, **f32)
        self.ctx_next = torch.zeros(slots, self.rows + 1, **i64)  # MTP: the token after each context row
        self.pending = np.zeros(slots, np.int64)
        # each request's sampling parameters, set when it is admitted
        self.temperature, self.top_k, self.top_p = (torch.zeros(slots, **f32), torch.zeros(slots, **i64),
                                                    torch.ones(slots, **f64))
        pinned = dev.type == "cuda"
        k = max(self.proposed, 1)
        # what runtime/round.py's `plan` fills and the host copies down each round (from pinned memory on CUDA)
        self._in = {"active": torch.zeros(slots, dtype=torch.bool, device=dev), "drafts": torch.zeros(slots, k, **i64),
                    "counts": torch.zeros(slots, **i64), "survival": torch.zeros(slots, g, **f32),
                    "head_survival": torch.zeros(slots, g, **f32), "curve": torch.zeros(slots * t + 1, **f64),
                    "draft_ms": torch.zeros((), **f64), "noise": torch.zeros(slots, k, **f32),
                    "u": torch.zeros(slots, g, **f64), "v": torch.zeros(slots, **f64)}
        self._in_host = {key: torch.zeros(x.shape, dtype=x.dtype, pin_memory=pinned) for key, x in self._in.items()}
        self._out = {"accepted": torch.zeros(slots, **i64), "tokens": torch.zeros(slots, t, **i64),
                     "lengths": torch.zeros(slots, **i64), "drafts": torch.zeros(slots, k, **i64),
                     "counts": torch.zeros(slots, **i64), "lookup": torch.zeros(slots, dtype=torch.bool, device=dev)}
        if self.confident:
            self._out["confidence"] = torch.zeros(slots, self.graph_drafter.steps, **f32)
        self._host = {key: torch.zeros(x.shape, dtype=x.dtype, pin_memory=pinned) for key, x in self._out.items()}
        ids = self.graph_drafter.vocab_ids if self.graph_drafter is not None else None
        self.vocab_ids = torch.from_numpy(ids).to(dev) if ids is not None else None  # a reduced draft vocabulary
        self._rounds.clear()

    def upload(self, i: int, length: int, anchor: int, budget: int, ctx: Context | None, params: SamplingParams
               ) -> None:
        """Set slot i's state from the host: a new request after its prefill."""
        self.length[i], self.anchor[i], self.budget[i] = length, anchor, budget
        self.temperature[i], self.top_k[i], self.top_p[i] = params.temperature, params.top_k, params.top_p
        if self.head is not None and ctx is not None:
            r = len(ctx.next_tokens)
            if r > self.gamma + 1:
                raise ValueError(f"slot {i}: {r} pending context rows, a round leaves at most {self.gamma + 1}")
            gd = self.graph_drafter
            feats = np.ascontiguousarray(ctx.features[:, gd.offset:gd.offset + gd.width], np.float32)
            self.ctx_features[i, :r] = torch.from_numpy(feats).to(self.device)
            self.ctx_next[i, :r] = torch.from_numpy(np.asarray(ctx.next_tokens, np.int64)).to(self.device)
            self.ctx_pos[i], self.ctx_rows[i] = ctx.pos, r
            self.pending[i] = r

    def run(self, slots: list, load: Load) -> Round:
        """The engine's executor call, as the host's (`HostRounds.round`): one round over slots [0, n) (None: idle; a
        sampled one draws its uniforms from its rng here), each slot's outcome, the scheduler and drafter told how it
        fared."""
        t0 = time.perf_counter()
        n = len(slots)
        b = self.target.spec.bucket("decode", B=n)["B"]
        host = {key: x.numpy() for key, x in self._in_host.items()}  # filled in place: no allocation per round
        head = self.graph_drafter.head.name if self.head is not None else ""
        plan = rounds.plan(slots, self.drafter, self.scheduler, self.costs, self.gamma, host, head_name=head,
                           confident=self.confident, proposed=self.proposed)
        for key, x in self._in.items():
            x.copy_(self._in_host[key], non_blocking=True)
        if plan.head:
            self._catch_up(n)
        key = (b, plan.sampled, *plan.filters, plan.head, plan.drafting)
        if key not in self._rounds:
            self._rounds[key] = self._graphed(_Captured(self, b, plan))
        with torch.inference_mode():
            self._rounds[key]()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the round's one synchronisation
        self.syncs += 1
        h = {k: v[:n].numpy() for k, v in self._host.items()}
        active = host["active"][:n]
        grown = np.where(active, h["accepted"] + 1, 0)
        self.pending[:n] = np.where(active, grown, self.pending[:n]) if plan.head else self.pending[:n] + grown
        if self.drafter is not None:  # who drafted each slot's row: the history its outcome updates
            self.drafter.drafted_by(h["lookup"] if plan.head else np.ones(n, bool))
        outcomes = rounds.outcomes(slots, h["lengths"], h["accepted"], h["tokens"], None, self.drafter,
                                   self.scheduler, drafted=plan.drafting)  # context rows stay on the device
        proposal = Proposal(tokens=h["drafts"], counts=h["counts"], probs=None,
                            confidence_logits=h.get("confidence") if plan.head else None)
        return Round(proposal, outcomes, draft_s=0.0, verify_s=time.perf_counter() - t0)

    def _catch_up(self, n: int) -> None:
        """Write every backlog longer than one propose call takes through the head's prefill bucket, all but its
        last row (which stays pending), as the host's hybrid does (GraphDrafter.prefill)."""
        t, w = self.gamma + 1, self.graph_drafter.width
        for i in np.flatnonzero(self.pending[:n] > t):
            r = int(self.pending[i])
            self.graph_drafter.write_rows(int(i), self.ctx_features[i, :r - 1, :w], self.ctx_next[i, :r - 1],
                                          self.ctx_pos[i:i + 1], device=True)
            self.ctx_features[i, 0], self.ctx_next[i, 0] = self.ctx_features[i, r - 1], self.ctx_next[i, r - 1]
            self.ctx_pos[i] += r - 1
            self.ctx_rows[i], self.pending[i] = 1, 1
            self.caught_up += 1

    def _graphed(self, fn: "_Captured") -> GraphedCall:
        if not self.capture:
            return GraphedCall(fn, capture=False, stats=self.graph_stats)
        state = [self.length, self.anchor, self.budget, self.ctx_pos, self.ctx_rows, self.ctx_features,
                 self.ctx_next, self.capacity]

        def warm_once() -> dict[str, Tensor]:  # a warm-up round that leaves the state as it found it
            saved = [s.clone() for s in state]
            out = fn()
            for s, v in zip(state, saved):
                s.copy_(v)
            return out

        return GraphedCall(fn, capture=True, stats=self.graph_stats, warmup=1, warm=warm_once)


class _Captured:
    """One round variant over slots [0, b) as a call on static tensors only (what a CUDA graph captures): the round of
    runtime/round.py with this executor's calls. `plan.sampled`: some slot samples (its rejection sampling runs beside
    the greedy match); `plan.filters`: whether any uses top-k / top-p; `plan.head`: the head drafts (else the host's
    lookups are the proposal); `plan.drafting`: some slot has drafts (else the target runs its decoding bucket)."""

    def __init__(self, rounds: DeviceRounds, b: int, plan: rounds.Plan) -> None:
        r = self.r = rounds
        self.gamma, self.scheduler, self.sampled, self.filters = r.gamma, r.scheduler, plan.sampled, plan.filters
        self.b, self.drafting = b, plan.drafting
        t = r.gamma + 1
        self.tt = t if r.gamma and plan.drafting else 1  # the target's tokens per slot this round
        spec = r.target.spec
        self.tb = spec.bucket("verify", B=b, T=t, P=b * t) if self.tt > 1 else spec.bucket("decode", B=b)
        self.tin = r.target.module_inputs(0, self.tb)
        self.grid = torch.arange(b * self.tt, device=r.device)  # the dense grid: the torch modules compute all of it
        self.x = {key: v if key in ("curve", "draft_ms") else v[:b] for key, v in r._in.items()}  # per slot, or not
        self.out, self.host = {k: v[:b] for k, v in r._out.items()}, {k: v[:b] for k, v in r._host.items()}
        self.state = RoundState(self.x["active"], r.length[:b], r.anchor[:b], r.budget[:b], r.capacity,
                                self.x["draft_ms"], self.x["curve"])
        self.head = r.head if plan.head else None
        if self.head is not None:
            self.hb = self.head.spec.bucket("propose", B=b, C=t)
            self.hin = self.head.module_inputs(0, self.hb)
            calls.head.settings(self.hin)  # the op reports survival; the rule cuts
            self.ctx = calls.ContextRows(r.ctx_features[:b, :t], r.ctx_next[:b, :t], r.ctx_pos[:b], r.ctx_rows[:b])
        # a round without the head: its rows join the backlog
        self.append = r.drafter is not None and r.drafter.backlog_rounds > 1 and self.head is None
        self._q = self._onehot = None

    def __call__(self) -> dict[str, Tensor]:
        res = rounds.run(self, self.state)
        out, tt = self.out, self.tt
        out["accepted"].copy_(res.accepted)
        out["tokens"][:, :tt].copy_(res.tokens)
        out["lengths"].copy_(res.lengths)
        if res.drafted is None:
            out["drafts"].zero_()
            out["counts"].zero_()
            out["lookup"].zero_()
        else:
            d = res.drafted
            out["drafts"][:, :d.tokens.shape[1]].copy_(d.tokens)
            out["counts"].copy_(d.counts)
            out["lookup"].copy_(d.lookup)
        for k in out:  # into host memory (pinned on CUDA: part of the graph, no sync)
            self.host[k].copy_(out[k], non_blocking=True)
        return out

    def draft(self, state: RoundState) -> Drafted | None:
        r, x, g = self.r, self.x, self.gamma
        if self.head is None:
            if not self.drafting:
                return None
            return Drafted(x["drafts"], x["counts"], x["survival"][:, :g], state.active)  # the host's lookups
        r.graph_drafter.calls.propose(self.hin, self.ctx, state.anchor)
        if self.sampled:  # greedy slots have temperature 0: argmax drafts
            self.hin[io.TEMPERATURE].copy_(r.temperature[:self.b])
            self.hin[io.NOISE].copy_(x["noise"])
        else:  # the inputs are shared with the sampled variant's graph
            self.hin[io.TEMPERATURE].zero_()
            self.hin[io.NOISE].zero_()
        d = self.head.forward(0, self.hb, graphed=False)
        proposed, counts = d[io.DRAFT_TOKENS], torch.full_like(state.length, r.proposed)
        a = d[io.SURVIVAL][:, :g] if r.confident else x["head_survival"][:, :g]
        if "confidence" in self.out:
            self.out["confidence"].copy_(d[io.CONFIDENCE_LOGITS])
        if self.sampled:
            self._q = self._full_vocabulary(d[io.DRAFT_PROBS][:, :g])
        lookup = torch.zeros_like(state.active)
        if r.drafter.picks:  # per slot, the lookups or the head's block (runtime/hybrid.py `pick`)
            lookup = pick(x["survival"][:, :g], a, x["counts"])
            proposed = torch.where(lookup[:, None], x["drafts"], proposed)
            counts = torch.where(lookup, x["counts"], counts)
            a = torch.where(lookup[:, None], x["survival"][:, :g], a)
            self._onehot = lookup
        return Drafted(proposed, counts, a, lookup)

    def verify(self, state: RoundState, drafts: Tensor, lengths: Tensor) -> Verified:
        drafts = drafts[:, :self.tt - 1]
        calls.target.grid(self.tin, state.anchor, torch.where(state.active, state.length, 0), drafts, self.grid)
        v = self.r.target.forward(0, self.tb, graphed=False)
        logits = v[io.LOGITS]
        return Verified(steps.best(logits, self.grid, self.b, self.tt), drafts, logits, v.get(io.FEATURES))

    def sample(self, state: RoundState, drafted: Drafted | None, verified: Verified, lengths: Tensor,
               accepted: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        r, b, tt = self.r, self.b, self.tt
        temperature = r.temperature[:b]
        greedy = temperature <= 0
        p = warp(verified.logits.view(b, tt, -1), torch.where(greedy, 1.0, temperature)[:, None].expand(b, tt),
                 r.top_k[:b, None].expand(b, tt), r.top_p[:b, None].expand(b, tt), filters=self.filters)
        q = self._q if drafted is not None else None
        a_s, tokens_s = accept_rows(verified.drafts, p, q, self._onehot, lengths, self.x["u"][:, :tt - 1],
                                    self.x["v"])
        return torch.where(greedy, accepted, a_s), torch.where(greedy[:, None], tokens, tokens_s)

    def commit(self, state: RoundState, verified: Verified, accepted: Tensor, tokens: Tensor, bonus: Tensor) -> None:
        if self.r.head is not None:
            self._keep_rows(state, verified, accepted, tokens)
        steps.advance(state.length, state.budget, state.anchor, accepted, bonus, state.active)

    def _keep_rows(self, state: RoundState, verified: Verified, accepted: Tensor, tokens: Tensor) -> None:
        """The verified rows as the head's next context rows (a round without the head: after the backlog's)."""
        r, b, active = self.r, self.b, state.active
        t = r.gamma + 1
        gd = r.graph_drafter
        feats = verified.features[..., gd.offset:gd.offset + gd.width]
        ctx_features, ctx_next, ctx_pos, ctx_rows = r.ctx_features[:b], r.ctx_next[:b], r.ctx_pos[:b], r.ctx_rows[:b]
        if self.append:  # after the backlog's rows; masked rows go to the spare row past the buffer
            slot_rows = torch.arange(self.tt, device=r.device)[None, :]
            keep = active[:, None] & (slot_rows <= accepted[:, None])
            at = torch.where(keep, ctx_rows[:, None] + slot_rows, r.rows)
            ctx_features.scatter_(1, at[..., None].expand(-1, -1, feats.shape[-1]), feats)
            ctx_next.scatter_(1, at, tokens)
            ctx_rows.add_(torch.where(active, accepted + 1, 0))
        else:
            ctx_features[:, :t].copy_(feats)
            ctx_pos.copy_(torch.where(active, state.length, ctx_pos))
            ctx_rows.copy_(torch.where(active, accepted + 1, ctx_rows))
            ctx_next[:, :t].copy_(tokens)

    def _full_vocabulary(self, probs: Tensor) -> Tensor:
        """Draft distributions [b, g, V'] over the whole vocabulary (zero outside a reduced draft vocabulary)."""
        ids = self.r.vocab_ids
        if ids is None:
            return probs
        full = torch.zeros(*probs.shape[:2], self.r.target_vocab, dtype=probs.dtype, device=probs.device)
        full[..., ids] = probs
        return full
