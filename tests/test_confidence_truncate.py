"""specrt::ConfidenceTruncate: the ONNX local function ONNX Runtime runs, the node in the exported DSpark graph,
and the OpenAI-Triton kernel behind the TensorRT plugin (on CPU through Triton's interpreter), all against the
numpy reference of plugins/confidence_truncate.py."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run in numpy, on the CPU

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specrt import artifact as io
from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact
from specrt.plugins.confidence_truncate import DOMAIN, OP, function_proto, truncate, truncate_torch
from specrt.runtime.backends import infer, load_runner

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
SHAPES = [(1, 1), (1, 16), (3, 7), (8, 4), (64, 1), (64, 16), (17, 5)]  # (B, γ): γ 1..16, B 1..64
MODES = [(0.4, -1), (0.0, -1), (0.99, -1), (0.0, 0), (0.0, 1), (0.0, 5), (0.0, 10**6)]


def _cases(seed: int):
    rng = np.random.default_rng(seed)
    for b, g in SHAPES:
        temps = rng.uniform(0.5, 2.0, g).astype(np.float32)
        for logits in (rng.normal(0, 3, (b, g)), np.full((b, g), 40.0), np.full((b, g), -40.0)):  # and the edges:
            yield logits.astype(np.float32), temps  # all confident, none confident


@pytest.fixture(scope="module")
def session():
    node = helper.make_node(OP, ["logits", "temperatures", "threshold", "budget"], ["survival", "lengths"],
                            domain=DOMAIN, plugin_namespace=DOMAIN, plugin_version="1")
    graph = helper.make_graph([node], "truncate", [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "G"]),
        helper.make_tensor_value_info("temperatures", TensorProto.FLOAT, ["G"]),
        helper.make_tensor_value_info("threshold", TensorProto.FLOAT, []),
        helper.make_tensor_value_info("budget", TensorProto.INT64, [])], [
        helper.make_tensor_value_info("survival", TensorProto.FLOAT, ["B", "G"]),
        helper.make_tensor_value_info("lengths", TensorProto.INT64, ["B"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)],
                              functions=[function_proto(23)])
    model.ir_version = 11
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _check(survival, lengths, logits, temps, threshold, budget):
    ref_a, ref_len = truncate(logits, temps, threshold, budget)
    np.testing.assert_allclose(survival, ref_a, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(lengths, ref_len)


def test_onnx_function_matches_the_reference(session):
    for logits, temps in _cases(0):
        for threshold, budget in MODES:
            a, n = session.run(None, {"logits": logits, "temperatures": temps,
                                      "threshold": np.array(threshold, np.float32), "budget": np.array(budget)})
            _check(a, n, logits, temps, threshold, budget)


def test_torch_op_matches_the_reference():
    torch = pytest.importorskip("torch")
    for logits, temps in _cases(2):
        for threshold, budget in MODES:
            a, n = truncate_torch(torch.from_numpy(logits), torch.from_numpy(temps), torch.tensor(threshold),
                                  torch.tensor(budget))
            _check(a.numpy(), n.numpy(), logits, temps, threshold, budget)


def test_exported_draft_graph_runs_the_op(tmp_path):
    art = export_artifact(FIXTURE / "target", tmp_path / "art", ExportSettings(batch=4, max_seq=64, prefill_chunk=8,
                                                                             verify_len=5),
                          draft=FIXTURE / "draft", progress=False)
    m = io.load_manifest(art)
    temps = np.asarray(m.heads["dspark"].temperatures or [1.0] * m.heads["dspark"].steps, np.float32)
    r = load_runner("ort", art, m, "dspark", threads=1)
    r.allocate(4)
    rng = np.random.default_rng(5)
    spec = r.spec
    for threshold, budget in MODES:
        feeds = {t.name: np.zeros(t.resolve({"B": 4, "C": 3}), t.dtype) for t in spec.host_inputs()}
        feeds[io.CTX_FEATURES][:] = rng.standard_normal(feeds[io.CTX_FEATURES].shape)
        feeds[io.CTX_POSITIONS][:] = np.arange(3)
        feeds[io.CTX_LEN][:] = 3
        feeds[io.ANCHOR_IDS][:] = rng.integers(0, 512, 4)
        feeds[io.TRUNCATE_THRESHOLD][...], feeds[io.TRUNCATE_BUDGET][...] = threshold, budget
        out = infer(r, 0, feeds)
        _check(out[io.SURVIVAL], out[io.VERIFY_LENGTHS], out[io.CONFIDENCE_LOGITS], temps, threshold, budget)


def test_triton_kernel_matches_the_reference():
    pytest.importorskip("triton", reason="OpenAI Triton is in the test extra; without it the kernel cannot run")
    torch = pytest.importorskip("torch")
    from specrt.plugins.trt_confidence_truncate import blocks, launch

    for logits, temps in _cases(1):
        # the interpreter runs B programs one by one: at B = 64, random logits in one mode of each kind
        modes = MODES if len(logits) < 64 else ([(0.4, -1), (0.0, 37)] if np.ptp(logits) else [])
        for threshold, budget in modes:
            a, n = launch(torch.from_numpy(logits), torch.from_numpy(temps), torch.tensor(threshold),
                          torch.tensor(budget, dtype=torch.int64))
            _check(a.numpy(), n.numpy(), logits, temps, threshold, budget)
    with pytest.raises(ValueError, match="1..64"):
        blocks(65, 4)


def test_tensorrt_plugin_registers():
    pytest.importorskip("tensorrt", reason="TensorRT needs an NVIDIA GPU and installs neither on the development machines nor in CI")
    import tensorrt.plugin as trtp

    from specrt.plugins.trt_confidence_truncate import PLUGIN_ID, register_plugin

    register_plugin()
    register_plugin()  # idempotent
    assert PLUGIN_ID in trtp.QDP_REGISTRY
