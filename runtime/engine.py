"""The generation engine: request slots over one KV cache, chunked prefill, batched decode steps or rounds.

    add_request ─► waiting ─► admit (prefill one slot, chunk by chunk) ─► step (all active slots: one
                                 ▲                                        decode step or one draft/verify
                                 │                                        round) ─► tokens, stop checks
                                 └────── a finished or aborted slot is refilled ◄──┘

Slots are rows of one preallocated cache; a step runs on slots [0, n) rounded up to a bucket, so
finished slots are refilled with waiting requests (continuous batching) without moving any cache memory.
`step()` is the online API (servers add and abort requests between steps); `generate()` is built on it.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime import calls
from specrt.runtime.backends import load_runner
from specrt.runtime.config import EngineConfig
from specrt.runtime.costs import CostTable
from specrt.runtime.profile import Profile, load_profile, placement, profile_options
from specrt.runtime.drafters import Context, Proposal, make_drafter
from specrt.runtime.observers import RoundObserver, RoundRecord, TraceWriter
from specrt.runtime.sampling import SamplingParams, next_token
from specrt.runtime.schedulers import Load, make_scheduler
from specrt.runtime.acceptance import Verdict
from specrt.runtime.speculative import Outcome, Speculator
from specrt.runtime.stats import RunStats
from specrt.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from specrt.runtime.device_round import DeviceRounds

TextCallback = Callable[[int, str], None]  # (request id, text delta)
TokenCallback = Callable[[int, int], None]  # (request id, number of new tokens)
FinishCallback = Callable[["RequestOutput"], None]  # a request's output, the moment it finishes

def check_room(manifest: io.Manifest, prompt_tokens: int, max_new_tokens: int, gamma: int) -> None:
    """Reject a request whose prompt, token budget and `gamma` drafts do not fit one slot of the artifact's cache."""
    capacity = manifest.export.max_seq - 1  # the last position absorbs padding writes
    if prompt_tokens + max_new_tokens + gamma > capacity:
        raise SpecrtError(f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds the "
                          f"artifact's {capacity} cache positions (re-export with a larger --max-seq-len)")


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: int = 0
    seed_offset: int | None = None  # the sampler is seeded with params.seed + this (None: + id, distinct per request)


@dataclass
class RequestOutput:
    id: int
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length" | "abort"


@dataclass
class RequestDelta:
    """What one step did for one request: new tokens and text, and its output if it finished."""

    id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: RequestOutput | None = None


@dataclass
class Slot:
    """One active request: the cache holds `length` tokens; `pending` is committed but not yet written."""

    request: Request
    rng: np.random.Generator
    ids: np.ndarray  # prompt + output token ids, preallocated to the cache capacity
    size: int = 0  # valid entries of `ids`
    length: int = 0
    pending: int = -1
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    stream: object | None = None
    finish_reason: str | None = None
    ctx: Context | None = None  # target positions the draft head has not seen yet
    rounds: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def temperature(self) -> float:
        return self.request.params.temperature

    @property
    def budget(self) -> int:
        return self.request.params.max_new_tokens - len(self.output_ids)

    def history(self) -> np.ndarray:
        return self.ids[:self.size]


