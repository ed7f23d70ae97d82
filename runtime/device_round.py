"""The torch backend's rounds: the round's state lives on the target runner's device, each round runs as one call
of its executor (runtime/torch_round.py `TorchRound`), and each round is one host synchronisation, for every method,
scheduler and sampling setting. This module keeps the state and the buffers, and the capture:

    plan      (host) runtime/round.py `plan`, in one small copy down: active slots, the drafter's lookups and its
              choice to call the head, survivals measured so far, the cost curve, each sampled slot's uniforms
    round     the round variant's call (slot bucket, sampling and its filters, head called or not, drafts or none):
              on CUDA one CUDA graph each, captured after a warm-up whose state changes are undone
    copy back accepted counts, tokens, lengths, drafts and confidences into host memory (pinned on CUDA), then the
              round's one synchronisation

The cost table is read as it stands: the rounds are single graphs whose calls are not timed apart, so the device path
neither refines it online nor explores its cells (runtime/costs.py; a gated head's explorations, which are the
hybrid's, happen on both paths). A backlog longer than one propose call takes is written through the head's prefill
bucket before the round, outside its graph (the host knows every backlog's length), by the head's own
`GraphDrafter.write_rows`.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from specrt import artifact as io
from specrt.runtime import round as rounds
from specrt.runtime.backends.base import DeviceRunner
from specrt.runtime.backends.graphs import GraphedCall, GraphStats
from specrt.runtime.drafters import Context, Drafter, Proposal
from specrt.runtime.round import Round
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.schedulers import Costs, Load, Scheduler
from specrt.runtime.torch_round import TorchRound


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
            self._rounds[key] = self._graphed(TorchRound(self, b, plan))
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

    def _graphed(self, fn: TorchRound) -> GraphedCall:
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
