"""Rounds that stay on the torch device: one host synchronisation per round, for every method, scheduler and
sampling setting.

    plan      (host) what only the host knows, in one small copy down: which slots are active, n-gram lookups and
              the hybrid's (or a gated head's) choice to call the head or not (runtime/hybrid.py `choose`),
              survivals that come from acceptance measured so far (heads without a confidence head, lookups), the
              cost curve the sps schedulers plan on, and each sampled slot's uniforms (drawn from its rng in the
              host loop's order)
    draft     the head's modules on context rows the previous rounds left on the device (AR: no drafts); a hybrid
              keeps, per slot, the lookups or the head's block, whichever survives better (`pick`)
    schedule  the scheduler's lengths from the proposal's survivals (runtime/steps.py): fixed, threshold, sps
              (Algorithm 1 on the cost curve) or sps-async (the previous round's capacity, the best pairs of this
              one); capped by each slot's remaining token budget
    verify    the target over [anchor, d_1..d_γ] at positions L..L+γ of every slot (the whole grid: the torch
              modules compute it anyway, and on a GPU a short verify costs about what a long one does); a round in
              which no slot has drafts (a gated head not called, no lookup found: the host knows) runs the target's
              decoding bucket instead, one token per slot, and its own graph
    accept    greedy slots: the longest prefix of drafts equal to the target's argmax (runtime/steps.py); sampled
              slots: rejection sampling (runtime/acceptance.py `accept_rows`)
    commit    L += a + 1, anchor = bonus, budget -= a + 1; the verified rows' features become the head's next
              context rows (a hybrid round that skipped the head appends them to the slot's backlog instead), all on
              the device
    copy back accepted counts, tokens, lengths, drafts and confidences into host memory (pinned on CUDA), then
              the round's one synchronisation

The steps, the call contracts, the schedulers' rules and the acceptance rules are the host loop's own
(runtime/steps.py, runtime/calls, runtime/acceptance.py, runtime/hybrid.py `pick`), run here on torch tensors. On
CUDA the whole round is one CUDA graph per (slot bucket, sampling variant, head called or not, drafts or none),
captured after a warm-up whose state changes are undone. The cost table is read as it stands: the rounds are single
graphs whose calls are not timed apart, so the device path neither refines it online nor explores its cells
(runtime/costs.py; a gated head's explorations, which are the hybrid's, happen on both paths). A hybrid's backlog
longer than one propose call takes is written through the head's prefill bucket before the round, outside its graph
(the host knows every backlog's length without asking the device), by the head's own `GraphDrafter.write_rows`, the
host's prefill on the device's tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specrt import artifact as io
from specrt.runtime.backends.graphs import GraphedCall, GraphStats
from specrt.runtime import calls, steps
from specrt.runtime.acceptance import Verdict, accept_rows
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.backends.base import DeviceRunner
from specrt.runtime.drafters import Context, Drafter, Proposal
from specrt.runtime.hybrid import pick
from specrt.runtime.schedulers import Costs, Load, Scheduler, verify_curve
from specrt.runtime.speculative import Outcome, Round


@dataclass
class RoundResult:
    """What one device round sent back, for slots [0, n): host arrays valid until the next round."""

    accepted: np.ndarray  # [n] i64
    tokens: np.ndarray  # [n, γ + 1] i64: accepted drafts, then the bonus at index accepted
    lengths: np.ndarray  # [n] i64: drafts verified
    drafts: np.ndarray  # [n, K] i64: drafts proposed (a head's whole block; n-gram: γ)
    counts: np.ndarray  # [n] i64: drafts each slot's proposal holds
    confidence: np.ndarray | None  # [n, K] confidence logits (DSpark), on rounds that called the head


class DeviceRounds:
    """Decode steps (AR) or draft/verify rounds whose state lives on the target runner's device."""

    def __init__(self, target: DeviceRunner, drafter: Drafter | None, scheduler: Scheduler | None = None, *,
                 gamma: int, costs: Costs | None = None, capture: bool | None = None) -> None:
        """`scheduler`: the host's scheduler of this method (its name, and the acceptance history survivals come
        from where no confidence head gives them); `costs`: what the sps schedulers plan on; `capture`: each round
        bucket in one CUDA graph (default: on CUDA)."""
        self.target, self.drafter, self.scheduler, self.costs = target, drafter, scheduler, costs
        graph = drafter.graph if drafter is not None else None
        self.graph_drafter = graph  # the GraphDrafter whose head runs here (None: AR, n-gram lookups)
        self.head = graph.runner if graph is not None else None
        # the host's lookups come down: lookups alone, or a drafter that picks between them and its head
        self.ngram = drafter is not None and (drafter.picks or graph is None)
        self.picks = drafter is not None and drafter.picks  # per slot, lookups or the head's block (`pick`)
        self.backlog = drafter is not None and drafter.backlog_rounds > 1  # rounds without the head wait
        self.gamma = gamma if drafter is not None else 0
        traits = scheduler.traits if scheduler is not None and self.gamma else None
        self.plans_on_costs = traits is not None and traits.plans_on_costs
        self.device = target.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.width = graph.width if graph is not None else 0
        self.proposed = drafter.steps if drafter is not None else 0  # drafts a proposal holds (a head's block)
        self.offset = graph.offset if graph is not None else 0
        self.confident = self.head is not None and io.SURVIVAL in {o.name for o in self.head.spec.host_outputs()}
        t = self.gamma + 1
        # context rows a slot may hold: one round's, or a backlog's (rounds without the head)
        self.rows = (drafter.backlog_rounds if drafter is not None else 1) * t
        self.graph_stats = GraphStats()
        self.target_vocab = next(o for o in target.spec.outputs if o.name == io.LOGITS).shape[-1]
        self.syncs = 0  # host synchronisations: one per round
        self.caught_up = 0  # backlogs written through the head's prefill bucket
        self.slots = 0
        self.pending = np.zeros(0, np.int64)  # each slot's context rows on the device, as the host counts them
        # sps-async: the drafts the next round admits (planned on this round's survivals; -1: none yet)
        self.capacity = torch.full((), -1, dtype=torch.int64, device=self.device)
        self._rounds: dict[tuple, GraphedCall] = {}

    # -- state ----------------------------------------------------------------------------------------

    def allocate(self, slots: int) -> None:
        """Per-slot state and result buffers for `slots` slots (the runners' caches are allocated apart)."""
        if slots == self.slots:
            return
        self.slots, dev, t, g = slots, self.device, self.gamma + 1, self.gamma
        i64 = dict(dtype=torch.int64, device=dev)
        self.length, self.anchor, self.budget = (torch.zeros(slots, **i64) for _ in range(3))
        self.ctx_pos, self.ctx_rows = torch.zeros(slots, **i64), torch.ones(slots, **i64)
        # the head's pending context rows, and one row more that masked writes go to
        self.ctx_features = torch.zeros(slots, self.rows + 1, max(self.width, 1), dtype=torch.float32, device=dev)
        self.ctx_next = torch.zeros(slots, self.rows + 1, **i64)  # MTP: the token after each context row
        self.pending = np.zeros(slots, np.int64)
        f64 = dict(dtype=torch.float64, device=dev)
        # each request's sampling parameters, set when it is admitted
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.top_k, self.top_p = torch.zeros(slots, **i64), torch.ones(slots, **f64)
        self.params: list[SamplingParams | None] = [None] * slots
        pinned = dev.type == "cuda"
        # what the host copies down each round (one copy per tensor, from pinned memory on CUDA)
        k = max(self.proposed, 1)
        self._in = {"active": torch.zeros(slots, dtype=torch.bool, device=dev),
                    "drafts": torch.zeros(slots, k, **i64), "counts": torch.zeros(slots, **i64),  # n-gram lookups
                    "survival": torch.zeros(slots, max(g, 1), dtype=torch.float32, device=dev),  # the lookups'
                    "head_survival": torch.zeros(slots, max(g, 1), dtype=torch.float32, device=dev),  # no confidence
                    "curve": torch.zeros(slots * t + 1, **f64), "draft_ms": torch.zeros((), **f64),  # sps
                    "noise": torch.zeros(slots, k, dtype=torch.float32, device=dev),  # sampled drafts' uniforms
                    "u": torch.zeros(slots, max(g, 1), **f64), "v": torch.zeros(slots, **f64)}  # acceptance, bonus
        self._in_host = {key: torch.zeros(x.shape, dtype=x.dtype, pin_memory=pinned) for key, x in self._in.items()}
        self.active = self._in["active"]
        self._out = {"accepted": torch.zeros(slots, **i64), "tokens": torch.zeros(slots, t, **i64),
                     "lengths": torch.zeros(slots, **i64), "drafts": torch.zeros(slots, self.proposed, **i64),
                     "counts": torch.zeros(slots, **i64), "lookup": torch.zeros(slots, dtype=torch.bool, device=dev)}
        if self.confident:
            self._out["confidence"] = torch.zeros(slots, self.graph_drafter.steps, dtype=torch.float32, device=dev)
        self._host = {key: torch.zeros(x.shape, dtype=x.dtype, pin_memory=pinned) for key, x in self._out.items()}
        if self.head is not None and self.graph_drafter.vocab_ids is not None:  # a reduced draft vocabulary's ids
            self._vocab_ids = torch.from_numpy(self.graph_drafter.vocab_ids).to(dev)
        self._rounds.clear()

    def upload(self, i: int, length: int, anchor: int, budget: int, ctx: Context | None, params: SamplingParams
               ) -> None:
        """Set slot i's state from the host: a new request after its prefill."""
        self.length[i], self.anchor[i], self.budget[i] = length, anchor, budget
        self.params[i] = params
        self.temperature[i], self.top_k[i], self.top_p[i] = params.temperature, params.top_k, params.top_p
        if self.head is not None and ctx is not None:
            r = len(ctx.next_tokens)
            if r > self.gamma + 1:
                raise ValueError(f"slot {i}: {r} pending context rows, a round leaves at most {self.gamma + 1}")
            feats = np.ascontiguousarray(ctx.features[:, self.offset:self.offset + self.width], np.float32)
            self.ctx_features[i, :r] = torch.from_numpy(feats).to(self.device)
            self.ctx_next[i, :r] = torch.from_numpy(np.asarray(ctx.next_tokens, np.int64)).to(self.device)
            self.ctx_pos[i], self.ctx_rows[i] = ctx.pos, r
            self.pending[i] = r

    # -- rounds ---------------------------------------------------------------------------------------

    def run(self, slots: list, load: Load) -> Round:
        """The engine's executor call, as the host's (`Speculator.round`): one round over slots [0, n), each slot's
        outcome, the scheduler and drafter told how it fared."""
        t0 = time.perf_counter()
        res = self.round(len(slots), slots)
        verify_s = time.perf_counter() - t0
        outcomes: list[Outcome | None] = []
        for i, s in enumerate(slots):
            if s is None:
                outcomes.append(None)
                continue
            a, ell = int(res.accepted[i]), int(res.lengths[i])
            tokens = res.tokens[i, :a + 1].tolist()
            if self.drafter is not None:
                self.scheduler.observe(ell, a)
                self.drafter.observe(i, ell, a)
            outcomes.append(Outcome(ell, Verdict(a, tokens[-1]), tokens, None))  # context rows stay on the device
        proposal = Proposal(tokens=res.drafts, counts=res.counts, probs=None, confidence_logits=res.confidence)
        return Round(proposal, outcomes, draft_s=0.0, verify_s=verify_s)

    def round(self, n: int, slots: list) -> RoundResult:
        """One round over slots [0, n) (rounded up to a bucket); `slots[i]`: slot i's request state (None: idle; a
        sampled one draws its uniforms from its rng here, in the host loop's order)."""
        b = self.target.spec.bucket("decode", B=n)["B"]
        host = {key: x.numpy() for key, x in self._in_host.items()}  # filled in place: no allocation per round
        host["active"][:] = False
        host["active"][:n] = [s is not None for s in slots]
        with_head = False
        if self.drafter is not None:
            plan = self.drafter.plan(slots, self.scheduler)  # what only the host knows
            with_head = plan.head and self.head is not None
            if plan.survival is not None:
                host["survival"][:n, :self.gamma] = plan.survival[:, :self.gamma]
            if self.ngram:
                host["drafts"][:], host["counts"][:] = 0, 0
                found = plan.lookups
                host["drafts"][:n, :found.tokens.shape[1]], host["counts"][:n] = found.tokens, found.counts
            if with_head and not self.confident and plan.head_survival is not None:
                host["head_survival"][:] = plan.head_survival[:self.gamma]
        if self.plans_on_costs:
            host["curve"][:] = verify_curve(self.costs, n, len(host["curve"]) - 1)
            host["draft_ms"][...] = self.costs.draft_ms(self.graph_drafter.head.name, n) if with_head else 0.0
        filters = [False, False]
        for i, s in enumerate(slots):
            if s is None or s.params.greedy:
                continue
            # the host loop's order: the head's draft noise, gamma acceptance uniforms, the bonus's
            if with_head:
                host["noise"][i] = s.rng.random(self.proposed, dtype=np.float32)
            host["u"][i, :self.gamma] = s.rng.random(self.gamma)
            host["v"][i] = s.rng.random()
            filters[0] |= s.params.top_k > 0
            filters[1] |= s.params.top_p < 1.0
        sampled = any(s is not None and not s.params.greedy for s in slots)
        for key, x in self._in.items():
            x.copy_(self._in_host[key], non_blocking=True)
        if with_head:
            self._catch_up(n)
        # no drafts at all (a gated head not called, no lookup found): the round is a decoding step
        drafting = bool(self.gamma) and (with_head or bool(self.ngram and host["counts"][:n].any()))
        key = (b, sampled, *filters, with_head, drafting)
        if key not in self._rounds:
            self._rounds[key] = self._graphed(b, sampled, tuple(filters), with_head, drafting)
        with torch.inference_mode():
            self._rounds[key]()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the round's one synchronisation
        self.syncs += 1
        h = {k: v[:n].numpy() for k, v in self._host.items()}
        active = host["active"][:n]
        grown = np.where(active, h["accepted"] + 1, 0)
        self.pending[:n] = np.where(active, grown, self.pending[:n]) if with_head else self.pending[:n] + grown
        if self.drafter is not None:  # who drafted each slot's row: the history its outcome updates
            self.drafter.drafted_by(h["lookup"] if with_head else np.ones(n, bool))
        return RoundResult(h["accepted"], h["tokens"], h["lengths"], h["drafts"], h["counts"],
                           h.get("confidence") if with_head else None)

    def _catch_up(self, n: int) -> None:
        """Write every backlog longer than one propose call takes through the head's prefill bucket, all but its
        last row (which stays pending), as the host's hybrid does (GraphDrafter.prefill)."""
        t = self.gamma + 1
        for i in np.flatnonzero(self.pending[:n] > t):
            r = int(self.pending[i])
            self.graph_drafter.write_rows(int(i), self.ctx_features[i, :r - 1, :self.width], self.ctx_next[i, :r - 1],
                                          self.ctx_pos[i:i + 1], device=True)
            self.ctx_features[i, 0] = self.ctx_features[i, r - 1]
            self.ctx_next[i, 0] = self.ctx_next[i, r - 1]
            self.ctx_pos[i] += r - 1
            self.ctx_rows[i] = 1
            self.pending[i] = 1
            self.caught_up += 1

    def _graphed(self, b: int, sampled: bool, filters: tuple[bool, bool], with_head: bool, drafting: bool
                 ) -> GraphedCall:
        fn = self._round_fn(b, sampled, filters, with_head, drafting)
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

    def _lengths(self, a: Tensor, counts: Tensor, active: Tensor, x: dict[str, Tensor]) -> Tensor:
        """The scheduler's lengths [b] from survivals a [b, γ] (zero past counts): its rule
        (runtime/schedulers.py), the one the host's schedule computes."""
        if self.scheduler is None:
            return counts
        return self.scheduler.rule(a, counts, active, x["draft_ms"], x["curve"], self.capacity)

    def _round_fn(self, b: int, sampled: bool, filters: tuple[bool, bool], with_head: bool, drafting: bool = True):
        """The round over slots [0, b) as a function of static tensors only (what a CUDA graph captures): the
        host loop's steps (runtime/steps.py), call contracts (runtime/calls) and acceptance rules, on the device.
        `sampled`: some slot samples (its rejection sampling runs beside the greedy match); `filters`: whether any
        uses top-k / top-p; `with_head`: the head drafts (else the host's lookups are the proposal); `drafting`:
        some slot has drafts (else the target runs its decoding step's bucket, one token per slot, as AR does)."""
        g, t = self.gamma, self.gamma + 1
        tt = t if g and drafting else 1  # the target's tokens per slot this round
        target, head = self.target, self.head if with_head else None
        tb = target.spec.bucket("verify", B=b, T=t, P=b * t) if tt > 1 else target.spec.bucket("decode", B=b)
        tin = target.module_inputs(0, tb)
        rows = torch.arange(b * tt, device=self.device)  # the dense grid: the torch modules compute all of it
        length, anchor, budget = self.length[:b], self.anchor[:b], self.budget[:b]
        x = {key: v if key in ("curve", "draft_ms") else v[:b] for key, v in self._in.items()}  # per slot, or not
        active = x["active"]
        out, host = {k: v[:b] for k, v in self._out.items()}, {k: v[:b] for k, v in self._host.items()}
        temperature, top_k, top_p = self.temperature[:b], self.top_k[:b], self.top_p[:b]
        ctx_features, ctx_next = self.ctx_features[:b], self.ctx_next[:b]
        ctx_pos, ctx_rows = self.ctx_pos[:b], self.ctx_rows[:b]
        if head is not None:
            hb = head.spec.bucket("propose", B=b, C=t)
            hin = head.module_inputs(0, hb)
            calls.head.settings(hin)  # the op reports survival; the schedule is cut below
            ctx = calls.ContextRows(ctx_features[:, :t], ctx_next[:, :t], ctx_pos, ctx_rows)
            fill = self.graph_drafter.calls.propose
        append = self.backlog and head is None  # a round without the head: its rows join the backlog
        slot_rows = torch.arange(tt, device=self.device)[None, :]

        def fn() -> dict[str, Tensor]:
            q = onehot = None
            lookup = torch.zeros_like(active)
            if head is not None:
                fill(hin, ctx, anchor)
                if sampled:  # greedy slots have temperature 0: argmax drafts
                    hin[io.TEMPERATURE].copy_(temperature)
                    hin[io.NOISE].copy_(x["noise"])
                else:  # the inputs are shared with the sampled variant's graph
                    hin[io.TEMPERATURE].zero_()
                    hin[io.NOISE].zero_()
                d = head.forward(0, hb, graphed=False)
                proposed = d[io.DRAFT_TOKENS]
                counts = torch.full_like(length, self.proposed)
                a = d[io.SURVIVAL][:, :g] if self.confident else x["head_survival"][:, :g]
                if "confidence" in out:
                    out["confidence"].copy_(d[io.CONFIDENCE_LOGITS])
                if sampled:
                    q = self._full_vocabulary(d[io.DRAFT_PROBS][:, :g])
                if self.picks:  # per slot, the lookups or the head's block (runtime/hybrid.py `pick`)
                    lookup = pick(x["survival"][:, :g], a, x["counts"])
                    proposed = torch.where(lookup[:, None], x["drafts"], proposed)
                    counts = torch.where(lookup, x["counts"], counts)
                    a = torch.where(lookup[:, None], x["survival"][:, :g], a)
                    onehot = lookup
            elif self.ngram:
                proposed, counts = x["drafts"], x["counts"]
                a = x["survival"][:, :g]
                lookup = active
            else:
                proposed = x["drafts"][:, :0]
                counts = torch.zeros_like(length)
                a = x["survival"][:, :0]
            drafts = proposed[:, :tt - 1]
            if tt > 1:
                lengths = steps.cap(self._lengths(steps.survive(a, counts), counts, active, x), counts, budget, active,
                                    g)
            else:  # never scheduled (sps-async's plan waits for a round with drafts, as Speculator.schedule's)
                lengths = torch.zeros_like(counts)
            calls.target.grid(tin, anchor, torch.where(active, length, 0), drafts, rows)
            v = target.forward(0, tb, graphed=False)
            logits = v[io.LOGITS]
            accepted, tokens = steps.accept(drafts, steps.best(logits, rows, b, tt), lengths)
            if sampled:
                greedy = temperature <= 0
                p = warp(logits.view(b, tt, -1), torch.where(greedy, 1.0, temperature)[:, None].expand(b, tt),
                         top_k[:, None].expand(b, tt), top_p[:, None].expand(b, tt), filters=filters)
                a_s, tokens_s = accept_rows(drafts, p, q, onehot, lengths, x["u"][:, :tt - 1], x["v"])
                accepted = torch.where(greedy, accepted, a_s)
                tokens = torch.where(greedy[:, None], tokens, tokens_s)
            bonus = tokens.gather(1, accepted[:, None])[:, 0]
            if self.head is not None:  # the verified rows are the head's next context rows
                feats = v[io.FEATURES][..., self.offset:self.offset + self.width]
                if append:  # after the backlog's rows; masked rows go to the spare row past the buffer
                    keep = active[:, None] & (slot_rows <= accepted[:, None])
                    at = torch.where(keep, ctx_rows[:, None] + slot_rows, self.rows)
                    ctx_features.scatter_(1, at[..., None].expand(-1, -1, feats.shape[-1]), feats)
                    ctx_next.scatter_(1, at, tokens)
                    ctx_rows.add_(torch.where(active, accepted + 1, 0))
                else:
                    ctx_features[:, :t].copy_(feats)
                    ctx_pos.copy_(torch.where(active, length, ctx_pos))
                    ctx_rows.copy_(torch.where(active, accepted + 1, ctx_rows))
                    ctx_next[:, :t].copy_(tokens)
            steps.advance(length, budget, anchor, accepted, bonus, active)
            out["accepted"].copy_(accepted)
            out["tokens"][:, :tt].copy_(tokens)
            out["lengths"].copy_(lengths)
            out["drafts"][:, :proposed.shape[1]].copy_(proposed)
            out["counts"].copy_(counts)
            out["lookup"].copy_(lookup)
            for k in out:  # into host memory (pinned on CUDA: part of the graph, no sync)
                host[k].copy_(out[k], non_blocking=True)
            return out
        return fn

    def _full_vocabulary(self, probs: Tensor) -> Tensor:
        """Draft distributions [b, g, V'] over the whole vocabulary (zero outside a reduced draft vocabulary)."""
        if self.graph_drafter.vocab_ids is None:
            return probs
        full = torch.zeros(*probs.shape[:2], self.target_vocab, dtype=probs.dtype, device=probs.device)
        full[..., self._vocab_ids] = probs
        return full
