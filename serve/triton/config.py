"""config.pbtxt text for the models of a specrt Triton repository, and the ONNX graph I/O both writer and check read.

    graph_io(model.onnx)        -> inputs, outputs as Triton sees them (TYPE_*, dims with -1 for named axes)
    graph_config(name, ...)     -> a debugging model: an ONNX graph (onnxruntime_onnx) or TensorRT engine (tensorrt_plan)
    python_config(name, ...)    -> the decoupled Python model that owns a specrt engine (vLLM backend's I/O names)
    engine_settings(parameters) -> that model's parameters parsed as model.py loads its engine (and --check checks)

The text is written by hand (no tritonclient needed to write a repository); `specrt triton --check` parses it
with Triton's own ModelConfig protobuf.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrt.errors import SpecrtError

# ONNX TensorProto element types -> Triton data types (those an exported graph can carry)
ONNX_TO_TRITON = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 5: "TYPE_INT16", 6: "TYPE_INT32", 7: "TYPE_INT64",
                  9: "TYPE_BOOL", 10: "TYPE_FP16", 11: "TYPE_FP64", 16: "TYPE_BF16"}
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}  # repository backend -> platform
MODEL_FILES = {"onnxruntime_onnx": "model.onnx", "tensorrt_plan": "model.plan", "python": "model.py"}


ENGINE_BACKENDS = {"onnxruntime": "ort", "tensorrt": "tensorrt"}  # repository backend -> specrt Engine backend
DEFAULT_MAX_TOKENS = 128


def engine_settings(params: dict[str, str]) -> dict[str, Any]:
    """The specrt Python model's parameters (config.pbtxt string values) parsed: {"artifact": folder, "engine":
    EngineConfig, "max_tokens": int}. A bad value is a SpecrtError naming it; model.py loads its engine from
    exactly this, and `specrt triton --check` runs it on a repository's values."""
    from specrt.runtime.config import METHODS, SCHEDULERS, EngineConfig

    def choice(name: str, allowed, default: str) -> str:
        value = params.get(name) or default
        if value not in allowed:
            raise SpecrtError(f"parameter {name}: {value!r} is not one of {', '.join(allowed)}")
        return value

    def count(name: str, default: int | None) -> int | None:
        value = (params.get(name) or "").strip()
        if not value:
            return default
        if not value.isdigit() or int(value) < 1:
            raise SpecrtError(f"parameter {name}: {value!r} is not a whole number >= 1")
        return int(value)

    artifact = params.get("artifact") or "artifact"
    if Path(artifact).is_absolute() or ".." in Path(artifact).parts:
        raise SpecrtError(f"parameter artifact: {artifact!r} must be a folder inside the model's version folder")
    engine = EngineConfig(method=choice("method", METHODS, "ar"), scheduler=choice("scheduler", SCHEDULERS, "fixed"),
                          backend=choice("backend", tuple(ENGINE_BACKENDS.values()), "ort"),
                          gamma=count("gamma", None), threads=count("threads", None), slots=count("slots", None))
    return {"artifact": artifact, "engine": engine, "max_tokens": count("max_tokens", DEFAULT_MAX_TOKENS)}


@dataclass(frozen=True, slots=True)
class TensorIO:
    """One model input or output as config.pbtxt states it; `dims` () is a scalar."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False


def graph_io(path: str | Path) -> tuple[list[TensorIO], list[TensorIO]]:
    """The inputs and outputs of an ONNX graph (weights not loaded): named or unknown axes become -1."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph

    def io(values) -> list[TensorIO]:
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
            out.append(TensorIO(v.name, ONNX_TO_TRITON.get(t.elem_type, f"ONNX_ELEM_{t.elem_type}"), dims))
        return out

    initializers = {i.name for i in graph.initializer}  # old-style graphs list weights as inputs too
    return io(v for v in graph.input if v.name not in initializers), io(graph.output)


def _tensor(t: TensorIO) -> str:
    # Triton needs non-empty dims: a scalar is [1], reshaped to [] for the model
    dims = ", ".join(str(d) for d in t.dims) if t.dims else "1"
    lines = [f'    name: "{t.name}"', f"    data_type: {t.data_type}", f"    dims: [ {dims} ]"]
    if not t.dims:
        lines.append("    reshape: { shape: [ ] }")
    if t.optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def _tensors(key: str, tensors: list[TensorIO]) -> str:
    return f"{key} [\n" + ",\n".join(_tensor(t) for t in tensors) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    return "".join(f'parameters {{\n  key: "{k}"\n  value: {{ string_value: {json.dumps(v)} }}\n}}\n'
                   for k, v in params.items())


def graph_config(name: str, platform: str, inputs: list[TensorIO], outputs: list[TensorIO], *, gpu: bool,
                 op_library: str = "") -> str:
    """A debugging model serving one graph as exported: max_batch_size 0, as the graphs carry their own slot axis B;
    `op_library`: the custom-op library its ONNX Runtime session registers (a graph on specrt's kernels)."""
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    ops = f'model_operations {{\n  op_library_filename: {json.dumps(op_library)}\n}}\n' if op_library else ""
    return (f'name: "{name}"\nplatform: "{platform}"\nmax_batch_size: 0\n' + _tensors("input", inputs)
            + _tensors("output", outputs) + f"instance_group [\n  {{\n    count: 1\n    kind: {kind}\n  }}\n]\n"
            + ops)


# The vLLM backend's request schema (text_input, stream, sampling_parameters, exclude_input_in_output ->
# text_output), so its clients work unchanged; plus token ids in, and token ids and draft marks out.
PYTHON_INPUTS = [TensorIO("text_input", "TYPE_STRING", (1,), optional=True),
                 TensorIO("input_ids", "TYPE_INT32", (-1,), optional=True),
                 TensorIO("stream", "TYPE_BOOL", (1,), optional=True),
                 TensorIO("sampling_parameters", "TYPE_STRING", (1,), optional=True),
                 TensorIO("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True)]
PYTHON_OUTPUTS = [TensorIO("text_output", "TYPE_STRING", (-1,)), TensorIO("token_ids", "TYPE_INT32", (-1,)),
                  TensorIO("drafted", "TYPE_BOOL", (-1,))]


def python_config(name: str, params: dict[str, str], *, instances: int, gpu: bool) -> str:
    """The decoupled Python model: one response per engine step when streaming, engine settings as parameters."""
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            "model_transaction_policy {\n  decoupled: true\n}\n"
            + _tensors("input", PYTHON_INPUTS) + _tensors("output", PYTHON_OUTPUTS)
            + f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]\n" + _parameters(params))
