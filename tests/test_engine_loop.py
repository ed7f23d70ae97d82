"""serve/loop.py: the thread that owns the engine for the server and the Triton model.

Requests submitted from many threads get the tokens of a direct engine run; the per-token draft marks agree
with the rounds the engine reports; aborts (queued or running) end a request and free its slot; a failing
step ends the requests in flight with an error and the loop keeps serving.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from specrt.artifact import ExportSettings
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams
from specrt.serve.loop import EngineLoop, Event

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    return export_artifact(FIXTURE / "target", tmp_path_factory.mktemp("loop") / "art",
                           ExportSettings(batch=4, max_seq=128, prefill_chunk=16, verify_len=5),
                           draft=FIXTURE / "draft", progress=False)


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    # repeated phrases, so n-gram lookups find drafts that the target accepts
    return [[int(t) for t in np.tile(rng.integers(3, 512, 3 + i % 3), 4)] for i in range(n)]


class _Collector:
    """Gathers one request's events; `done` is set when it finishes or fails."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.finished is not None or ev.error is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def drafted(self) -> list[bool]:
        return [d for e in self.events for d in e.drafted]


class _Rounds:
    def __init__(self) -> None:
        self.accepted: dict[int, int] = {}

    def on_round(self, r) -> None:
        self.accepted[r.request] = self.accepted.get(r.request, 0) + min(r.accepted, r.committed)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("method", ["ar", "ngram", "dspark"])
