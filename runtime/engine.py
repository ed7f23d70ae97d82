"""The generation engine: request slots over one KV cache, chunked prefill, one kind of step.

    add_request ─► waiting ─► admit (prefill a free slot, chunk by chunk) ─► round (every active slot: a
                                 ▲                                           draft/verify round; AR: a round
                                 │                                           without drafts) ─► commit ─► retire
                                 └────── a finished or aborted slot is refilled ◄──────────────────────┘

Slots are rows of one preallocated cache; a step runs on slots [0, n) rounded up to a bucket, so
finished slots are refilled with waiting requests (continuous batching) without moving any cache memory.
The round runs on an executor: the host's (`HostRounds`, runtime/host_round.py: ONNX Runtime, TensorRT) or the
torch backend's device (`DeviceRounds`, runtime/device_round.py); both return each slot's outcome, which the
engine commits to the slot's `Sequence` (runtime/sequence.py: tokens, text, stop checks).
`step()` is the online API (servers add and abort requests between steps); `generate()` is built on it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence as Seq
from pathlib import Path
from typing import Any


from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.config import EngineConfig
from specrt.runtime.driver import OneDriver
from specrt.runtime.model_runner import ModelRunner
from specrt.runtime.observers import RoundObserver, RoundRecord, TraceWriter
from specrt.runtime.profile import Profile
from specrt.runtime.round import Round
from specrt.runtime.sampling import SamplingParams, next_token
from specrt.runtime.schedulers import Load
from specrt.runtime.sequence import Request, RequestDelta, RequestOutput, Sequence
from specrt.runtime.stats import RunStats
from specrt.runtime.tokenizer import Tokenizer

__all__ = ["Engine", "Request", "RequestDelta", "RequestOutput", "Sequence", "check_room"]

TextCallback = Callable[[int, str], None]  # (request id, text delta)
TokenCallback = Callable[[int, int], None]  # (request id, number of new tokens)
FinishCallback = Callable[["RequestOutput"], None]  # a request's output, the moment it finishes

def check_room(manifest: io.Manifest, prompt_tokens: int, max_new_tokens: int, gamma: int) -> None:
    """Reject a request whose prompt, token budget and `gamma` drafts do not fit one slot of the artifact's cache."""
    capacity = manifest.export.max_seq - 1  # the last position absorbs padding writes
    if prompt_tokens + max_new_tokens + gamma > capacity:
        raise SpecrtError(f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds the "
                          f"artifact's {capacity} cache positions (re-export with a larger --max-seq-len)")



