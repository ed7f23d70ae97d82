"""One thread owns the engine: callers submit and abort requests; the thread steps and hands out events.

    submit(prompt_ids, params, on_event) ──► commands ──► loop thread: add_request / abort,
    abort(id) ─────────────────────────────►             engine.step(), one Event per touched request
                                                          ──► on_event(event)  (called on the loop thread)

The HTTP server and the Triton Python model both drive an engine through this class, so neither calls
the engine from more than one thread. `on_event` must be quick and must not block (hand the event to
an asyncio queue, a Triton response sender).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from specrt.errors import SpecrtError
from specrt.runtime.engine import Engine, Request, RequestDelta
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.stats import RunStats

log = logging.getLogger("specrt.serve")


@dataclass
class Event(RequestDelta):
    """What one step did for one request (a `RequestDelta`: new tokens, `drafted[i]` whether token i was an accepted
    draft, ...), or that it failed."""

    error: str | None = None  # the loop failed; the request is over

    @classmethod
    def of(cls, delta: RequestDelta) -> "Event":
        return cls(**{f.name: getattr(delta, f.name) for f in fields(RequestDelta)})


@dataclass
class LoopStats:
    """Running totals the metrics endpoint reads (written by the loop thread only)."""

    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    rounds: int = 0
    committed: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    step_s: float = 0.0
    proposed_at: list[int] = field(default_factory=list)  # per draft position: rounds that verified it
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted it

    @property
    def tau(self) -> float:
        """Tokens committed per round (1.0 for autoregressive decoding)."""
        return self.committed / self.rounds if self.rounds else 0.0


class EngineLoop:
    """Runs `engine` on a daemon thread; thread-safe `submit` / `abort`; `stats`, `queue_depth`, `active` for
    metrics."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stats = LoopStats(proposed_at=[0] * engine.gamma, accepted_at=[0] * engine.gamma)
        self.queue_depth = 0  # requests waiting for a slot, as of the last step (read by /metrics)
        self.active = 0  # slots holding a request
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[int, Callable[[Event], None]] = {}
        self._ids = 0
        self._id_lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="specrt-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None]) -> int:
        """Queue a request; returns its id. Raises SpecrtError (now, on the caller's thread) if the engine
        cannot serve it (prompt too long for the cache, token ids outside the vocabulary), or if the loop is closed
        or has stopped."""
        if not self._running or not self._thread.is_alive():
            raise SpecrtError("the engine loop is closed; it takes no more requests")
        with self._id_lock:
            rid = self._ids
            self._ids += 1
        # seed_offset 0: a seeded request draws the same tokens whatever id the loop gives it (OpenAI's `seed`)
        request = Request(prompt_ids=[int(t) for t in prompt_ids], params=params, id=rid, seed_offset=0)
        self.engine.check(request)  # reads only the manifest: safe off the loop thread
        self._commands.put(("add", request, on_event))
        return rid

    def abort(self, request_id: int) -> None:
        """Drop a request (queued or running); its slot is free for the next step. Unknown ids are ignored."""
        self._commands.put(("abort", request_id, None))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        self._running = False
        self._commands.put(("stop", None, None))
        self._thread.join(timeout)

    # -- the loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            idle = not self.engine.has_unfinished()
            try:  # block only while idle; otherwise take what has arrived and step
                cmd = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(*cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished():
                try:
                    self._step()
                except Exception as e:  # noqa: BLE001 - a failed step ends every request, not the server
                    self._fail(f"{type(e).__name__}: {e}")

    def _apply(self, op: str, arg, on_event) -> None:
        if op == "add":
            try:
                self.engine.add_request(arg)
            except SpecrtError as e:
                self._deliver(on_event, Event(arg.id, error=str(e)))
                return
            self._listeners[arg.id] = on_event
            self.stats.requests += 1
            self.stats.prompt_tokens += len(arg.prompt_ids)
        elif op == "abort":
            listener = self._listeners.pop(arg, None)
            out = self.engine.abort(arg)
            if out is not None:
                self.stats.aborted += 1
                if listener is not None:
                    self._deliver(listener, Event(arg, finished=out))
        self._gauges()

    def _step(self) -> None:
        t0 = time.perf_counter()
        deltas = self.engine.step()
        self.stats.step_s += time.perf_counter() - t0
        self._count(self.engine.last_step)  # the step's stats; the loop keeps the running totals
        for d in deltas:
            listener = self._listeners.get(d.id)
            if d.finished is not None:
                self._listeners.pop(d.id, None)
            if listener is not None:
                if not self._deliver(listener, Event.of(d)) and d.finished is None:
                    self._listeners.pop(d.id, None)
                    self.engine.abort(d.id)  # its listener failed: the request ends here, the loop serves on
                    self.stats.aborted += 1
        self._gauges()

    @staticmethod
    def _deliver(listener: Callable[[Event], None], event: Event) -> bool:
        """Call a request's listener; one that raises is logged in one line and told the request failed (its
        caller ends it), and never stops the loop thread."""
        try:
            listener(event)
            return True
        except Exception as e:  # noqa: BLE001 - a caller's callback must not take the loop down
            log.error("specrt: request %d: its on_event callback raised %s: %s; the request is ended", event.id,
                      type(e).__name__, e)
            if event.error is None:
                try:
                    listener(Event(event.id, error=f"on_event raised {type(e).__name__}: {e}"))
                except Exception:  # noqa: BLE001 - it failed once already; the request is over either way
                    pass
            return False

    def _count(self, step: RunStats) -> None:
        """Add one step's stats to the running totals (AR: a round per token, each without drafts)."""
        s = self.stats
        s.steps += 1
        s.generated_tokens += step.generated_tokens
        s.draft_s += step.draft_s
        s.verify_s += step.verify_s
        s.rounds += len(step.rounds)
        s.committed += sum(c for _, _, c in step.rounds)
        for verify_len, accepted, _ in step.rounds:
            for k in range(min(verify_len, len(s.proposed_at))):
                s.proposed_at[k] += 1
                s.accepted_at[k] += accepted > k

    def _gauges(self) -> None:
        self.queue_depth = self.engine.queue_depth
        self.active = self.engine.active

    def _fail(self, message: str) -> None:
        for rid in list(self._listeners):
            self.engine.abort(rid)
            self._deliver(self._listeners.pop(rid), Event(rid, error=message))
        self._gauges()

