"""ONNX Runtime backend: one session per graph family, IOBinding over buffers allocated once.

The exported graphs of a family (e.g. target prefill chunk, decode, verify) share one body and differ
only in the sizes of their named axes (B/T/R/C), so this runner loads the family's graph with those
axes made symbolic and serves every shape from that one session: one copy of the (prepacked)
weights in memory. Each layer's KV cache is one numpy buffer bound as both `past.*` and `present.*`
(the graph scatters the new K/V into it in place); a call over slots [s, s+n) binds cache[s:s+n].
Per shape, host input buffers, output buffers and the binding are created on first use and reused.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

from specrt import artifact as io
from specrt.errors import SpecrtError

try:
    import onnxruntime as ort
except ImportError:  # pragma: no cover - depends on the installed extra
    ort = None


def _relax_dims(model: onnx.ModelProto, graph: io.GraphSpec) -> onnx.ModelProto:
    """Make each tensor's named axes symbolic on the graph's I/O."""
    axes = {t.name: t.axes for t in (*graph.inputs, *graph.outputs)}
    for vi in [*model.graph.input, *model.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        for i, name in enumerate(axes.get(vi.name, ())):
            dims[i].dim_param = name
    return model


def session_options(threads: int | None = None, *, spin: bool = True) -> "ort.SessionOptions":
    """Options for every specrt session; `spin=False` when another session runs in turn with this one
    (idle spinning threads would steal the cores the other session needs next)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or max(1, len(os.sched_getaffinity(0)))
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


class OrtRunner:
    """Serves one graph family of an artifact from one ONNX Runtime session."""

    def __init__(self, art_dir: Path, graph: io.GraphSpec, *, threads: int | None = None,
                 spin: bool = True) -> None:
        if ort is None:
            raise SpecrtError("onnxruntime is not installed; install specrt[cpu] (or specrt[gpu])")
        self.spec = graph
        self.max_seq = graph.dims["S"]
        try:
            model = _relax_dims(onnx.load(str(art_dir / graph.file), load_external_data=False), graph)
        except Exception as e:  # protobuf's DecodeError for a corrupt file, OSError, ...
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SpecrtError(f"cannot load {graph.file}: {reason} (corrupt artifact? re-export it)") from None
        self._cache_specs = [t for t in graph.inputs if t.name.startswith("past.")]
        self._host_specs = [t for t in graph.inputs if not t.name.startswith("past.")]
        self._outputs = [t for t in graph.outputs if not t.name.startswith("present.")]
        # Loaded from bytes, so tell ORT where the external weights live.
        so = session_options(threads, spin=spin)
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(art_dir))
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for broken files
            raise SpecrtError(f"cannot load {graph.file}: {str(e).splitlines()[0]}") from None
        self.slots = 0
        self._cache: dict[str, np.ndarray] = {}
        self._bindings: dict[tuple, tuple] = {}

    def allocate(self, slots: int) -> None:
        """Allocate (zeroed) KV buffers for `slots` request slots; drops bindings of an older size."""
        if slots != self.slots or not self._cache:
            self.slots = slots
            self._cache = {t.name: np.zeros((slots, *t.shape[1:]), dtype=t.dtype) for t in self._cache_specs}
            self._bindings.clear()

    def _sizes(self, feeds: dict[str, np.ndarray]) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for t in self._host_specs:
            for axis, n in zip(t.axes, feeds[t.name].shape):
                if sizes.setdefault(axis, n) != n:
                    raise ValueError(f"{t.name}: axis {axis} is {n}, other inputs say {sizes[axis]}")
        return sizes

    def _binding(self, slot: int, sizes: dict[str, int]) -> tuple:
        key = (slot, *sorted(sizes.items()))
        if key not in self._bindings:
            b = self.session.io_binding()
            n = sizes["B"]
            host = {t.name: np.zeros(t.resolve(sizes), dtype=t.dtype) for t in self._host_specs}
            outs = {t.name: np.zeros(t.resolve(sizes), dtype=t.dtype) for t in self._outputs}
            keep = []  # OrtValues view numpy memory: keep them alive with the binding
            for name, arr in host.items():
                keep.append(ort.OrtValue.ortvalue_from_numpy(arr))
                b.bind_ortvalue_input(name, keep[-1])
            for name, buf in self._cache.items():
                keep.append(ort.OrtValue.ortvalue_from_numpy(buf[slot:slot + n]))
                b.bind_ortvalue_input(name, keep[-1])
                b.bind_ortvalue_output(name.replace("past.", "present.", 1), keep[-1])
            for name, arr in outs.items():
                keep.append(ort.OrtValue.ortvalue_from_numpy(arr))
                b.bind_ortvalue_output(name, keep[-1])
            self._bindings[key] = (b, host, outs, keep)
        return self._bindings[key]

    def inputs(self, slot: int, **sizes: int) -> dict[str, np.ndarray]:
        """The bound host input buffers for slots [slot, slot + B) at these axis sizes: fill them in
        place, then `run_bound` (no per-step allocation)."""
        if slot < 0 or slot + sizes["B"] > self.slots:
            raise ValueError(f"slots [{slot}, {slot + sizes['B']}) outside the allocated {self.slots}")
        return self._binding(slot, sizes)[1]

    def run_bound(self, slot: int, **sizes: int) -> dict[str, np.ndarray]:
        """Run on the buffers `inputs(slot, **sizes)` returned; outputs stay valid until the next call."""
        binding, _, outs, _ = self._binding(slot, sizes)
        self.session.run_with_iobinding(binding)
        return outs

    def run(self, slot: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copy `feeds` into the bound buffers and run (convenient; the decode loop fills in place)."""
        sizes = self._sizes(feeds)
        for name, arr in self.inputs(slot, **sizes).items():
            arr[...] = feeds[name]
        return self.run_bound(slot, **sizes)
