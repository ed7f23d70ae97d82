"""The TensorRT path without TensorRT (installable neither on the development machines nor in CI): the build plan, the
graph the parser gets, binding tables and profile choice, CUDA-graph capture/replay bookkeeping, and the one-line
errors; the real build and run are `importorskip("tensorrt")` here and rows of tests/gpu/check.py on a GPU."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from specrt import artifact as io
from specrt.artifact import ExportSettings, load_manifest
from specrt.cli import main
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.exporter.tensorrt_build import build_plan, input_shapes, without_local_function
from specrt.plugins.confidence_truncate import DOMAIN, OP
from specrt.runtime.backends import graphs as g
from specrt.runtime.backends.tensorrt import bindings, profile_index

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    settings = ExportSettings(batch=4, max_seq=64, prefill_chunk=8, verify_len=4)
    return export_artifact(FIXTURE / "target", tmp_path_factory.mktemp("trt") / "art", settings,
                           draft=FIXTURE / "draft", progress=False)


def test_build_plan_has_a_profile_per_bucket(art):
    m = load_manifest(art)
    plans = {p.family: p for p in build_plan(m)}
    assert set(plans) == set(m.graphs) == {"target", "dspark"}
    for family, plan in plans.items():
        spec = m.graphs[family]
        assert [p.bucket for p in plan.profiles] == [b for bs in spec.buckets.values() for b in bs]
        assert plan.onnx == spec.file and plan.engine == f"engines/{family}.plan"
        for p in plan.profiles:
            assert set(p.shapes) == {t.name for t in spec.inputs}
            for t in spec.cache_inputs():  # the call's slots, the whole cache length
                assert p.shapes[t.name][0] == p.bucket["B"] and p.shapes[t.name][2] == spec.max_seq
    assert plans["dspark"].plugin and not plans["target"].plugin
    verify = next(p for p in plans["target"].profiles if p.use == "verify" and p.bucket["B"] == 4)
    assert verify.shapes[io.INPUT_IDS] == (4, verify.bucket["T"])
    assert verify.shapes[io.TOKEN_ROWS] == (verify.bucket["P"],)
    assert input_shapes(m.graphs["target"], verify.bucket) == verify.shapes


def test_the_parser_gets_the_node_not_the_function(art):
    m = load_manifest(art)
    model = onnx.load(str(art / m.graphs["dspark"].file), load_external_data=False)
    assert any(f.domain == DOMAIN and f.name == OP for f in model.functions)
    stripped = without_local_function(model)
    assert not any(f.domain == DOMAIN and f.name == OP for f in stripped.functions)
    nodes = [n for n in stripped.graph.node if n.domain == DOMAIN and n.op_type == OP]
    assert len(nodes) == 1 and io.SURVIVAL in nodes[0].output
    assert {a.name for a in nodes[0].attribute} >= {"plugin_namespace", "plugin_version"}
    assert len(stripped.graph.node) == len(model.graph.node)  # only the function went
    assert any(f.name == OP for f in model.functions)  # the original is untouched


def test_binding_tables(art):
    m = load_manifest(art)
    spec = m.graphs["target"]
    bucket = spec.bucket("verify", B=2, T=3, P=6)
    table = {b.name: b for b in bindings(spec, bucket)}
    roles = {r: sorted(n for n, b in table.items() if b.role == r) for r in ("input", "past", "output", "present")}
    assert roles["input"] == sorted(t.name for t in spec.host_inputs())
    assert roles["output"] == sorted(t.name for t in spec.host_outputs())
    assert len(roles["past"]) == len(roles["present"]) == 2 * m.model.num_layers
    assert table[io.INPUT_IDS].shape == (2, bucket["T"]) and table[io.INPUT_IDS].dtype == "int64"
    assert table[io.LOGITS].shape == (bucket["R"], m.model.vocab_size)
    past = table[spec.cache_inputs()[0].name]
    assert past.shape == (2, m.model.num_kv_heads, spec.max_seq, m.model.head_dim)
    assert table[past.name.replace("past.", "present.", 1)].shape == past.shape


def test_profile_choice(art):
    m = load_manifest(art)
    with pytest.raises(SpecrtError, match="specrt build"):
        profile_index(m, "target", m.graphs["target"].bucket("decode", B=1))
    plans = build_plan(m)
    m.engines = {"families": {p.family: {"engine": p.engine, "profiles": [{"use": q.use, **q.bucket}
                                                                         for q in p.profiles]} for p in plans}}
    spec = m.graphs["target"]
    for i, p in enumerate(plans[0].profiles):
        assert profile_index(m, "target", p.bucket) == i
    assert spec.bucket("decode", B=3)["B"] == 4  # bucket choice rounds up; that bucket has a profile
    with pytest.raises(SpecrtError, match="no engine profile"):
        profile_index(m, "target", {"B": 3, "T": 1, "P": 3, "R": 3})


class _FakeCuda:
    """Stands in for CUDA's stream and graph objects only (no GPU here): a captured graph remembers the call and
    replays it. What is tested is GraphedCall's bookkeeping, not CUDA."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.captured = fail, []

    def install(self, monkeypatch) -> None:
        fake = self

        class Stream:
            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                self.fn()

        class capture:
            def __init__(self, graph):
                self.graph = graph

            def __enter__(self):
                fake.capturing = self.graph

            def __exit__(self, *exc):
                return False

        class stream:
            def __init__(self, s):
                pass

            def __enter__(self):
                pass

            def __exit__(self, *exc):
                return False

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", capture)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_capture_once_then_replay(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    calls = []
    out = {"x": torch.zeros(1)}

    def fn():
        calls.append(len(calls))
        if getattr(fake, "capturing", None) is not None:  # the captured call: replay runs it again
            fake.capturing.fn = lambda: calls.append("replay")
            fake.capturing = None
        return out

    stats = g.GraphStats()
    call = g.GraphedCall(fn, capture=True, stats=stats, warmup=2)
    assert call() is out
    assert calls == [0, 1, 2, "replay"]  # two warm-ups, the capture, then a replay gives the result
    assert call() is out and calls[-1] == "replay"
    assert (stats.captures, stats.replays, stats.eager, stats.failed) == (1, 2, 0, 0)
    eager = g.GraphedCall(fn, capture=False, stats=stats)
    eager()
    assert stats.eager == 1


