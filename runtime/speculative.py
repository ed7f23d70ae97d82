"""The lossless draft/verify round: propose, schedule, verify, accept, commit.

    slot: cache holds positions 0..L-1; `pending` (the anchor) is the token at position L
    propose   draft head writes the slot's pending context rows, drafts d_1..d_K from the anchor
    schedule  verify length l per slot (here: gamma, capped by the request's remaining budget)
    verify    one target call over [anchor, d_1..d_l] at positions L..L+l (logits for every row)
    accept    greedy prefix match or rejection sampling -> a accepted drafts + one bonus token
    commit    L += a + 1 (rejected drafts' K/V stay beyond L and are overwritten later: rollback is
              free); the verified rows L..L+a become the draft's next context rows
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.acceptance import Verdict, accept_greedy, accept_sampled
from specrt.runtime.drafters import Context, Proposal

if TYPE_CHECKING:
    from specrt.runtime.engine import Engine, RunStats, TextCallback, TokenCallback, _Slot


class Speculator:
    """Runs speculative rounds for the engine's active slots."""

    def __init__(self, engine: "Engine", *, gamma: int | None, trace: Path | None) -> None:
        self.engine = engine
        exported = min(engine.manifest.gamma, engine.drafter.steps)
        if gamma is not None and not 1 <= gamma <= exported:
            raise SpecrtError(f"--gamma must be between 1 and {exported} (the artifact's draft length), got {gamma}")
        self.gamma = gamma or exported
        self.trace = open(trace, "w") if trace else None

    def round(self, slots: list["_Slot | None"], stats: "RunStats", on_text: "TextCallback | None",
              on_token: "TokenCallback | None") -> None:
        n = max(i for i, s in enumerate(slots) if s is not None) + 1
        live = slots[:n]
        t0 = time.perf_counter()
        proposal = self.engine.drafter.propose(live)
        t1 = time.perf_counter()
        lengths = self.schedule(live)
        logits, features = self.verify(live, proposal, lengths)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.steps += 1
        for i, s in enumerate(live):
            if s is None:
                continue
            ell = lengths[i]
            verdict = self.accept(s, proposal.tokens[i, :ell], proposal.probs[i, :ell], logits[i, :ell + 1])
            committed = self.commit(s, verdict, proposal.tokens[i], features[i], on_text)
            stats.rounds.append((ell, verdict.accepted, committed))
            stats.generated_tokens += committed
            stats.decode_tokens += committed
            if on_token:
                on_token(s.request.id, committed)
            if self.trace:
                conf = proposal.confidence_logits
                self.trace.write(json.dumps({
                    "request": s.request.id, "round": s.rounds - 1, "position": s.length - committed,
                    "draft_tokens": proposal.tokens[i].tolist(),
                    "confidence_logits": conf[i].tolist() if conf is not None else None,
                    "verify_len": ell, "accepted": verdict.accepted, "committed": committed}) + "\n")
                self.trace.flush()

    def schedule(self, slots: list["_Slot | None"]) -> list[int]:
        """Drafts to verify per slot: gamma, but none past the request's max_new_tokens."""
        lengths = []
        for s in slots:
            if s is None:
                lengths.append(0)
                continue
            budget = s.request.params.max_new_tokens - len(s.output_ids) - 1  # the bonus is always committed
            lengths.append(max(0, min(self.gamma, budget)))
        return lengths

    def verify(self, slots: list["_Slot | None"], proposal: Proposal, lengths: list[int]
               ) -> tuple[np.ndarray, np.ndarray]:
        """One target call over [anchor, drafts] of every slot; logits [n,T,V], features [n,T,F]."""
        n, t = len(slots), max(lengths) + 1
        feeds = self.engine.target.inputs(0, B=n, T=t, R=t)  # bound buffers: filled in place
        ids, start = feeds[io.INPUT_IDS], feeds[io.WRITE_INDEX]
        ids[:] = 0
        for i, s in enumerate(slots):
            start[i] = s.length if s is not None else 0
            if s is not None:
                ids[i, 0] = s.pending
                ids[i, 1:lengths[i] + 1] = proposal.tokens[i, :lengths[i]]
        np.add(start[:, None], np.arange(t), out=feeds[io.POSITION_IDS])
        feeds[io.LOGIT_ROWS][:] = np.arange(t)
        out = self.engine.target.run_bound(0, B=n, T=t, R=t)
        return out[io.LOGITS], out[io.FEATURES]

    @staticmethod
    def accept(slot: "_Slot", drafts: np.ndarray, probs: np.ndarray, logits: np.ndarray) -> Verdict:
        params = slot.request.params
        if params.greedy:
            return accept_greedy(drafts, logits)
        return accept_sampled(drafts, probs, logits, params, slot.rng)

    def commit(self, slot: "_Slot", verdict: Verdict, drafts: np.ndarray, features: np.ndarray,
               on_text: "TextCallback | None") -> int:
        """Append accepted drafts + bonus (stopping at EOS/stop/limit); returns tokens committed."""
        a = verdict.accepted
        tokens = [*drafts[:a].tolist(), verdict.bonus]
        committed = 0
        for tok in tokens:
            self.engine._append(slot, tok, on_text)
            committed += 1
            if slot.finish_reason:
                break
        slot.rounds += 1
        if slot.finish_reason is None:
            slot.ctx = Context(pos=slot.length, features=features[:a + 1].copy(),
                               next_tokens=np.asarray(tokens, np.int64))
            slot.length += a + 1
        else:
            slot.length += committed
        return committed
