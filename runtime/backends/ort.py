"""ONNX Runtime backend: one session per graph family, IOBinding over buffers allocated once.

The exported graphs of a family (prefill chunk, decode, verify) share one body and differ only in
their B/T/R dims, so this runner loads the family's first graph with those dims made symbolic and
serves every shape from that one session: one copy of the (prepacked) weights in memory.
Each layer's KV cache is one numpy buffer bound as both `past.*` and `present.*` (the graph scatters
the new K/V into it in place); a call over slots [s, s+n) binds the contiguous view cache[s:s+n].
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.backends.base import StepInputs

try:
    import onnxruntime as ort
except ImportError:  # pragma: no cover - depends on the installed extra
    ort = None

_SYMBOLIC = {io.INPUT_IDS: ("B", "T"), io.POSITION_IDS: ("B", "T"), io.WRITE_INDEX: ("B",),
             io.LOGIT_ROWS: ("B", "R"), io.LOGITS: ("B", "R"), io.FEATURES: ("B", "T")}


def _relax_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make B/T/R symbolic on the graph's I/O (caches keep S fixed; their batch dim becomes B)."""
    for vi in [*model.graph.input, *model.graph.output]:
        names = _SYMBOLIC.get(vi.name, ("B",))
        dims = vi.type.tensor_type.shape.dim
        for i, n in enumerate(names):
            dims[i].dim_param = n
    return model


def session_options(threads: int | None = None) -> "ort.SessionOptions":
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or max(1, len(os.sched_getaffinity(0)))
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


class OrtRunner:
    """Serves one graph family of an artifact from one ONNX Runtime session."""

    def __init__(self, art_dir: Path, graph: io.GraphSpec, *, threads: int | None = None) -> None:
        if ort is None:
            raise SpecrtError("onnxruntime is not installed; install specrt[cpu] (or specrt[gpu])")
        self.spec = graph
        self.max_seq = graph.dims["S"]
        try:
            model = _relax_dims(onnx.load(str(art_dir / graph.file), load_external_data=False))
        except Exception as e:  # protobuf's DecodeError for a corrupt file, OSError, ...
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SpecrtError(f"cannot load {graph.file}: {reason} (corrupt artifact? re-export it)") from None
        self._cache_specs = [t for t in graph.inputs if t.name.startswith("past.")]
        self._outputs = [t for t in graph.outputs if not t.name.startswith("present.")]
        # The external weights are resolved relative to the model path, so load from bytes with that dir.
        so = session_options(threads)
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(art_dir))
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for broken files
            raise SpecrtError(f"cannot load {graph.file}: {str(e).splitlines()[0]}") from None
        self.slots = 0
        self._cache: dict[str, np.ndarray] = {}
        self._bindings: dict[tuple[int, int, int, int], tuple] = {}

    def allocate(self, slots: int) -> None:
        """Allocate (zeroed) KV buffers for `slots` request slots; drops bindings of an older size."""
        self.slots = slots
        self._cache = {t.name: np.zeros((slots, *t.shape[1:]), dtype=t.dtype) for t in self._cache_specs}
        self._bindings.clear()

    def _binding(self, slot: int, n: int, tokens: int, rows: int) -> tuple:
        key = (slot, n, tokens, rows)
        if key not in self._bindings:
            b = self.session.io_binding()
            host = {io.INPUT_IDS: np.zeros((n, tokens), np.int64), io.POSITION_IDS: np.zeros((n, tokens), np.int64),
                    io.WRITE_INDEX: np.zeros((n,), np.int64), io.LOGIT_ROWS: np.zeros((n, rows), np.int64)}
            keep = []
            for name, arr in host.items():
                v = ort.OrtValue.ortvalue_from_numpy(arr)
                b.bind_ortvalue_input(name, v)
                keep.append(v)
            for name, buf in self._cache.items():
                v = ort.OrtValue.ortvalue_from_numpy(buf[slot:slot + n])
                b.bind_ortvalue_input(name, v)
                b.bind_ortvalue_output(name.replace("past.", "present.", 1), v)
                keep.append(v)
            outs = {}
            for t in self._outputs:
                shape = (n, rows, t.shape[2]) if t.name == io.LOGITS else (n, tokens, t.shape[2])
                outs[t.name] = np.zeros(shape, dtype=t.dtype)
                v = ort.OrtValue.ortvalue_from_numpy(outs[t.name])
                b.bind_ortvalue_output(t.name, v)
                keep.append(v)
            self._bindings[key] = (b, host, outs, keep)
        return self._bindings[key]

    def run(self, slot: int, inputs: StepInputs) -> dict[str, np.ndarray]:
        n, tokens = inputs.input_ids.shape
        rows = inputs.logit_rows.shape[1]
        if slot < 0 or slot + n > self.slots:
            raise ValueError(f"slots [{slot}, {slot + n}) outside the allocated {self.slots}")
        binding, host, outs, _ = self._binding(slot, n, tokens, rows)
        host[io.INPUT_IDS][...] = inputs.input_ids
        host[io.POSITION_IDS][...] = inputs.position_ids
        host[io.WRITE_INDEX][...] = inputs.write_index
        host[io.LOGIT_ROWS][...] = inputs.logit_rows
        self.session.run_with_iobinding(binding)
        return outs