def test_a_failed_capture_runs_eagerly(monkeypatch):
    _FakeCuda().install(monkeypatch)
    runs = []

    def fn():
        runs.append(1)
        if len(runs) == 3:  # the capture run
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return {}

    stats = g.GraphStats()
    call = g.GraphedCall(fn, capture=True, stats=stats, warmup=2)
    call()
    call()
    assert (stats.captures, stats.failed, stats.eager) == (0, 1, 2)
    assert stats.failure == "operation not permitted when stream is capturing"
    assert len(runs) == 5  # 2 warm-ups, the failed capture, then eager runs


def test_without_tensorrt_the_errors_are_one_line(art):
    pytest.importorskip("polygraphy")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt imports here: the missing-TensorRT errors cannot be shown")
    except ImportError:
        pass
    r = CliRunner().invoke(main, ["build", str(art)])
    assert r.exit_code != 0 and "needs TensorRT" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(main, ["run", str(art), "--input-ids", "1,2,3", "--backend", "tensorrt"])
    assert r.exit_code != 0 and "needs TensorRT" in r.output
    r = CliRunner().invoke(main, ["build", str(art), "--precision", "fp8"])
    assert r.exit_code != 0 and "fp8" in r.output
    assert not (art / "engines").exists()  # nothing half-written


def test_build_and_run_engines(art, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT needs an NVIDIA GPU and installs neither on the development machines nor in CI")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT imports but there is no CUDA GPU")
    import shutil

    from specrt.exporter.tensorrt_build import build_engines
    from specrt.runtime.engine import Engine, Request

    local = shutil.copytree(art, tmp_path / "art")
    record = build_engines(local, precision="fp16", progress=False)
    assert set(record["families"]) == {"target", "dspark"}
    assert load_manifest(local).engines["tensorrt"] == record["tensorrt"]
    with Engine(local, method="dspark", backend="tensorrt", scheduler="fixed") as engine:
        outs, _ = engine.generate([Request([5, 6, 7, 5, 6, 7])])
    assert len(outs[0].output_ids) > 0 and np.all(np.asarray(outs[0].output_ids) >= 0)
