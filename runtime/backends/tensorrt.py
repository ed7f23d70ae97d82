"""TensorRT backend: the engines `specrt build` made (exporter/tensorrt_build.py), behind the `Runner` verbs.

Each family's engine is deserialized once; its KV cache is one device tensor per `past.*` input, allocated once.
Each (slot, bucket) call gets its own execution context on the bucket's optimization profile, pinned host input
buffers and static device inputs, device outputs, and the views of its slots' cache rows, all bound by address
once; the call (enqueue, then the `present.*` rows copied back into the cache) is captured into a CUDA graph after
a warm-up and replayed (runtime/backends/graphs.py), with a plain enqueue where capture fails. Outputs are copied
into pinned host memory: one synchronisation per call. Needs `tensorrt` and a GPU; only `bindings` and
`profile_index` run without them (and are tested here).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.backends.graphs import GraphedCall, GraphStats


@dataclass(frozen=True)
class Binding:
    """One engine I/O tensor of a call: its shape at the bucket, dtype, and role."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # "input" (host-filled), "past" (cache rows in), "output" (copied to host), "present" (cache rows out)


def bindings(spec: io.GraphSpec, bucket: io.Bucket) -> list[Binding]:
    """The binding table of a call at `bucket`: caches over its B slots and the whole cache length."""
    sizes = {**bucket, io.CACHE_LEN: spec.max_seq}
    out = [Binding(t.name, t.resolve(sizes), t.dtype, "past" if t.name.startswith("past.") else "input")
           for t in spec.inputs]
    out += [Binding(t.name, t.resolve(sizes), t.dtype, "present" if t.name.startswith("present.") else "output")
            for t in spec.outputs]
    return out


def profile_index(manifest: io.Manifest, family: str, bucket: io.Bucket) -> int:
    """Which optimization profile of the family's engine is `bucket` (the build's order)."""
    fam = manifest.engines.get("families", {}).get(family)
    if fam is None:
        raise SpecrtError(f"the artifact has no TensorRT engine for {family!r}; run `specrt build ART` on this GPU")
    for i, p in enumerate(fam["profiles"]):
        if {k: v for k, v in p.items() if k != "use"} == dict(bucket):
            return i
    raise SpecrtError(f"{family}: no engine profile for bucket {dict(bucket)}; rebuild with `specrt build`")


class TrtRunner:
    """Serves one graph family from its TensorRT engine (the `Runner` verbs)."""

    def __init__(self, art_dir: Path, manifest: io.Manifest, family: str, *, graphs: bool = True) -> None:
        import torch

        from specrt.plugins.tensorrt import require_tensorrt
        from specrt.plugins.trt_confidence_truncate import register_plugin

        trt = require_tensorrt()
        register_plugin()
        self.manifest, self.family, self.spec = manifest, family, manifest.graphs[family]
        profile_index(manifest, family, self.spec.buckets[next(iter(self.spec.buckets))][0])  # engines exist
        path = Path(art_dir) / manifest.engines["families"][family]["engine"]
        try:
            blob = path.read_bytes()
        except OSError as e:
            raise SpecrtError(f"cannot read {path}: {e.strerror or e}; run `specrt build` again") from None
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(blob)
        if self.engine is None:
            raise SpecrtError(f"{path} does not deserialize with TensorRT {trt.__version__} (built with "
                              f"{manifest.engines.get('tensorrt')} on {manifest.engines.get('gpu')}); rebuild it")
        self._torch = torch
        self.graphs = graphs
        self.graph_stats = GraphStats()
        self.syncs = 0
        self.slots = 0
        self._cache: dict[str, object] = {}
        self._calls: dict[tuple, dict] = {}

    def _dtype(self, name: str):
        t = self._torch
        return {"float32": t.float32, "float16": t.float16, "bfloat16": t.bfloat16, "int64": t.int64}[name]

    def allocate(self, slots: int) -> None:
        if slots != self.slots or not self._cache:
            self.slots = slots
            self._calls.clear()
            sizes = {"B": slots, io.CACHE_LEN: self.spec.max_seq}
            self._cache = {t.name: self._torch.zeros(t.resolve(sizes), dtype=self._dtype(t.dtype), device="cuda")
                           for t in self.spec.cache_inputs()}

    def move_rows(self, moves: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Copy cache positions src to dst of slot `slot`, for each (slot, src, dst), in every layer (a draft tree's
        accepted path)."""
        t = self._torch
        for slot, src, dst in moves:
            s, d = t.as_tensor(src, device="cuda"), t.as_tensor(dst, device="cuda")
            for buf in self._cache.values():
                buf[slot, :, d] = buf[slot, :, s]

    def _call(self, slot: int, bucket: io.Bucket) -> dict:
        key = (slot, *sorted(bucket.items()))
        if key in self._calls:
            return self._calls[key]
        torch, n = self._torch, bucket["B"]
        if slot < 0 or slot + n > self.slots:
            raise ValueError(f"slots [{slot}, {slot + n}) outside the allocated {self.slots}")
        ctx = self.engine.create_execution_context()
        ctx.set_optimization_profile_async(profile_index(self.manifest, self.family, bucket),
                                           torch.cuda.current_stream().cuda_stream)
        host, feeds, outputs, copies = {}, {}, {}, []
        for b in bindings(self.spec, bucket):
            dt = self._dtype(b.dtype)
            if b.role == "input":
                host[b.name] = torch.zeros(b.shape, dtype=dt, pin_memory=True)
                tensor = feeds[b.name] = torch.zeros(b.shape, dtype=dt, device="cuda")
            elif b.role == "past":
                tensor = self._cache[b.name][slot:slot + n]
            elif b.role == "present":
                tensor = torch.empty(b.shape, dtype=dt, device="cuda")
                copies.append((self._cache[b.name.replace("present.", "past.", 1)][slot:slot + n], tensor))
            else:
                tensor = outputs[b.name] = torch.empty(b.shape, dtype=dt, device="cuda")
            if b.role in ("input", "past"):
                ctx.set_input_shape(b.name, b.shape)
            ctx.set_tensor_address(b.name, tensor.data_ptr())

        def enqueue():
            if not ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream):
                raise RuntimeError(f"{self.family}: TensorRT enqueue failed")
            for past, present in copies:
                past.copy_(present)
            return outputs

        call = {"host": host, "feeds": feeds, "run": GraphedCall(enqueue, capture=self.graphs, stats=self.graph_stats),
                "out": {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in outputs.items()},
                "context": ctx}
        self._calls[key] = call
        return call

    def inputs(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in self._call(slot, bucket)["host"].items()}

    def run(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        call = self._call(slot, bucket)
        for name, h in call["host"].items():
            call["feeds"][name].copy_(h, non_blocking=True)
        out = call["run"]()
        for name, t in out.items():
            call["out"][name].copy_(t, non_blocking=True)
        self._torch.cuda.current_stream().synchronize()
        self.syncs += 1
        return {k: v.numpy() for k, v in call["out"].items()}
