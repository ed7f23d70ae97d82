"""A small ONNX graph builder: path-named nodes, shared external weights, typed I/O.

Node names read as paths (`/target/layers.3/attn/q_proj`), output names follow the node names, and
every weight lives once in the artifact's `weights.bin`, referenced by offset from every graph.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.blocks import gguf_parts
from specrt.kernels import ops as kernel_ops
from specrt.kernels.ops import KERNEL_OPS

OPSET = 23
ALIGN = 4096  # page-aligned offsets let ONNX Runtime memory-map the weights

PLUGIN_DOMAIN = kernel_ops.DOMAIN  # specrt's ops (plugins/): an ONNX local function for ORT, a TensorRT plugin
# specrt's ONNX Runtime kernels (kernels/cpu, libspecrt_ops: KERNEL_OPS) are in the same domain: graphs
# exported with `--kernels specrt` need the library (specrt.native)
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (MatMulNBits, GatherBlockQuantized): quantized weights

_ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
               "int64": TensorProto.INT64, "int32": TensorProto.INT32, "bool": TensorProto.BOOL, "uint8": TensorProto.UINT8}


def onnx_dtype(name: str) -> int:
    return _ONNX_DTYPE[name]


class WeightStore:
    """Appends named tensors to one file once; graphs reference them as external data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")
        self._index: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._index:
            return
        array = np.ascontiguousarray(array)
        offset = self._file.tell()
        pad = (-offset) % ALIGN
        if pad:
            self._file.write(b"\0" * pad)
            offset += pad
        self._file.write(array.tobytes())
        self._index[name] = (offset, array.nbytes, array.dtype.name, tuple(array.shape))

    def alias(self, name: str, of: str, shape: tuple[int, ...]) -> None:
        """Name the bytes of tensor `of` a second time with another shape (one copy in the file)."""
        offset, length, dtype, _ = self._index[of]
        if int(np.prod(shape)) * np.dtype(dtype).itemsize != length:
            raise ValueError(f"alias {name} {shape} does not cover the {length} bytes of {of}")
        self._index.setdefault(name, (offset, length, dtype, tuple(shape)))

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def nbytes(self, name: str) -> int:
        return self._index[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._index[name][3]

    def tensor_proto(self, name: str) -> TensorProto:
        offset, length, dtype, shape = self._index[name]
        t = TensorProto()
        t.name = name
        t.data_type = onnx_dtype(dtype)
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t

    def close(self) -> int:
        self._file.close()
        return self.path.stat().st_size


class GraphBuilder:
    """Emits nodes under a scope path; `op` returns the output name(s)."""

    def __init__(self, store: WeightStore, *, accuracy_level: int = 4, kernels: str = "stock") -> None:
        self.store = store
        self.accuracy_level = accuracy_level  # MatMulNBits activations: 0 fp32, 4 int8 (quantized weights only)
        self.kernels = kernels  # "specrt": attention through specrt::CacheAttention (libspecrt_ops)
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._consts: list[TensorProto] = []
        self._weights: set[str] = set()
        self._scope: list[str] = []
        self._used: dict[str, int] = {}

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def _unique(self, base: str) -> str:
        path = "/" + "/".join([*self._scope, base])
        n = self._used.get(path, 0)
        self._used[path] = n + 1
        return path if n == 0 else f"{path}_{n}"

    def op(self, op_type: str, *inputs: str, name: str | None = None, outputs: int = 1,
           out_names: Sequence[str] | None = None, domain: str = "", **attrs) -> str | list[str]:
        node_name = self._unique(name or op_type)
        outs = list(out_names) if out_names else (
            [f"{node_name}:0"] if outputs == 1 else [f"{node_name}:{i}" for i in range(outputs)])
        if domain == PLUGIN_DOMAIN and op_type in KERNEL_OPS:  # what libspecrt_ops will be asked to run
            kernel_ops.check(op_type, len(inputs), len(outs), set(attrs))
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain or None,
                                           **attrs))
        return outs[0] if outputs == 1 and not out_names else outs

    def const(self, value: np.ndarray | int | float | Sequence, name: str, dtype: str | None = None) -> str:
        """An inline constant initializer (small tensors only: shapes, scalars, rope tables)."""
        arr = np.asarray(value, dtype=dtype) if dtype else np.asarray(value)
        full = self._unique(name)
        self._consts.append(numpy_helper.from_array(arr, full))
        return full

    def weight(self, name: str) -> str:
        """Reference a tensor of the shared weight file by its name.

        A weight stored as blocks (`name.qcodes`, ...) is returned by name too: `linear` and `embedding`
        read its block tensors (`weight` registers them then)."""
        if name not in self.store:
            if name + ".qcodes" in self.store or gguf_parts(self.store, name):
                return name
            raise KeyError(f"weight {name} was not added to the store")
        self._weights.add(name)
        return name

    def input(self, name: str, dtype: str, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, onnx_dtype(dtype), list(shape)))
        return name

    def output(self, value: str, name: str, dtype: str, shape: Sequence[int | str]) -> None:
        """Expose `value` as graph output `name` (renames the producing node's output)."""
        for node in self.nodes:
            for i, out in enumerate(node.output):
                if out == value:
                    node.output[i] = name
            for i, inp in enumerate(node.input):
                if inp == value:
                    node.input[i] = name
        self.outputs.append(helper.make_tensor_value_info(name, onnx_dtype(dtype), list(shape)))

    def model(self, graph_name: str) -> onnx.ModelProto:
        inits = [self.store.tensor_proto(n) for n in sorted(self._weights)] + self._consts
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, inits)
        opsets = [helper.make_opsetid("", OPSET)]
        if any(n.domain == MS_DOMAIN for n in self.nodes):  # only graphs with quantized weights need ORT's ops
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        functions = []
        if any(n.domain == PLUGIN_DOMAIN for n in self.nodes):
            opsets.append(helper.make_opsetid(PLUGIN_DOMAIN, 1))
        if any(n.domain == PLUGIN_DOMAIN and n.op_type not in KERNEL_OPS for n in self.nodes):  # a local function
            from specrt.plugins.confidence_truncate import function_proto

            functions.append(function_proto(OPSET))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="specrt", functions=functions)
        model.ir_version = 11
        return model