def test_threads_get_the_direct_runs_tokens_and_marks(art, method):
    prompts = _prompts(7)
    rounds = _Rounds()
    with Engine(art, method=method, scheduler="fixed", observers=[rounds]) as direct:
        expected, _ = direct.generate([Request(p, PARAMS, id=i) for i, p in enumerate(prompts)])
    loop = EngineLoop(Engine(art, method=method, scheduler="fixed", slots=4))
    got = [_Collector() for _ in prompts]
    ids: dict[int, int] = {}

    def submit(i: int) -> None:
        ids[i] = loop.submit(prompts[i], PARAMS, got[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in got:
        assert c.done.wait(60)
    try:
        for i, (c, out) in enumerate(zip(got, expected)):
            assert c.tokens == out.output_ids and c.events[-1].finished.output_ids == out.output_ids
            assert len(c.drafted) == len(c.tokens) and not c.drafted[0]  # the prefill's token is the target's
            # drafted marks: the accepted drafts the rounds committed (greedy rounds are the same in both runs)
            assert sum(c.drafted) == rounds.accepted.get(i, 0)
        if method == "ngram":
            assert any(any(c.drafted) for c in got)
        s = loop.stats
        assert s.requests == 7 and s.generated_tokens == 7 * 20 and loop.active == 0 and loop.queue_depth == 0
        if method != "ar":
            assert s.rounds > 0 and 1.0 <= s.tau <= loop.engine.gamma + 1
            assert all(0 <= a <= p for a, p in zip(s.accepted_at, s.proposed_at))
    finally:
        loop.close()


def test_abort_queued_and_running_requests(art):
    loop = EngineLoop(Engine(art, slots=1))
    try:
        long = SamplingParams(max_new_tokens=100, ignore_eos=True)
        running, queued = _Collector(), _Collector()
        a = loop.submit(_prompts(1)[0], long, running)
        b = loop.submit(_prompts(2)[1], long, queued)
        loop.abort(b)  # still waiting for the one slot
        assert queued.done.wait(30) and queued.events[-1].finished.finish_reason == "abort"
        loop.abort(a)
        assert running.done.wait(30) and running.events[-1].finished.finish_reason == "abort"
        assert len(running.tokens) < 100 and loop.stats.aborted == 2
        after = _Collector()
        loop.submit(_prompts(1)[0], PARAMS, after)  # the slot is free again
        assert after.done.wait(30) and len(after.tokens) == 20
        loop.abort(12345)  # unknown ids are ignored
    finally:
        loop.close()


def test_bad_requests_raise_on_submit(art):
    loop = EngineLoop(Engine(art))
    try:
        with pytest.raises(SpecrtError, match="exceeds the artifact's"):
            loop.submit([5] * 100, SamplingParams(max_new_tokens=100), _Collector())
        with pytest.raises(SpecrtError, match="outside the vocabulary"):
            loop.submit([5, 10 ** 6], PARAMS, _Collector())
        assert loop.stats.requests == 0 and loop.alive
    finally:
        loop.close()


def test_a_failing_step_ends_the_requests_in_flight_and_the_loop_goes_on(art, monkeypatch):
    engine = Engine(art)
    loop = EngineLoop(engine)
    try:
        real_step = engine.step
        calls = {"n": 0}

        def flaky() -> list:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device lost")
            return real_step()

        monkeypatch.setattr(engine, "step", flaky)
        failed = _Collector()
        loop.submit(_prompts(1)[0], PARAMS, failed)
        assert failed.done.wait(30) and failed.events[-1].error == "RuntimeError: device lost"
        assert loop.alive and loop.active == 0
        ok = _Collector()
        loop.submit(_prompts(1)[0], PARAMS, ok)
        assert ok.done.wait(30) and len(ok.tokens) == 20
    finally:
        loop.close()


def test_a_seed_reproduces_a_sampled_request_whatever_its_id(art):
    """OpenAI's `seed`: the loop seeds each request with its seed alone, so the same request draws the same tokens
    (here: a direct run of it with seed_offset 0), while a different seed draws differently."""
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    prompt = _prompts(1)[0]
    with Engine(art, method="dspark", scheduler="fixed") as direct:
        (want,), _ = direct.generate([Request(prompt, sampled, id=7, seed_offset=0)])
        (other,), _ = direct.generate([Request(prompt, sampled, id=7)])  # the engine's default: seed + id
    loop = EngineLoop(Engine(art, method="dspark", scheduler="fixed"))
    try:
        runs = [_Collector() for _ in range(3)]
        loop.submit(prompt, sampled, runs[0])
        loop.submit(_prompts(2)[1], sampled, _Collector())  # another request in between: ids move on
        loop.submit(prompt, sampled, runs[1])
        loop.submit(prompt, SamplingParams(max_new_tokens=24, temperature=1.0, seed=12, ignore_eos=True), runs[2])
        for c in runs:
            assert c.done.wait(30)
        assert runs[0].tokens == runs[1].tokens == want.output_ids
        assert runs[2].tokens != want.output_ids and other.output_ids != want.output_ids
    finally:
        loop.close()


def test_submit_after_close_raises(art):
    loop = EngineLoop(Engine(art))
    loop.close()
    with pytest.raises(SpecrtError, match="the engine loop is closed"):
        loop.submit(_prompts(1)[0], PARAMS, _Collector())


def test_a_raising_callback_ends_its_request_and_the_loop_serves_on(art, caplog):
    """A callback that raised once killed the loop thread: later submits were accepted and never answered."""
    loop = EngineLoop(Engine(art))
    try:
        calls: list[Event] = []
        first = threading.Event()

        def broken(ev: Event) -> None:
            calls.append(ev)
            first.set()
            if ev.error is None:
                raise ValueError("client bug")

        with caplog.at_level("ERROR", logger="specrt.serve"):
            loop.submit(_prompts(1)[0], PARAMS, broken)
            assert first.wait(30)
            ok = _Collector()
            loop.submit(_prompts(2)[1], PARAMS, ok)
            assert ok.done.wait(30) and len(ok.tokens) == 20 and ok.events[-1].finished is not None
        assert loop.alive and loop.active == 0
        assert calls[-1].error == "on_event raised ValueError: client bug"  # told once that it is over
        assert [r.getMessage() for r in caplog.records if "client bug" in r.getMessage()] == [
            f"specrt: request {calls[0].id}: its on_event callback raised ValueError: client bug; the request is ended"]
    finally:
        loop.close()
