"""The generation engine: request slots over one KV cache, chunked prefill, batched decode steps.

    requests ─► admit (prefill one slot, chunk by chunk) ─► step (all active slots, one target call)
                   ▲                                           │ sample, append, check stop
                   └──────────── a finished slot is refilled ◄─┘

Slots are rows of one preallocated cache; a step runs on slots [0, n) so finished slots are
refilled with waiting requests (continuous batching) without moving any cache memory.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.backends.base import StepInputs
from specrt.runtime.drafters import DRAFTERS, Context
from specrt.runtime.sampling import SamplingParams, next_token
from specrt.runtime.tokenizer import Tokenizer

TextCallback = Callable[[int, str], None]  # (request id, text delta)
TokenCallback = Callable[[int, int], None]  # (request id, number of new tokens)
FinishCallback = Callable[["RequestOutput"], None]  # a request's output, the moment it finishes


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: int = 0


@dataclass
class RequestOutput:
    id: int
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length"


@dataclass
class RunStats:
    method: str = "ar"
    requests: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens produced by decode steps (the first token comes from prefill)
    steps: int = 0  # target calls after prefill (decode steps or verify rounds)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    gamma: int = 0
    rounds: list[tuple[int, int, int]] = field(default_factory=list)  # (verify_len, accepted, committed)

    def acceptance(self) -> dict[str, list[float]]:
        """Per draft position k: P(accepted) over rounds that verified k, and P(accepted | k-1 accepted)."""
        uncond, cond = [], []
        for k in range(1, self.gamma + 1):
            tried = [a for ell, a, _ in self.rounds if ell >= k]
            reached = [a for a in tried if a >= k - 1]
            uncond.append(round(sum(a >= k for a in tried) / len(tried), 4) if tried else 0.0)
            cond.append(round(sum(a >= k for a in reached) / len(reached), 4) if reached else 0.0)
        return {"unconditional": uncond, "conditional": cond}

    def to_dict(self) -> dict:
        d = {"method": self.method, "requests": self.requests, "generated_tokens": self.generated_tokens,
             "steps": self.steps, "prefill_ms": round(self.prefill_s * 1e3, 3),
             "decode_s": round(self.decode_s, 4),
             "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 3) if self.decode_s else 0.0,
             "end_to_end_tokens_per_s": round(self.generated_tokens / (self.prefill_s + self.decode_s), 3)
             if self.prefill_s + self.decode_s else 0.0}
        if self.method != "ar":
            n = len(self.rounds)
            d.update(gamma=self.gamma, rounds=n,
                     tau=round(sum(c for _, _, c in self.rounds) / n, 4) if n else 0.0,
                     per_position_acceptance=self.acceptance(),
                     draft_s=round(self.draft_s, 4), verify_s=round(self.verify_s, 4),
                     other_s=round(self.decode_s - self.draft_s - self.verify_s, 4))
        return d


@dataclass
class _Slot:
    """One active request: the cache holds `length` tokens; `pending` is sampled but not yet written."""

    request: Request
    rng: np.random.Generator
    length: int = 0
    pending: int = -1
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    stream: object | None = None
    finish_reason: str | None = None
    ctx: Context | None = None  # target positions the draft head has not seen yet
    rounds: int = 0

    @property
    def temperature(self) -> float:
        return self.request.params.temperature


METHODS = ("ar", "mtp", "dspark")


class Engine:
    """Loads an artifact's target (and draft) graphs on a backend and generates for batches of requests.

    method "ar" decodes one token per step; "mtp" and "dspark" run the lossless draft/verify loop of
    `runtime/speculative.py` with up to `gamma` drafts verified per round.
    """

    def __init__(self, art_dir: str | Path, *, method: str = "ar", gamma: int | None = None,
                 threads: int | None = None, trace: Path | None = None) -> None:
        from specrt.runtime.backends.ort import OrtRunner
        from specrt.runtime.speculative import Speculator

        self.art_dir = Path(art_dir)
        self.manifest = io.load_manifest(self.art_dir)
        self.settings = self.manifest.export
        self.vocab_size = int(self.manifest.model["vocab_size"])
        self.eos_ids = set(self.manifest.model.get("eos_token_ids") or ())
        if self.manifest.tokenizer:
            self.eos_ids |= set(self.manifest.tokenizer.get("eos_token_ids") or ())
        self.tokenizer = (Tokenizer.from_dir(self.art_dir / io.TOKENIZER_DIR, self.manifest.tokenizer)
                          if self.manifest.tokenizer else None)
        if method not in METHODS:
            raise SpecrtError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        if method != "ar" and method not in self.manifest.heads:
            have = ", ".join(self.manifest.heads) or "none"
            raise SpecrtError(f"--method {method} needs an artifact exported with a {method} head "
                              f"(this one has: {have}); export with --draft or --mtp")
        self.method = method
        # Target and draft sessions run in turn: neither may keep its threads spinning when idle.
        self.target = OrtRunner(self.art_dir, self.manifest.graphs["prefill"], threads=threads,
                                spin=True)
        self.drafter = DRAFTERS[method](self.art_dir, self.manifest, threads=threads) if method != "ar" else None
        self.spec = Speculator(self, gamma=gamma, trace=trace) if self.drafter else None
        self.max_batch = self.settings.batch
        self.chunk = self.settings.prefill_chunk
        # The last cache position receives writes from padding tokens; valid tokens stay below it.
        self.capacity = self.settings.max_seq - 1

    # -- requests ---------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Reject a request the artifact cannot serve, with a one-line reason."""
        n = len(request.prompt_ids)
        if n == 0:
            raise SpecrtError("empty prompt")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise SpecrtError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if n + request.params.max_new_tokens + (self.spec.gamma if self.spec else 0) > self.capacity:
            raise SpecrtError(f"prompt of {n} tokens + max_new_tokens {request.params.max_new_tokens} exceeds "
                              f"the artifact's {self.capacity} cache positions (re-export with a larger "
                              f"--max-seq-len)")

    def generate(self, requests: Sequence[Request], *, on_text: TextCallback | None = None,
                 on_token: TokenCallback | None = None, on_finish: FinishCallback | None = None
                 ) -> tuple[list[RequestOutput], RunStats]:
        """Generate for all requests, up to B at a time; `on_text(id, delta)` streams text."""
        if len({r.id for r in requests}) != len(requests):  # outputs and callbacks are keyed by id
            raise SpecrtError("request ids must be unique within one generate() call")
        for r in requests:
            self.check(r)
        stats = RunStats(method=self.method, requests=len(requests), gamma=self.spec.gamma if self.spec else 0)
        waiting = deque(requests)
        n_slots = min(self.max_batch, len(requests))
        self.target.allocate(n_slots)
        if self.drafter:
            self.drafter.allocate(n_slots)
        slots: list[_Slot | None] = [None] * n_slots
        done: dict[int, RequestOutput] = {}
        while waiting or any(slots):
            for i in range(n_slots):
                if slots[i] is None and waiting:
                    slots[i] = self._admit(i, waiting.popleft(), stats, on_text, on_token)
                    self._retire(slots, i, done, on_finish)
            if any(slots):
                t0 = time.perf_counter()
                if self.spec:
                    self.spec.round(slots, stats, on_text, on_token)
                else:
                    self._step(slots, stats, on_text, on_token)
                stats.decode_s += time.perf_counter() - t0
                for i in range(n_slots):
                    self._retire(slots, i, done, on_finish)
        return [done[r.id] for r in requests], stats

    # -- the loop -------------------------------------------------------------------------------

    def _admit(self, index: int, request: Request, stats: RunStats, on_text: TextCallback | None,
               on_token: TokenCallback | None) -> _Slot:
        """Prefill `request` into slot `index` in chunks and sample its first token."""
        t0 = time.perf_counter()
        seed = request.params.seed
        slot = _Slot(request=request, rng=np.random.default_rng(None if seed is None else seed + request.id))
        if self.tokenizer:
            slot.stream = self.tokenizer.stream_decoder(skip_special_tokens=True)
        ids = request.prompt_ids
        c = self.chunk
        logits = None
        features = [] if self.drafter else None
        for start in range(0, len(ids), c):
            piece = ids[start:start + c]
            chunk = np.zeros((1, c), np.int64)
            chunk[0, :len(piece)] = piece
            out = self.target.run(index, StepInputs(
                input_ids=chunk, position_ids=np.arange(start, start + c, dtype=np.int64)[None],
                write_index=np.array([start], np.int64), logit_rows=np.array([[len(piece) - 1]], np.int64)).feeds())
            logits = out[io.LOGITS][0, 0]
            if features is not None:
                features.append(out[io.FEATURES][0, :len(piece)].copy())
        slot.length = len(ids)
        self._append(slot, next_token(logits, request.params, slot.rng), on_text)
        if self.drafter and slot.finish_reason is None:
            ctx = Context(pos=0, features=np.concatenate(features),
                          next_tokens=np.asarray([*ids[1:], slot.pending], np.int64))
            slot.ctx = self.drafter.prefill(index, ctx)
        stats.prefill_s += time.perf_counter() - t0
        stats.generated_tokens += 1
        if on_token:
            on_token(request.id, 1)
        return slot

    def _step(self, slots: list[_Slot | None], stats: RunStats, on_text: TextCallback | None,
              on_token: TokenCallback | None) -> None:
        """One decode step over slots [0, n): write each pending token, sample the next."""
        n = max(i for i, s in enumerate(slots) if s is not None) + 1
        feeds = self.target.inputs(0, B=n, T=1, R=1)  # bound buffers: filled in place
        ids, pos = feeds[io.INPUT_IDS], feeds[io.POSITION_IDS]
        for i, s in enumerate(slots[:n]):  # idle slots write a dummy token at position 0 of their row
            ids[i, 0], pos[i, 0] = (s.pending, s.length) if s is not None else (0, 0)
        feeds[io.WRITE_INDEX][:] = pos[:, 0]
        feeds[io.LOGIT_ROWS][:] = 0
        logits = self.target.run_bound(0, B=n, T=1, R=1)[io.LOGITS]
        stats.steps += 1
        for i, s in enumerate(slots[:n]):
            if s is None:
                continue
            s.length += 1
            self._append(s, next_token(logits[i, 0], s.request.params, s.rng), on_text)
            stats.generated_tokens += 1
            stats.decode_tokens += 1
            if on_token:
                on_token(s.request.id, 1)

    def _append(self, slot: _Slot, token: int, on_text: TextCallback | None) -> None:
        """Record a sampled token and decide whether the request is finished."""
        params = slot.request.params
        slot.output_ids.append(token)
        slot.pending = token
        if slot.stream is not None:
            delta = slot.stream.push([token])
            if delta:
                before = len(slot.text)
                slot.text += delta
                for stop in params.stop_strings:
                    cut = slot.text.find(stop, max(0, before - len(stop) + 1))
                    if cut >= 0:
                        slot.text = slot.text[:cut]
                        delta = slot.text[before:]
                        slot.finish_reason = "stop"
                        break
                if on_text and delta:
                    on_text(slot.request.id, delta)
        if slot.finish_reason:
            return
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            slot.finish_reason = "eos"
        elif len(slot.output_ids) >= params.max_new_tokens:
            slot.finish_reason = "length"

    def _retire(self, slots: list[_Slot | None], i: int, done: dict[int, RequestOutput],
                on_finish: FinishCallback | None) -> None:
        s = slots[i]
        if s is None or s.finish_reason is None:
            return
        if s.stream is not None and s.finish_reason != "stop":
            s.text += s.stream.flush()
        done[s.request.id] = RequestOutput(id=s.request.id, prompt_tokens=len(s.request.prompt_ids),
                                           output_ids=s.output_ids, text=s.text, finish_reason=s.finish_reason)
        slots[i] = None
        if on_finish:
            on_finish(done[s.request.id])
