"""The torch backend's executor calls of the round (runtime/round.py), on the device's tensors: one round variant over
slots [0, b) as a call on static tensors only, which runtime/device_round.py captures in a CUDA graph.

    draft     the head's modules on the context rows the previous rounds left on the device; a drafter that picks
              keeps, per slot, the host's lookups or the head's block, whichever survives better (hybrid.py `pick`)
    verify    the target over the whole dense grid [anchor, d_1..d_γ] of every slot (the torch modules compute it
              anyway, and on a GPU a short verify costs about what a long one does); a round without drafts runs the
              decoding step's bucket
    sample    every slot's rejection sampling at once (acceptance.py `accept_rows`) beside the greedy match
    commit    the verified rows' features become the head's next context rows (a round that skipped the head
              appends them to the slot's backlog), and the slots' lengths, budgets and anchors advance
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specrt import artifact as io
from specrt.runtime import calls, steps
from specrt.runtime.acceptance import accept_rows
from specrt.runtime.hybrid import pick
from specrt.runtime.round import Drafted, Plan, RoundState, Verified, run
from specrt.runtime.sampling import warp

if TYPE_CHECKING:
    from specrt.runtime.device_round import DeviceRounds


class TorchRound:
    """One round variant over slots [0, b) as a call on static tensors only (what a CUDA graph captures): the round of
    runtime/round.py with this executor's calls. `plan.sampled`: some slot samples (its rejection sampling runs beside
    the greedy match); `plan.filters`: whether any uses top-k / top-p; `plan.head`: the head drafts (else the host's
    lookups are the proposal); `plan.drafting`: some slot has drafts (else the target runs its decoding bucket)."""

    def __init__(self, device: DeviceRounds, b: int, plan: Plan) -> None:
        r = self.r = device
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
        res = run(self, self.state)
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

    def verify(self, state: RoundState, drafts: Tensor, lengths: Tensor, parents: None) -> Verified:
        """Chains only: no device drafter proposes a tree."""
        drafts = drafts[:, :self.tt - 1]
        calls.target.grid(self.tin, state.anchor, torch.where(state.active, state.length, 0), drafts, self.grid)
        v = self.r.target.forward(0, self.tb, graphed=False)
        logits = v[io.LOGITS]
        return Verified(steps.best(logits, self.grid, self.b, self.tt), drafts, logits, v.get(io.FEATURES))

    def sample(self, state: RoundState, drafted: Drafted | None, verified: Verified, lengths: Tensor,
               accepted: Tensor, tokens: Tensor, cells: None) -> tuple[Tensor, Tensor, None]:
        r, b, tt = self.r, self.b, self.tt
        temperature = r.temperature[:b]
        greedy = temperature <= 0
        p = warp(verified.logits.view(b, tt, -1), torch.where(greedy, 1.0, temperature)[:, None].expand(b, tt),
                 r.top_k[:b, None].expand(b, tt), r.top_p[:b, None].expand(b, tt), filters=self.filters)
        q = self._q if drafted is not None else None
        a_s, tokens_s = accept_rows(verified.drafts, p, q, self._onehot, lengths, self.x["u"][:, :tt - 1],
                                    self.x["v"])
        return torch.where(greedy, accepted, a_s), torch.where(greedy[:, None], tokens, tokens_s), None

    def commit(self, state: RoundState, verified: Verified, accepted: Tensor, tokens: Tensor, bonus: Tensor,
               cells: None) -> None:
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