class Engine:
    """Loads an artifact's graphs on a backend and generates for requests that come and go.

    method "ar" decodes one token per step; "ngram", "mtp" and "dspark" run the lossless draft/verify
    loop of `runtime/speculative.py` with up to `gamma` drafts verified per round, as the scheduler says.
    `slots`: request slots to allocate up front (a server); by default the engine sizes them when idle.
    `device` / `dtype` (torch backend): where and in which precision the modules run ("cuda": CUDA graphs, unless
    `cuda_graphs` is False: eager launches, for comparison). On
    the torch backend every round stays on the device (runtime/device_round.py: `device_rounds`), whatever the
    method, scheduler and sampling; other backends run the host loop (`device_note` says so).
    """

    def __init__(self, art_dir: str | Path, config: EngineConfig | None = None, *, trace: Path | None = None,
                 observers: Sequence[RoundObserver] = (), profile: Profile | None = None, **settings: Any) -> None:
        """`config` (or its fields as keywords: `Engine(art, method="dspark", slots=4)`) says how to run the
        artifact; `trace` writes every round as JSONL; `observers` see every round; `profile`: the cost profile the
        sps schedulers and the hybrids plan on when the artifact stores none for this backend
        (`specrt.tools.profile.profile_for` measures a quick one)."""
        if config is not None and settings:
            raise SpecrtError(f"give an EngineConfig or its fields ({', '.join(settings)}), not both")
        try:
            config = config or EngineConfig(**settings)
        except TypeError as e:  # an unknown keyword
            raise SpecrtError(f"Engine: {e}") from None
        c, method = config, config.parsed
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
        where = {"device": c.device, "dtype": c.dtype}
        if c.backend != "ort":  # torch on CUDA, and TensorRT, capture each call in a CUDA graph
            where["graphs"] = c.cuda_graphs and (c.backend == "tensorrt" or c.device.startswith("cuda"))
        self.target = load_runner(c.backend, self.art_dir, self.manifest, io.TARGET, threads=c.threads, spin=True,
                                  **where)
        self.spec: Speculator | None = None
        self.drafter = None
        self.costs: CostTable | None = None  # what the cost-aware scheduler and the hybrid plan on
        if method.speculative:
            exported = self.manifest.gamma
            if c.gamma is not None and not 1 <= c.gamma <= exported:
                raise SpecrtError(f"--gamma must be between 1 and {exported} (the artifact's verify length - 1), "
                                  f"got {c.gamma}")
            where_costs = placement(c.backend, c.device, c.dtype)  # a GPU's costs are not a CPU's
            costs = self._costs(where_costs, c.threads, profile) if c.plans_on_costs else None
            self.costs = costs
            # under a cost-aware scheduler a head is called only when it promises more than decoding (both paths)
            gated = c.gate_head and c.scheduler in ("sps", "sps-async")
            self.drafter = make_drafter(method, self.art_dir, self.manifest, gamma=c.gamma or exported,
                                        backend=c.backend, threads=c.threads, ngram=c.ngram, costs=costs,
                                        gated=gated, **where)
            g = min(c.gamma or exported, self.drafter.steps)
            head = self.manifest.heads.get(method.head) if method.head else None
            sched = make_scheduler(c.scheduler, gamma=g, temperatures=head.temperatures if head else (),
                                   threshold=c.threshold, costs=costs)
            self.spec = Speculator(self.target, self.drafter, sched, gamma=g)
        self.gamma = self.spec.gamma if self.spec else 0
        self.device_rounds: DeviceRounds | None = None
        self.device_note = "the host loop runs every round on this backend"
        if c.backend == "torch":  # imported here: the ONNX Runtime path never loads torch
            from specrt.runtime.device_round import DeviceRounds

            self.device_note = ""
            self.device_rounds = DeviceRounds(self.target, self.drafter, self.spec.scheduler if self.spec else None,
                                              gamma=self.gamma, threshold=c.threshold, costs=self.costs,
                                              capture=where["graphs"])
        self.observers: list[RoundObserver] = list(observers)
        if trace is not None:
            self.observers.append(TraceWriter(trace))
        self.stats = RunStats(method=c.method, gamma=self.gamma)
        self.slots: list[Slot | None] = []
        self.waiting: deque[Request] = deque()
        self._ids = 0
        self._closed = False
        self._lock = threading.Lock()  # held by the thread inside add_request / step / abort / generate
        self._user: int | None = None  # that thread (it may call in again: generate's callbacks, generate -> step)
        self._fixed_slots = c.slots is not None
        # False inside a generate() without on_text: nobody reads a step's text, so a request without stop strings
        # is detokenized once, when it finishes (`_output`), not token by token (two tokenizer calls per token)
        self._text_deltas = True
        if c.slots is not None:
            self._allocate(min(c.slots, self.max_batch))

    def _costs(self, backend: str, threads: int | None, profile: Profile | None) -> CostTable:
        """The artifact's stored profile for this backend (its `placement`), or the one given; either is refined
        online by the rounds this engine times (runtime/costs.py)."""
        stored = load_profile(self.art_dir, backend=backend, threads=threads)
        if stored is not None:
            return CostTable(stored, f"artifact profile {stored.backend}/{stored.threads}")
        if profile is None:
            raise SpecrtError(f"--scheduler {self.scheduler_name} / --method {self.method} plan on a cost profile and "
                              f"{self.art_dir} has none for {backend}: run `specrt profile {self.art_dir}"
                              f"{profile_options(backend)}` once (or pass Engine(..., profile=...))")
        return CostTable(profile, f"profile measured {profile.created}")

    # -- the online API ---------------------------------------------------------------------------

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One thread at a time drives the engine; a second one gets a clear error instead of corrupting the
        slots and queue half-way through a round."""
        if self._closed:
            raise SpecrtError("this engine is closed")
        me = threading.get_ident()
        if self._user == me:
            yield
            return
        if not self._lock.acquire(blocking=False):
            raise SpecrtError("this Engine is in use by another thread: an Engine is driven by one thread at a time; "
                              "to serve requests from several threads, share it through "
                              "specrt.serve.loop.EngineLoop (submit and abort are thread-safe)")
        self._user = me
        try:
            yield
        finally:
            self._user = None
            self._lock.release()

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: int | None = None, raw: bool = False, seed_offset: int | None = None) -> int:
        """Queue a request (token ids, or text: the chat template is applied unless `raw`); returns its id.
        A seeded request samples with seed + `seed_offset` (default: + its id)."""
        with self._exclusive():
            return self._add_request(prompt, params, request_id=request_id, raw=raw, seed_offset=seed_offset)

    def _add_request(self, prompt: str | Sequence[int], params: SamplingParams | None, *, request_id: int | None,
                     raw: bool, seed_offset: int | None) -> int:
        if isinstance(prompt, str):
            from specrt.runtime.prompts import encode_prompt

            ids = encode_prompt(self.tokenizer, prompt, raw=raw)
        else:
            ids = [int(t) for t in prompt]
        rid = self._ids if request_id is None else request_id
        if rid in self._unfinished_ids():
            raise SpecrtError(f"request id {rid} is already in use")
        request = Request(prompt_ids=ids, params=params or SamplingParams(), id=rid, seed_offset=seed_offset)
        self.check(request)
        self._ids = max(self._ids, rid + 1)
        self.waiting.append(request)
        self.stats.requests += 1
        return rid

    def step(self) -> list[RequestDelta]:
        """Admit waiting requests into free slots (prefill), then one decode step or round over all
        active slots. Returns what happened to each request touched, finished ones with their output."""
        with self._exclusive():
            return self._step()

    def _step(self) -> list[RequestDelta]:
        deltas: dict[int, RequestDelta] = {}
        self._admit(deltas)
        if any(self.slots):
            t0 = time.perf_counter()
            if self.device_rounds is not None:
                self._device_round(deltas)
            elif self.spec:
                self._round(deltas)
            else:
                self._decode(deltas)
            self.stats.decode_s += time.perf_counter() - t0
            for i in range(len(self.slots)):
                self._retire(i, deltas)
        return list(deltas.values())

    def abort(self, request_id: int) -> RequestOutput | None:
        """Drop a request now (its slot is free for the next step); None if it is not unfinished."""
        with self._exclusive():
            return self._abort(request_id)

    def _abort(self, request_id: int) -> RequestOutput | None:
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                return RequestOutput(id=r.id, prompt_tokens=len(r.prompt_ids), output_ids=[], text="",
                                     finish_reason="abort")
        for i, s in enumerate(self.slots):
            if s is not None and s.request.id == request_id:
                self.slots[i] = None
                return self._output(s, "abort")
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(self.slots)

    def generate(self, requests: Sequence[Request], *, on_text: TextCallback | None = None,
                 on_token: TokenCallback | None = None, on_finish: FinishCallback | None = None
                 ) -> tuple[list[RequestOutput], RunStats]:
        """Generate for all requests (up to B at a time) and return their outputs and this run's stats."""
        with self._exclusive():
            return self._generate(requests, on_text=on_text, on_token=on_token, on_finish=on_finish)

    def _generate(self, requests: Sequence[Request], *, on_text: TextCallback | None,
                  on_token: TokenCallback | None, on_finish: FinishCallback | None
                  ) -> tuple[list[RequestOutput], RunStats]:
        if len({r.id for r in requests}) != len(requests):  # outputs and callbacks are keyed by id
            raise SpecrtError("request ids must be unique within one generate() call")
        if self.has_unfinished():
            raise SpecrtError("generate() needs an idle engine; finish or abort the pending requests first")
        for r in requests:
            self.check(r)
        self.stats = RunStats(method=self.method, gamma=self.gamma)
        for r in requests:
            self.add_request(r.prompt_ids, r.params, request_id=r.id, seed_offset=r.seed_offset)
        done: dict[int, RequestOutput] = {}
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
        if self._closed:
            return
        with self._exclusive():
            self._closed = True
            for o in self.observers:
                o.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- slots --------------------------------------------------------------------------------------

    def _unfinished_ids(self) -> set[int]:
        return {r.id for r in self.waiting} | {s.request.id for s in self.slots if s is not None}

    def _allocate(self, n: int) -> None:
        n = next(b for b in io.batch_sizes(self.max_batch) if b >= n)
        io.check_memory(n * (self.capacity + 1) * 8, f"token ids for {n} slots x {self.capacity + 1} positions")
        self.target.allocate(n)
        if self.drafter:
            self.drafter.allocate(n)
        if self.device_rounds is not None:
            self.device_rounds.allocate(n)
        self.slots = [None] * n

    def _admit(self, deltas: dict[int, RequestDelta]) -> None:
        if not self.waiting:
            return
        if not self._fixed_slots and not any(self.slots) and len(self.slots) < min(len(self.waiting), self.max_batch):
            self._allocate(min(len(self.waiting), self.max_batch))  # idle: size the cache to the queue
        for i in range(len(self.slots)):
            if self.slots[i] is None and self.waiting:
                self.slots[i] = self._prefill(i, self.waiting.popleft(), deltas)
                self._retire(i, deltas)

    def _prefill(self, index: int, request: Request, deltas: dict[int, RequestDelta]) -> Slot:
        """Prefill `request` into slot `index` in chunks and sample its first token."""
        t0 = time.perf_counter()
        seed = request.params.seed
        offset = request.id if request.seed_offset is None else request.seed_offset
        slot = Slot(request=request, rng=np.random.default_rng(None if seed is None else seed + offset),
                    ids=np.zeros(self.capacity + 1, np.int64))
        if self.tokenizer and (self._text_deltas or request.params.stop_strings):  # stop strings: found as text grows
            slot.stream = self.tokenizer.stream_decoder(skip_special_tokens=True)
        ids = request.prompt_ids
        slot.ids[:len(ids)], slot.size = ids, len(ids)
        keep = self.drafter is not None and self.drafter.needs_features
        features = []
        out = None
        for piece, out in calls.target.run_prefill(self.target, index, np.asarray(ids, np.int64)):
            if keep:
                features.append(out[io.FEATURES][0, :len(piece)].copy())
        slot.length = len(ids)
        self._emit(slot, [next_token(out[io.LOGITS][0], request.params, slot.rng)], deltas)
        if self.drafter is not None and slot.finish_reason is None:
            ctx = Context(pos=0, features=np.concatenate(features) if keep else np.zeros((len(ids), 0), np.float32),
                          next_tokens=np.asarray([*ids[1:], slot.pending], np.int64))
            slot.ctx = self.drafter.prefill(index, ctx)
        if self.device_rounds is not None and slot.finish_reason is None:
            self.device_rounds.upload(index, slot.length, slot.pending, slot.budget, slot.ctx, request.params)
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.generated_tokens += 1
        return slot

    def _decode(self, deltas: dict[int, RequestDelta]) -> None:
        """One decode step over slots [0, n): write each pending token, sample the next."""
        n = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        bucket = self.target.spec.bucket("decode", B=n)
        anchor, start = calls.target.anchors(self.slots[:n], bucket["B"])
        calls.target.grid(self.target.inputs(0, bucket), anchor, start, None, calls.target.dense_rows(bucket))
        logits = self.target.run(0, bucket)[io.LOGITS]
        self.stats.steps += 1
        for i, s in enumerate(self.slots[:n]):
            if s is not None:
                s.length += 1
                self._emit(s, [next_token(logits[i], s.params, s.rng)], deltas)
                self.stats.generated_tokens += 1
                self.stats.decode_tokens += 1

    def _round(self, deltas: dict[int, RequestDelta]) -> None:
        """One draft/verify round over slots [0, n); commit each slot's accepted drafts and bonus."""
        n = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        live = self.slots[:n]
        load = Load(active=sum(s is not None for s in live), slots=len(self.slots), waiting=len(self.waiting))
        rnd = self.spec.round(live, load)
        if self.costs is not None:
            self.costs.observe_verify(n, rnd.verified, rnd.call_s * 1e3)
            if rnd.proposal.head and not rnd.proposal.catch_up:
                self.costs.observe_draft(rnd.proposal.head, n, rnd.draft_s * 1e3)
        self.stats.steps += 1
        self.stats.draft_s += rnd.draft_s
        self.stats.verify_s += rnd.verify_s
        for i, s in enumerate(live):
            if s is not None:
                self._commit(s, rnd.outcomes[i], rnd.proposal, i, deltas)

    def _device_round(self, deltas: dict[int, RequestDelta]) -> None:
        """One decode step or draft/verify round on the device (one host synchronisation); commit on the host."""
        rounds = self.device_rounds
        n = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        live = self.slots[:n]
        t0 = time.perf_counter()
        res = rounds.round(n, live)
        self.stats.steps += 1
        self.stats.verify_s += time.perf_counter() - t0
        if not self.spec:  # AR: one token per slot
            for i, s in enumerate(live):
                if s is not None:
                    s.length += 1
                    self._emit(s, [int(res.tokens[i, 0])], deltas)
                    self.stats.generated_tokens += 1
                    self.stats.decode_tokens += 1
            return
        proposal = Proposal(tokens=res.drafts, counts=res.counts, probs=None, confidence_logits=res.confidence)
        for i, s in enumerate(live):
            if s is None:
                continue
            a, ell = int(res.accepted[i]), int(res.lengths[i])
            tokens = res.tokens[i, :a + 1].tolist()
            self.spec.scheduler.observe(ell, a)
            self.drafter.observe(i, ell, a)
            s.ctx = None  # the pending context rows are on the device
            self._commit(s, Outcome(ell, Verdict(a, tokens[-1]), tokens, None), proposal, i, deltas)

    def _commit(self, s: Slot, o: Outcome, proposal, row: int, deltas: dict[int, RequestDelta]) -> None:
        position = s.length
        committed = self._emit(s, o.tokens, deltas)
        a = o.verdict.accepted
        if s.finish_reason is None:
            s.length += a + 1
            if o.features is not None:
                s.ctx = Context(pos=position, features=o.features.copy(), next_tokens=np.asarray(o.tokens, np.int64))
        else:
            s.length += committed
        self.stats.rounds.append((o.verify_len, a, committed))
        self.stats.generated_tokens += committed
        self.stats.decode_tokens += committed
        if self.observers:
            conf = proposal.confidence_logits
            record = RoundRecord(request=s.request.id, round=s.rounds, position=position,
                                 draft_tokens=proposal.tokens[row, :proposal.counts[row]].tolist(),
                                 confidence_logits=conf[row].tolist() if conf is not None else None,
                                 verify_len=o.verify_len, accepted=a, committed=committed)
            for obs in self.observers:
                obs.on_round(record)
        s.rounds += 1

    def _emit(self, slot: Slot, tokens: list[int], deltas: dict[int, RequestDelta]) -> int:
        """Append tokens until the request finishes (EOS, stop string or token, length); returns how many."""
        params = slot.params
        delta = deltas.setdefault(slot.request.id, RequestDelta(slot.request.id))
        emitted = 0
        for token in tokens:
            slot.output_ids.append(token)
            slot.ids[slot.size] = token
            slot.size += 1
            slot.pending = token
            delta.token_ids.append(token)
            emitted += 1
            if slot.stream is not None:
                text = slot.stream.push([token])
                if text:
                    before = len(slot.text)
                    slot.text += text
                    for stop in params.stop_strings:
                        cut = slot.text.find(stop, max(0, before - len(stop) + 1))
                        if cut >= 0:
                            slot.text = slot.text[:cut]
                            slot.finish_reason = "stop"
                            break
                    delta.text += slot.text[before:]
            if slot.finish_reason:
                break
            if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
                slot.finish_reason = "eos"
            elif len(slot.output_ids) >= params.max_new_tokens:
                slot.finish_reason = "length"
            if slot.finish_reason:
                break
        return emitted

    def _output(self, s: Slot, reason: str) -> RequestOutput:
        if s.stream is not None and reason not in ("stop", "abort"):
            s.text += s.stream.flush()
        elif s.stream is None and self.tokenizer:  # detokenized once (`_text_deltas`): what the deltas add up to
            s.text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
            if reason == "abort":  # as a stream stops: without a character still partial
                s.text = s.text.rstrip("\ufffd")
        return RequestOutput(id=s.request.id, prompt_tokens=len(s.request.prompt_ids), output_ids=s.output_ids,
                             text=s.text, finish_reason=reason)

    def _retire(self, i: int, deltas: dict[int, RequestDelta]) -> None:
        s = self.slots[i]
        if s is None or s.finish_reason is None:
            return
        before = len(s.text)
        out = self._output(s, s.finish_reason)
        delta = deltas.setdefault(s.request.id, RequestDelta(s.request.id))
        delta.text += out.text[before:]  # the detokenizer's flushed tail
        delta.finished = out
        self.slots[i] = None
