"""Backends: each serves a graph family of an artifact behind `base.Runner` (allocate / inputs / run)."""
from __future__ import annotations

import os
from pathlib import Path

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.backends.base import Runner, bucket_of, infer
from specrt.runtime.config import BACKENDS  # the registry; load_runner implements each name

__all__ = ["BACKENDS", "SHARED_POOL_ENV", "Runner", "bucket_of", "infer", "load_runner", "own_process_defaults"]

SHARED_POOL_ENV = "SPECRT_ORT_SHARED_POOL"  # "1": every ONNX Runtime session of the process on one pool (ort.py)


def own_process_defaults() -> None:
    """Where specrt owns the process (its command line, the Triton model): one ONNX Runtime thread pool for every
    session, unless $SPECRT_ORT_SHARED_POOL is set (ort.session_options says why, and why not elsewhere)."""
    os.environ.setdefault(SHARED_POOL_ENV, "1")


def load_runner(backend: str, art_dir: str | Path, manifest: io.Manifest, family: str, *,
                threads: int | None = None, spin: bool = True, device: str = "cpu", dtype: str | None = None,
                graphs: bool | None = None) -> Runner:
    """Load graph family `family` ("target", "dspark", "mtp") of an artifact on `backend`.

    `spin=False` for a family that runs in turn with another (idle spinning threads steal its cores).
    `device`, `dtype`, `graphs`: where and in which precision the torch backend runs, and whether it captures CUDA
    graphs (default: on CUDA); ONNX Runtime here runs on the CPU in the graphs' precision."""
    if family not in manifest.graphs:
        raise SpecrtError(f"the artifact has no {family!r} graph (it has: {', '.join(manifest.graphs)})")
    if backend == "ort":
        if device != "cpu" or dtype is not None or graphs:
            raise SpecrtError("--device and --dtype are the torch backend's (the onnxruntime installed here runs "
                              "on the CPU, in the precision the graphs were exported in)")
        from specrt.runtime.backends.ort import OrtRunner

        return OrtRunner(Path(art_dir), manifest.graphs[family], threads=threads, spin=spin)
    if backend == "torch":
        from specrt.runtime.backends.torch import TorchRunner

        return TorchRunner(Path(art_dir), manifest, family, threads=threads, device=device, dtype=dtype,
                           graphs=graphs)
    if backend == "tensorrt":
        if dtype is not None:
            raise SpecrtError("--dtype is the torch backend's (an engine's precision is fixed by `specrt build`)")
        from specrt.runtime.backends.tensorrt import TrtRunner

        return TrtRunner(Path(art_dir), manifest, family, graphs=graphs is not False)
    raise SpecrtError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
