"""The online engine API: add_request / step / abort / has_unfinished, streaming, and generate() on top."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specrt.artifact import ExportSettings
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    return export_artifact(FIXTURE / "target", tmp_path_factory.mktemp("api") / "art",
                           ExportSettings(batch=4, max_seq=128, prefill_chunk=16, verify_len=5),
                           draft=FIXTURE / "draft", progress=False)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 512, 4 + 3 * i)] for i in range(n)]


def _drain(engine: Engine) -> dict[int, list[int]]:
    """Step until idle; the streamed token deltas per request."""
    streamed: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            streamed.setdefault(d.id, []).extend(d.token_ids)
    return streamed


@pytest.fixture(scope="module")
def reference(art) -> dict[int, list[int]]:
    """Each prompt alone, greedy AR."""
    engine = Engine(art, threads=1)
    return {i: engine.generate([Request(p, GREEDY)])[0][0].output_ids for i, p in enumerate(_prompts(6))}


@pytest.mark.parametrize("method", ["ar", "dspark", "ngram"])
def test_requests_join_between_steps(art, reference, method):
    """Requests added while others run are batched in; each output equals the request run alone."""
    engine = Engine(art, method=method, slots=4, threads=1)
    prompts = _prompts(6)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    streamed: dict[int, list[int]] = {}
    finished = {}
    for step in range(200):
        if step == 2:
            ids += [engine.add_request(p, GREEDY) for p in prompts[2:]]  # 4 more: one waits for a slot
        for d in engine.step():
            streamed.setdefault(d.id, []).extend(d.token_ids)
            if d.finished:
                finished[d.id] = d.finished
        if not engine.has_unfinished():
            break
    assert ids == list(range(6)) and sorted(finished) == ids
    for i in ids:
        assert finished[i].output_ids == reference[i] == streamed[i]
        assert finished[i].finish_reason == "length"


def test_abort_frees_the_slot_at_once(art, reference):
    engine = Engine(art, method="dspark", slots=1, threads=1)
    a = engine.add_request(_prompts(6)[0], SamplingParams(max_new_tokens=60, ignore_eos=True))
    b = engine.add_request(_prompts(6)[1], GREEDY)  # waits: one slot
    engine.step()
    assert engine.slots[0] is not None and engine.slots[0].request.id == a and len(engine.waiting) == 1
    out = engine.abort(a)
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 60
    assert engine.slots == [None] and engine.abort(a) is None  # already gone
    streamed = _drain(engine)
    assert streamed[b] == reference[1] and a not in streamed
    c = engine.add_request(_prompts(6)[2], GREEDY)
    assert engine.abort(c).finish_reason == "abort" and not engine.has_unfinished()  # aborted while waiting


def test_text_prompts_stream_and_ids(art, tmp_path):
    engine = Engine(art, threads=1)
    assert engine.tokenizer is None
    with pytest.raises(SpecrtError, match="tokenizer"):
        engine.add_request("hello")  # the fixture has no tokenizer: text needs one
    rid = engine.add_request([5, 6, 7], GREEDY, request_id=41)
    with pytest.raises(SpecrtError, match="already in use"):
        engine.add_request([5, 6, 7], GREEDY, request_id=41)
    assert engine.add_request([8, 9], GREEDY) == 42  # ids continue after the largest given
    with pytest.raises(SpecrtError, match="outside the vocabulary"):
        engine.add_request([5, 99999])
    with pytest.raises(SpecrtError, match="outside the vocabulary"):
        engine.add_request([5], SamplingParams(stop_token_ids=(600,)))
    with pytest.raises(SpecrtError, match="cache positions"):
        engine.add_request([5] * 100, SamplingParams(max_new_tokens=100))
    out = _drain(engine)
    assert set(out) == {rid, 42}
    with pytest.raises(SpecrtError, match="idle engine"):
        engine.add_request([1, 2], GREEDY)
        engine.generate([Request([3, 4])])


def test_generate_is_built_on_step(art, reference):
    engine = Engine(art, method="dspark", threads=1)
    seen: list[tuple[int, int]] = []
    finished = []
    outs, stats = engine.generate([Request(p, GREEDY, id=i) for i, p in enumerate(_prompts(6))],
                                  on_token=lambda i, n: seen.append((i, n)), on_finish=finished.append)
    assert [o.output_ids for o in outs] == [reference[i] for i in range(6)]
    assert sum(n for _, n in seen) == stats.generated_tokens == 6 * GREEDY.max_new_tokens
    assert sorted(o.id for o in finished) == list(range(6)) and stats.requests == 6


def test_trace_file_is_closed(art, tmp_path):
    trace = tmp_path / "t.jsonl"
    with Engine(art, method="dspark", threads=1, trace=trace) as engine:
        engine.generate([Request(_prompts(1)[0], GREEDY)])
        writer = engine.observers[0]
    assert writer._file.closed and trace.read_text().count("\n") > 1
    with pytest.raises(SpecrtError, match="is a directory"):
        Engine(art, method="dspark", trace=tmp_path)
    with pytest.raises(SpecrtError, match="cannot write --trace"):
        Engine(art, method="dspark", trace=tmp_path / "missing" / "t.jsonl")


def test_an_engine_driven_from_a_second_thread_at_once_says_to_use_the_loop(art):
    """Two threads in one Engine once failed with incidental `deque mutated during iteration` errors."""
    import threading

    engine = Engine(art, method="ngram", threads=1)
    inside, tried, errors = threading.Event(), threading.Event(), []

    def on_token(rid: int, n: int) -> None:  # the first thread holds the engine here, inside generate()
        inside.set()
        tried.wait(30)

    def second() -> None:
        inside.wait(30)
        for call in (engine.step, lambda: engine.add_request([5, 6, 7], GREEDY), lambda: engine.abort(0)):
            try:
                call()
            except SpecrtError as e:
                errors.append(str(e))
        tried.set()

    t = threading.Thread(target=second)
    t.start()
    outputs, _ = engine.generate([Request(_prompts(1)[0], GREEDY)], on_token=on_token)
    t.join(30)
    assert len(errors) == 3 and all("in use by another thread" in e and "EngineLoop" in e for e in errors)
    assert outputs[0].output_ids == Engine(art, threads=1).generate([Request(_prompts(1)[0], GREEDY)])[0][0].output_ids
    assert engine.add_request([5, 6, 7], GREEDY) >= 0  # once the first thread is done, the engine is free again


def test_calls_after_close_say_the_engine_is_closed(art, tmp_path):
    engine = Engine(art, method="dspark", threads=1, trace=tmp_path / "t.jsonl")
    engine.add_request(_prompts(1)[0], GREEDY)
    engine.step()
    engine.close()
    for call in (engine.step, lambda: engine.add_request([5, 6], GREEDY), lambda: engine.abort(0),
                 lambda: engine.generate([Request(_prompts(1)[0], GREEDY)])):
        with pytest.raises(SpecrtError, match="this engine is closed"):
            call()
    engine.close()  # twice is fine


def test_running_on_onnx_runtime_imports_neither_torch_nor_transformers(art):
    """`specrt run` / `specrt serve` on ONNX Runtime: a fresh interpreter generates through the Python API and
    builds the server app, and neither torch nor transformers is loaded (start-up time and memory)."""
    import subprocess
    import sys

    code = f"""
import sys
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams
from specrt.serve.app import create_app
from specrt.serve.loop import EngineLoop
from specrt.runtime.config import EngineConfig
from specrt.runtime.engine import Engine  # what `specrt run` does: a quick profile, measured on ONNX Runtime
engine = Engine.open({str(art)!r}, EngineConfig(method="dspark+ngram", scheduler="sps", threads=1))
engine.generate([Request([5, 6, 7, 5, 6, 7], SamplingParams(max_new_tokens=8))])
loop = EngineLoop(Engine({str(art)!r}, threads=1, slots=1))
create_app(loop, "m")
loop.close()
print(sorted(m for m in ("torch", "transformers", "matplotlib") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
