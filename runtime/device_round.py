"""Rounds that stay on the torch device: one host synchronisation per round, greedy and sampled requests alike.

    draft     the head's modules on context rows the previous round left on the device (n-gram: drafts copied
              up from the host, which knows every token; AR: no drafts); sampled slots draw their drafts with
              their temperature and noise drawn on the host from the request's rng
    truncate  the verify lengths: every draft (fixed), or specrt::ConfidenceTruncate's threshold mode on the
              device (threshold, DSpark's confidence head); capped by each slot's remaining token budget
    verify    the target over [anchor, d_1..d_γ] at positions L..L+γ of every slot (the whole grid: the torch
              modules compute it anyway, and on a GPU a short verify costs about what a long one does)
    accept    greedy slots: the longest prefix of drafts equal to the target's argmax (runtime/steps.py); sampled
              slots: rejection sampling (runtime/acceptance.py `accept_rows`) with uniforms copied down per round
    commit    L += a + 1, anchor = bonus, budget -= a + 1; the verified rows' features become the head's next
              context rows, all on the device
    copy back accepted counts, tokens, lengths, drafts and confidences into host memory (pinned on CUDA), then
              the round's one synchronisation

The steps, the call contracts and the acceptance rules are the host loop's own (runtime/steps.py, runtime/calls,
runtime/acceptance.py), run here on torch tensors. What only the host knows comes down once per round in one small
copy: which slots are active, n-gram drafts, and each sampled slot's uniforms (drawn from its rng in the host
loop's order, so a seeded request draws the same tokens on either path). On CUDA the whole round is one CUDA graph
per (slot bucket, sampling variant), captured after a warm-up whose state changes are undone. The engine runs
these rounds on the torch backend whenever the method and scheduler allow (`unsupported` says why not: the
hybrids and the sps schedulers plan on the host, and then the host loop runs every round).
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
from specrt.runtime.acceptance import accept_rows
from specrt.runtime.sampling import SamplingParams, warp
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
    """Decode steps (AR) or draft/verify rounds whose state lives on the target runner's device."""

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
        self.target_vocab = next(o for o in target.spec.outputs if o.name == io.LOGITS).shape[-1]
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
        self.ctx_pos, self.ctx_rows = torch.zeros(slots, **i64), torch.ones(slots, **i64)
        self.ctx_features = torch.zeros(slots, t, max(self.width, 1), dtype=torch.float32, device=dev)
        self.ctx_next = torch.zeros(slots, t, **i64)  # MTP: the token after each context row
        f64 = dict(dtype=torch.float64, device=dev)
        # each request's sampling parameters, set when it is admitted
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.top_k, self.top_p = torch.zeros(slots, **i64), torch.ones(slots, **f64)
        self.params: list[SamplingParams | None] = [None] * slots
        pinned = dev.type == "cuda"
        # what the host copies down each round (one copy per tensor, from pinned memory on CUDA)
        g, k = max(self.gamma, 1), max(self.proposed, 1)
        self._in = {"active": torch.zeros(slots, dtype=torch.bool, device=dev),
                    "drafts": torch.zeros(slots, g, **i64), "counts": torch.zeros(slots, **i64),  # n-gram lookups
                    "noise": torch.zeros(slots, k, dtype=torch.float32, device=dev),  # sampled drafts' uniforms
                    "u": torch.zeros(slots, g, **f64), "v": torch.zeros(slots, **f64)}  # acceptance, bonus
        self._in_host = {key: torch.zeros(x.shape, dtype=x.dtype, pin_memory=pinned) for key, x in self._in.items()}
        self.active = self._in["active"]
        conf = self.head is not None and io.CONFIDENCE_LOGITS in {o.name for o in self.head.spec.host_outputs()}
        self._out = {"accepted": torch.zeros(slots, **i64), "tokens": torch.zeros(slots, t, **i64),
                     "lengths": torch.zeros(slots, **i64), "drafts": torch.zeros(slots, self.proposed, **i64)}
        if conf:
            self._out["confidence"] = torch.zeros(slots, self.drafter.steps, dtype=torch.float32, device=dev)
        self._host = {key: torch.zeros(x.shape, dtype=x.dtype, pin_memory=pinned) for key, x in self._out.items()}
        if self.head is not None and self.drafter.vocab_ids is not None:  # a reduced draft vocabulary's token ids
            self._vocab_ids = torch.from_numpy(self.drafter.vocab_ids).to(dev)
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

    # -- rounds ---------------------------------------------------------------------------------------

    def round(self, n: int, slots: list, lookups=None) -> RoundResult:
        """One round over slots [0, n) (rounded up to a bucket); `slots[i]`: slot i's request state (None: idle; a
        sampled one draws its uniforms from its rng here); `lookups`: the n-gram drafter's proposal (copied up)."""
        b = self.target.spec.bucket("decode", B=n)["B"]
        host = {key: x.numpy() for key, x in self._in_host.items()}  # filled in place: no allocation per round
        host["active"][:] = False
        host["active"][:n] = [s is not None for s in slots]
        filters = [False, False]
        for i, s in enumerate(slots):
            if s is None or s.params.greedy:
                continue
            # the host loop's order: the head's draft noise, gamma acceptance uniforms, the bonus's
            if self.head is not None:
                host["noise"][i] = s.rng.random(self.proposed, dtype=np.float32)
            host["u"][i, :self.gamma] = s.rng.random(self.gamma)
            host["v"][i] = s.rng.random()
            filters[0] |= s.params.top_k > 0
            filters[1] |= s.params.top_p < 1.0
        sampled = any(s is not None and not s.params.greedy for s in slots)
        if self.ngram:
            host["drafts"][:], host["counts"][:] = 0, 0
            host["drafts"][:n, :self.gamma], host["counts"][:n] = lookups.tokens[:n, :self.gamma], lookups.counts[:n]
        for key, x in self._in.items():
            x.copy_(self._in_host[key], non_blocking=True)
        key = (b, sampled, *filters)
        if key not in self._rounds:
            self._rounds[key] = self._graphed(b, sampled, tuple(filters))
        with torch.inference_mode():
            self._rounds[key]()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the round's one synchronisation
        self.syncs += 1
        h = {k: v[:n].numpy() for k, v in self._host.items()}
        return RoundResult(h["accepted"], h["tokens"], h["lengths"], h["drafts"], h.get("confidence"))

    def _graphed(self, b: int, sampled: bool, filters: tuple[bool, bool]) -> GraphedCall:
        fn = self._round_fn(b, sampled, filters)
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

    def _round_fn(self, b: int, sampled: bool, filters: tuple[bool, bool]):
        """The round over slots [0, b) as a function of static tensors only (what a CUDA graph captures): the
        host loop's steps (runtime/steps.py), call contracts (runtime/calls) and acceptance rules, on the device.
        `sampled`: some slot samples (its rejection sampling runs beside the greedy match); `filters`: whether any
        uses top-k / top-p."""
        g, t = self.gamma, self.gamma + 1
        target, head = self.target, self.head
        tb = target.spec.bucket("verify", B=b, T=t, P=b * t) if g else target.spec.bucket("decode", B=b)
        tin = target.module_inputs(0, tb)
        rows = torch.arange(b * t, device=self.device)  # the dense grid: the torch modules compute all of it
        length, anchor, budget = self.length[:b], self.anchor[:b], self.budget[:b]
        x = {key: v[:b] for key, v in self._in.items()}
        active = x["active"]
        out, host = {k: v[:b] for k, v in self._out.items()}, {k: v[:b] for k, v in self._host.items()}
        temperature, top_k, top_p = self.temperature[:b], self.top_k[:b], self.top_p[:b]
        if head is not None:
            hb = head.spec.bucket("propose", B=b, C=t)
            hin = head.module_inputs(0, hb)
            calls.head.settings(hin, threshold=self.threshold if self.truncate else 0.0)
            ctx = calls.ContextRows(self.ctx_features[:b], self.ctx_next[:b], self.ctx_pos[:b], self.ctx_rows[:b])
            fill = self.drafter.calls.propose

        def fn() -> dict[str, Tensor]:
            q = None
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
                planned = d[io.VERIFY_LENGTHS] if self.truncate else torch.full_like(length, g)
                counts = torch.full_like(length, self.proposed)
                if "confidence" in out:
                    out["confidence"].copy_(d[io.CONFIDENCE_LOGITS])
                if sampled:
                    q = self._full_vocabulary(d[io.DRAFT_PROBS][:, :g])
            elif self.ngram:
                proposed = x["drafts"]
                planned = counts = x["counts"]
            else:
                proposed = x["drafts"][:, :0]
                planned = counts = torch.zeros_like(length)
            drafts = proposed[:, :g]
            lengths = steps.cap(planned, counts, budget, active, g)
            calls.target.grid(tin, anchor, torch.where(active, length, 0), drafts, rows)
            v = target.forward(0, tb, graphed=False)
            logits = v[io.LOGITS]
            accepted, tokens = steps.accept(drafts, steps.best(logits, rows, b, t), lengths)
            if sampled:
                greedy = temperature <= 0
                p = warp(logits.view(b, t, -1), torch.where(greedy, 1.0, temperature)[:, None].expand(b, t),
                         top_k[:, None].expand(b, t), top_p[:, None].expand(b, t), filters=filters)
                a_s, tokens_s = accept_rows(drafts, p, q, None, lengths, x["u"][:, :g], x["v"])
                accepted = torch.where(greedy, accepted, a_s)
                tokens = torch.where(greedy[:, None], tokens, tokens_s)
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

    def _full_vocabulary(self, probs: Tensor) -> Tensor:
        """Draft distributions [b, g, V'] over the whole vocabulary (zero outside a reduced draft vocabulary)."""
        if self.drafter.vocab_ids is None:
            return probs
        full = torch.zeros(*probs.shape[:2], self.target_vocab, dtype=probs.dtype, device=probs.device)
        full[..., self._vocab_ids] = probs
        return full