class Engine:
    """Loads an artifact's graphs on a backend and generates for requests that come and go.

    method "ar" decodes one token per step (a round without drafts); "ngram", "mtp", "dspark" and the hybrids run the
    lossless draft/verify round of `runtime/host_round.py` with up to `gamma` drafts verified per round, as the
    scheduler says. `slots`: request slots to allocate up front (a server); by default the engine sizes them when
    idle. `device` / `dtype` (torch backend): where and in which precision the modules run ("cuda": CUDA graphs,
    unless `cuda_graphs` is False: eager launches, for comparison). On the torch backend every round stays on the
    device (runtime/device_round.py), whatever the method, scheduler and sampling; other backends run the host's
    rounds (`device_note` says so).
    """

    @classmethod
    def open(cls, art_dir: str | Path, config: EngineConfig | None = None, *, profile: Profile | None = None,
             **kw: Any) -> "Engine":
        """An Engine for `config` (what `specrt run`, `specrt serve` and Triton's model open): where its rounds plan
        on a cost profile and neither the artifact nor `profile` gives one, a quick one is measured first (once per
        process, with a warning; runtime/measure.py `profile_for`). `kw`: the Engine's trace, observers."""
        config = config or EngineConfig()
        if profile is None and config.plans_on_costs:
            from specrt.runtime.measure import profile_for  # loads the graphs a second time: only when needed

            profile = profile_for(art_dir, backend=config.backend, threads=config.threads, device=config.device,
                                  dtype=config.dtype)
        return cls(art_dir, config, profile=profile, **kw)

    def __init__(self, art_dir: str | Path, config: EngineConfig | None = None, *, trace: Path | None = None,
                 observers: Seq[RoundObserver] = (), profile: Profile | None = None, **settings: Any) -> None:
        """`config` (or its fields as keywords: `Engine(art, method="dspark", slots=4)`) says how to run the
        artifact; `trace` writes every round as JSONL; `observers` see every round; `profile`: the cost profile the
        sps schedulers and the hybrids plan on when the artifact stores none for this backend (`Engine.open`
        measures a quick one)."""
        if config is not None and settings:
            raise SpecrtError(f"give an EngineConfig or its fields ({', '.join(settings)}), not both")
        try:
            config = config or EngineConfig(**settings)
        except TypeError as e:  # an unknown keyword
            raise SpecrtError(f"Engine: {e}") from None
        c = config
        self.config = config
        if trace is not None:
            TraceWriter.check(trace)  # before the graphs load
        self.art_dir = Path(art_dir)
        self.manifest = io.load_manifest(self.art_dir)
        self.method, self.backend, self.scheduler_name = c.method, c.backend, c.scheduler
        self.vocab_size = self.manifest.model.vocab_size
        self.eos_ids = self.manifest.eos_ids
        self.tokenizer = (Tokenizer.from_dir(self.art_dir / io.TOKENIZER_DIR, self.manifest.tokenizer)
                          if self.manifest.tokenizer else None)
        self.max_batch = self.manifest.export.batch
        # The last cache position receives writes from padding tokens; valid tokens stay below it.
        self.capacity = self.manifest.export.max_seq - 1
        self.model_runner = ModelRunner.open(self.art_dir, self.manifest, config, profile)
        r = self.model_runner  # what the engine's users and tests read of it:
        self.target, self.drafter, self.scheduler, self.costs, self.gamma = (r.target, r.drafter, r.scheduler,
                                                                              r.costs, r.gamma)
        self.executor, self.device_rounds, self.device_note = r.executor, r.device_rounds, r.device_note
        self._keep_rows = r.keeps_features and r.device_rounds is None  # the host holds each slot's context rows
        self.observers: list[RoundObserver] = list(observers)
        if trace is not None:
            self.observers.append(TraceWriter(trace))
        self.stats = RunStats(method=c.method, gamma=self.gamma)  # the last generate()'s
        self.last_step = RunStats(method=c.method, gamma=self.gamma)  # the last step()'s
        self.slots: list[Sequence | None] = []
        self.waiting: deque[Request] = deque()
        self._ids = 0
        self._exclusive = OneDriver()  # add_request, step, abort, generate, close: one thread at a time
        self._fixed_slots = c.slots is not None
        self._collect: RunStats | None = None  # inside generate(): where each step's stats are summed
        # False inside a generate() without on_text: nobody reads a step's text, so a request without stop strings
        # is detokenized once, when it finishes (`Sequence.output`), not token by token (two tokenizer calls a token)
        self._text_deltas = True
        if c.slots is not None:
            self._allocate(min(c.slots, self.max_batch))

    # -- the online API ---------------------------------------------------------------------------

    def add_request(self, prompt: Request | str | Seq[int], params: SamplingParams | None = None, *,
                    request_id: int | None = None, raw: bool = False, seed_offset: int | None = None) -> int:
        """Queue a request: a `Request` as it is, or a prompt (token ids, or text: the chat template is applied
        unless `raw`) with its parameters; returns its id. A seeded request samples with seed + `seed_offset`
        (default: + its id)."""
        with self._exclusive():
            if isinstance(prompt, Request):
                if params is not None or request_id is not None or raw or seed_offset is not None:
                    raise SpecrtError("add_request(Request) takes no other arguments: they are the Request's fields")
                request = prompt
            else:
                request = self._request(prompt, params, request_id=request_id, raw=raw, seed_offset=seed_offset)
            if request.id in self._unfinished_ids():
                raise SpecrtError(f"request id {request.id} is already in use")
            self.check(request)
            self._ids = max(self._ids, request.id + 1)
            self.waiting.append(request)
            return request.id

    def _request(self, prompt: str | Seq[int], params: SamplingParams | None, *, request_id: int | None,
                 raw: bool, seed_offset: int | None) -> Request:
        if isinstance(prompt, str):
            from specrt.runtime.prompts import encode_prompt

            ids = encode_prompt(self.tokenizer, prompt, raw=raw)
        else:
            ids = [int(t) for t in prompt]
        rid = self._ids if request_id is None else request_id
        return Request(prompt_ids=ids, params=params or SamplingParams(), id=rid, seed_offset=seed_offset)

    def step(self) -> list[RequestDelta]:
        """Admit waiting requests into free slots (prefill), then one round over all active slots (a draft/verify
        round; AR: a decoding step), commit, retire. Returns what happened to each request touched, finished ones
        with their output; `last_step` holds the step's stats."""
        with self._exclusive():
            return self._step()

    def _step(self) -> list[RequestDelta]:
        deltas: dict[int, RequestDelta] = {}
        stats = self.last_step = RunStats(method=self.method, gamma=self.gamma)
        self._admit(deltas, stats)
        if any(self.slots):
            t0 = time.perf_counter()
            n = max(i for i, s in enumerate(self.slots) if s is not None) + 1
            live = self.slots[:n]
            rnd = self.model_runner.run(live, self._load(live))
            self._commit(live, rnd, deltas, stats)
            stats.decode_s += time.perf_counter() - t0
        self._retire(deltas)
        if self._collect is not None:
            self._collect.add(stats)
        return list(deltas.values())

    def abort(self, request_id: int) -> RequestOutput | None:
        """Drop a request now (its slot is free for the next step); None if it is not unfinished."""
        with self._exclusive():
            for r in self.waiting:
                if r.id == request_id:
                    self.waiting.remove(r)
                    return RequestOutput(id=r.id, prompt_tokens=len(r.prompt_ids), output_ids=[], text="",
                                         finish_reason="abort")
            for i, s in enumerate(self.slots):
                if s is not None and s.id == request_id:
                    self.slots[i] = None
                    return s.output("abort")
            return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(self.slots)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return len(self.waiting)

    @property
    def active(self) -> int:
        """Slots holding a request."""
        return sum(s is not None for s in self.slots)

    def generate(self, requests: Seq[Request], *, on_text: TextCallback | None = None,
                 on_token: TokenCallback | None = None, on_finish: FinishCallback | None = None
                 ) -> tuple[list[RequestOutput], RunStats]:
        """Generate for all requests (up to B at a time) and return their outputs and this run's stats."""
        with self._exclusive():
            if len({r.id for r in requests}) != len(requests):  # outputs and callbacks are keyed by id
                raise SpecrtError("request ids must be unique within one generate() call")
            if self.has_unfinished():
                raise SpecrtError("generate() needs an idle engine; finish or abort the pending requests first")
            for r in requests:
                self.check(r)
            for r in requests:
                self.add_request(r)
            done: dict[int, RequestOutput] = {}
            self.stats = self._collect = RunStats(method=self.method, gamma=self.gamma, requests=len(requests))
            self._text_deltas = on_text is not None
            try:
                while self.has_unfinished():
                    for d in self.step():
                        if on_token and d.token_ids:
                            on_token(d.id, len(d.token_ids))
                        if on_text and d.text:
                            on_text(d.id, d.text)
                        if d.finished is not None:
                            done[d.id] = d.finished
                            if on_finish:
                                on_finish(d.finished)
            finally:
                self._text_deltas = True
                self._collect = None
            return [done[r.id] for r in requests], self.stats

    def check(self, request: Request) -> None:
        """Reject a request the artifact cannot serve, with a one-line reason."""
        n = len(request.prompt_ids)
        if n == 0:
            raise SpecrtError("empty prompt")
        bad = [t for t in (*request.prompt_ids, *request.params.stop_token_ids) if not 0 <= t < self.vocab_size]
        if bad:
            raise SpecrtError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        check_room(self.manifest, n, request.params.max_new_tokens, self.gamma)

    def close(self) -> None:
        """Close the observers (trace files); the engine takes no more calls (they raise "engine is closed")."""
        if self._exclusive.closed:
            return
        with self._exclusive():
            self._exclusive.closed = True
            for o in self.observers:
                o.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- admit, commit, retire ----------------------------------------------------------------------

    def _unfinished_ids(self) -> set[int]:
        return {r.id for r in self.waiting} | {s.id for s in self.slots if s is not None}

    def _load(self, live: list[Sequence | None]) -> Load:
        return Load(active=sum(s is not None for s in live), slots=len(self.slots), waiting=len(self.waiting))

    def _allocate(self, n: int) -> None:
        n = next(b for b in io.batch_sizes(self.max_batch) if b >= n)
        io.check_memory(n * (self.capacity + 1) * 8, f"token ids for {n} slots x {self.capacity + 1} positions")
        self.model_runner.allocate(n)
        self.slots = [None] * n

    def _admit(self, deltas: dict[int, RequestDelta], stats: RunStats) -> None:
        if not self.waiting:
            return
        if not self._fixed_slots and not any(self.slots) and len(self.slots) < min(len(self.waiting), self.max_batch):
            self._allocate(min(len(self.waiting), self.max_batch))  # idle: size the cache to the queue
        for i in range(len(self.slots)):
            while self.slots[i] is None and self.waiting:  # a request done at its first token frees the slot
                seq = self._prefill(i, self.waiting.popleft(), deltas, stats)
                if seq.finish_reason is None:
                    self.slots[i] = seq
                else:
                    self._finish(seq, deltas)

    def _prefill(self, index: int, request: Request, deltas: dict[int, RequestDelta], stats: RunStats) -> Sequence:
        """Prefill `request` into slot `index` in chunks and sample its first token."""
        t0 = time.perf_counter()
        seq = Sequence(request, capacity=self.capacity, eos_ids=self.eos_ids, tokenizer=self.tokenizer,
                       stream=self._text_deltas)
        logits, features = self.model_runner.prefill(index, request.prompt_ids)
        seq.length = len(request.prompt_ids)
        seq.append([next_token(logits, request.params, seq.rng)], self._delta(deltas, seq))
        if seq.finish_reason is None:
            self.model_runner.start(index, seq, features)
        stats.prefill_s += time.perf_counter() - t0
        stats.generated_tokens += 1
        return seq

    def _commit(self, live: list[Sequence | None], rnd: Round, deltas: dict[int, RequestDelta],
                stats: RunStats) -> None:
        """Each slot's outcome committed to its sequence (runtime/sequence.py `commit`), counted, and observed."""
        stats.steps += 1
        stats.draft_s += rnd.draft_s
        stats.verify_s += rnd.verify_s
        for i, s in enumerate(live):
            o = rnd.outcomes[i]
            if s is None or o is None:
                continue
            position, a = s.length, o.verdict.accepted
            committed = s.commit(o, self._delta(deltas, s), keep_rows=self._keep_rows)
            stats.rounds.append((o.verify_len, a, committed))
            stats.generated_tokens += committed
            stats.decode_tokens += committed
            if self.observers:
                record = RoundRecord.of(s.id, s.rounds - 1, position, rnd.proposal, i, o.verify_len, a, committed)
                for obs in self.observers:
                    obs.on_round(record)

    @staticmethod
    def _delta(deltas: dict[int, RequestDelta], s: Sequence) -> RequestDelta:
        return deltas.setdefault(s.id, RequestDelta(s.id))

    def _retire(self, deltas: dict[int, RequestDelta]) -> None:
        """Free the slots whose requests finished; their deltas carry the outputs."""
        for i, s in enumerate(self.slots):
            if s is not None and s.finish_reason is not None:
                self._finish(s, deltas)
                self.slots[i] = None

    def _finish(self, s: Sequence, deltas: dict[int, RequestDelta]) -> None:
        before = len(s.text)
        out = s.output(s.finish_reason)
        delta = self._delta(deltas, s)
        delta.text += out.text[before:]  # the detokenizer's flushed tail
        delta.finished = out
