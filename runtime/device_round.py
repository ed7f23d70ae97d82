"""Greedy rounds that stay on the torch device: one host synchronisation per round.

    draft     the head's modules on context rows the previous round left on the device (n-gram: drafts copied
              up from the host, which knows every token; AR: no drafts)
    truncate  the verify lengths: every draft (fixed), or specrt::ConfidenceTruncate's threshold mode on the
              device (threshold, DSpark's confidence head); capped by each slot's remaining token budget
    verify    the target over [anchor, d_1..d_γ] at positions L..L+γ of every slot (the whole grid: the torch
              modules compute it anyway, and on a GPU a short verify costs about what a long one does)
    accept    the longest prefix of drafts equal to the target's argmax within the length; bonus = argmax there
    commit    L += a + 1, anchor = bonus, budget -= a + 1; the verified rows' features become the head's next
              context rows, all on the device
    copy back accepted counts, tokens, lengths, drafts and confidences into host memory (pinned on CUDA), then
              the round's one synchronisation

On CUDA the whole round is one CUDA graph per slot bucket (captured after a warm-up whose state changes are
undone). The engine uses these rounds when every active request decodes greedily and the method and scheduler
are ones the device can run (`unsupported` says why not); otherwise it runs the host loop of
runtime/speculative.py on the same runners, moving the slots' state between the two (sampling acceptance stays
on the host for now).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specrt import artifact as io
from specrt.runtime.backends.graphs import GraphedCall, GraphStats
from specrt.runtime.config import Method
from specrt.runtime import calls, steps
from specrt.runtime.backends.base import DeviceRunner
from specrt.runtime.drafters import Context, Drafter

DEVICE_SCHEDULERS = ("fixed", "threshold")  # the schedulers a device-resident round runs


def unsupported(method: Method, scheduler: str, manifest: io.Manifest) -> str:
    """Why a device-resident round cannot run this method and scheduler ("" when it can)."""
    if method.hybrid:
        return f"{method.name} chooses between the head and lookups on the host"
    if method.speculative and scheduler not in DEVICE_SCHEDULERS:
        return f"the {scheduler} scheduler plans on the host"
    if scheduler == "threshold" and method.speculative:
        head = manifest.heads.get(method.head) if method.head else None
        if head is None or not head.confidence:
            return "the threshold scheduler needs a DSpark confidence head on the device"
    return ""


@dataclass
class RoundResult:
    """What one device round sent back, for slots [0, n): host arrays valid until the next round."""

    accepted: np.ndarray  # [n] i64
    tokens: np.ndarray  # [n, γ + 1] i64: accepted drafts, then the bonus at index accepted
    lengths: np.ndarray  # [n] i64: drafts verified
    drafts: np.ndarray  # [n, K] i64: drafts proposed (a head's whole block; n-gram: γ)
    confidence: np.ndarray | None  # [n, K] confidence logits (DSpark)


class DeviceRounds:
    """Greedy decode steps (AR) or draft/verify rounds whose state lives on the target runner's device."""

    def __init__(self, target: DeviceRunner, drafter: Drafter | None, *, gamma: int, scheduler: str = "fixed", threshold: float = 0.3,
                 capture: bool | None = None) -> None:
        """`capture`: each round bucket in one CUDA graph (default: on CUDA)."""
        self.target, self.drafter = target, drafter
        own = drafter is not None and drafter.calls is not None  # a head with a graph family of its own
        self.head = drafter.runner if own else None
        self.ngram = drafter is not None and not own
        self.gamma = gamma if drafter is not None else 0
        self.truncate = scheduler == "threshold" and self.gamma > 0
        self.threshold = threshold
        self.device = target.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.width = drafter.width if self.head is not None else 0
        self.proposed = drafter.steps if drafter is not None else 0  # drafts a proposal holds (a head's block)
        self.offset = drafter.offset if self.head is not None else 0
        self.graph_stats = GraphStats()
        self.syncs = 0  # host synchronisations: one per round
        self.slots = 0
        self._rounds: dict[int, GraphedCall] = {}

    # -- state ----------------------------------------------------------------------------------------

    def allocate(self, slots: int) -> None:
        """Per-slot state and result buffers for `slots` slots (the runners' caches are allocated apart)."""
        if slots == self.slots:
            return
        self.slots, dev, t = slots, self.device, self.gamma + 1
        i64 = dict(dtype=torch.int64, device=dev)
        self.length, self.anchor, self.budget = (torch.zeros(slots, **i64) for _ in range(3))
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.ctx_pos, self.ctx_rows = torch.zeros(slots, **i64), torch.ones(slots, **i64)
        self.ctx_features = torch.zeros(slots, t, max(self.width, 1), dtype=torch.float32, device=dev)
        self.ctx_next = torch.zeros(slots, t, **i64)  # MTP: the token after each context row
        self.draft_in = torch.zeros(slots, max(self.gamma, 1), **i64)  # n-gram drafts, copied up per round
        self.count_in = torch.zeros(slots, **i64)
        pinned = dev.type == "cuda"
        conf = self.head is not None and io.CONFIDENCE_LOGITS in {o.name for o in self.head.spec.host_outputs()}
        self._out = {"accepted": torch.zeros(slots, **i64), "tokens": torch.zeros(slots, t, **i64),
                     "lengths": torch.zeros(slots, **i64), "drafts": torch.zeros(slots, self.proposed, **i64)}
        if conf:
            self._out["confidence"] = torch.zeros(slots, self.drafter.steps, dtype=torch.float32, device=dev)
        self._host = {k: torch.zeros(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in self._out.items()}
        self._draft_host = torch.zeros(self.draft_in.shape, dtype=torch.int64, pin_memory=pinned)
        self._count_host = torch.zeros(slots, dtype=torch.int64, pin_memory=pinned)
        self._active_host = torch.zeros(slots, dtype=torch.bool, pin_memory=pinned)
        self._rounds.clear()

    def upload(self, i: int, length: int, anchor: int, budget: int, ctx: Context | None) -> None:
        """Set slot i's state from the host (a new request after prefill, or after a host-loop round)."""
        self.length[i], self.anchor[i], self.budget[i] = length, anchor, budget
        if self.head is not None and ctx is not None:
            r = len(ctx.next_tokens)
            if r > self.gamma + 1:
                raise ValueError(f"slot {i}: {r} pending context rows, a round leaves at most {self.gamma + 1}")
            feats = np.ascontiguousarray(ctx.features[:, self.offset:self.offset + self.width], np.float32)
            self.ctx_features[i, :r] = torch.from_numpy(feats).to(self.device)
            self.ctx_next[i, :r] = torch.from_numpy(np.asarray(ctx.next_tokens, np.int64)).to(self.device)
            self.ctx_pos[i], self.ctx_rows[i] = ctx.pos, r

    def download(self, i: int, feature_dim: int) -> Context:
        """Slot i's pending context rows as the host drafters take them (features in their columns of the
        target's `feature_dim`; a host sync, for the switch to a host-loop round)."""
        r = int(self.ctx_rows[i])
        feats = np.zeros((r, feature_dim), np.float32)
        feats[:, self.offset:self.offset + self.width] = self.ctx_features[i, :r].cpu().numpy()
        return Context(pos=int(self.ctx_pos[i]), features=feats, next_tokens=self.ctx_next[i, :r].cpu().numpy())

    # -- rounds ---------------------------------------------------------------------------------------

    def round(self, n: int, active: list[bool], lookups=None) -> RoundResult:
        """One round over slots [0, n) (rounded up to a bucket); `active[i]`: slot i holds a request; `lookups`:
        the n-gram drafter's proposal (copied up)."""
        b = self.target.spec.bucket("decode", B=n)["B"]
        host_active = self._active_host.numpy()  # filled in place: no allocation per round
        host_active[:] = False
        host_active[:n] = active
        self.active.copy_(self._active_host, non_blocking=True)
        if self.ngram:
            drafts, counts = self._draft_host.numpy(), self._count_host.numpy()
            drafts[:], counts[:] = 0, 0
            drafts[:n], counts[:n] = lookups.tokens[:n, :self.gamma], lookups.counts[:n]
            self.draft_in.copy_(self._draft_host, non_blocking=True)
            self.count_in.copy_(self._count_host, non_blocking=True)
        if b not in self._rounds:
            self._rounds[b] = self._graphed(b)
        with torch.inference_mode():
            self._rounds[b]()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the round's one synchronisation
        self.syncs += 1
        h = {k: v[:n].numpy() for k, v in self._host.items()}
        return RoundResult(h["accepted"], h["tokens"], h["lengths"], h["drafts"], h.get("confidence"))

    def _graphed(self, b: int) -> GraphedCall:
        fn = self._round_fn(b)
        if not self.capture:
            return GraphedCall(fn, capture=False, stats=self.graph_stats)
        state = [self.length, self.anchor, self.budget, self.ctx_pos, self.ctx_rows, self.ctx_features,
                 self.ctx_next]

        def warm_once() -> dict[str, Tensor]:  # a warm-up round that leaves the state as it found it
            saved = [s.clone() for s in state]
            out = fn()
            for s, v in zip(state, saved):
                s.copy_(v)
            return out

        return GraphedCall(fn, capture=True, stats=self.graph_stats, warmup=1, warm=warm_once)

    def _round_fn(self, b: int):
        """The round over slots [0, b) as a function of static tensors only (what a CUDA graph captures): the
        host loop's steps (runtime/steps.py) and call contracts (runtime/calls), on the device."""
        g, t = self.gamma, self.gamma + 1
        target, head = self.target, self.head
        tb = target.spec.bucket("verify", B=b, T=t, P=b * t) if g else target.spec.bucket("decode", B=b)
        tin = target.module_inputs(0, tb)
        rows = torch.arange(b * t, device=self.device)  # the dense grid: the torch modules compute all of it
        length, anchor, budget, active = self.length[:b], self.anchor[:b], self.budget[:b], self.active[:b]
        out, host = {k: v[:b] for k, v in self._out.items()}, {k: v[:b] for k, v in self._host.items()}
        if head is not None:
            hb = head.spec.bucket("propose", B=b, C=t)
            hin = head.module_inputs(0, hb)
            calls.head.settings(hin, threshold=self.threshold if self.truncate else 0.0)
            ctx = calls.ContextRows(self.ctx_features[:b], self.ctx_next[:b], self.ctx_pos[:b], self.ctx_rows[:b])
            fill = self.drafter.calls.propose

        def fn() -> dict[str, Tensor]:
            if head is not None:
                fill(hin, ctx, anchor)
                d = head.forward(0, hb, graphed=False)
                proposed = d[io.DRAFT_TOKENS]
                planned = d[io.VERIFY_LENGTHS] if self.truncate else torch.full_like(length, g)
                counts = torch.full_like(length, self.proposed)
                if "confidence" in out:
                    out["confidence"].copy_(d[io.CONFIDENCE_LOGITS])
            elif self.ngram:
                proposed = self.draft_in[:b]
                planned = counts = self.count_in[:b]
            else:
                proposed = self.draft_in[:b, :0]
                planned = counts = torch.zeros_like(length)
            drafts = proposed[:, :g]
            lengths = steps.cap(planned, counts, budget, active, g)
            calls.target.grid(tin, anchor, torch.where(active, length, 0), drafts, rows)
            v = target.forward(0, tb, graphed=False)
            accepted, tokens = steps.accept(drafts, steps.best(v[io.LOGITS], rows, b, t), lengths)
            bonus = tokens.gather(1, accepted[:, None])[:, 0]
            if head is not None:  # the verified rows are the head's next context rows
                self.ctx_features[:b].copy_(v[io.FEATURES][..., self.offset:self.offset + self.width])
                self.ctx_pos[:b].copy_(torch.where(active, length, self.ctx_pos[:b]))
                self.ctx_rows[:b].copy_(torch.where(active, accepted + 1, self.ctx_rows[:b]))
                self.ctx_next[:b].copy_(tokens)
            steps.advance(length, budget, anchor, accepted, bonus, active)
            out["accepted"].copy_(accepted)
            out["tokens"].copy_(tokens)
            out["lengths"].copy_(lengths)
            out["drafts"].copy_(proposed)
            for k in out:  # into host memory (pinned on CUDA: part of the graph, no sync)
                host[k].copy_(out[k], non_blocking=True)
            return out
        return fn
