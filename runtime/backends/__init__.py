"""Backends: each serves a graph family of an artifact behind `base.Runner` (allocate / inputs / run)."""
from __future__ import annotations

from pathlib import Path

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.backends.base import Runner, bucket_of, infer

BACKENDS = ("ort", "torch")

__all__ = ["BACKENDS", "Runner", "bucket_of", "infer", "load_runner"]


def load_runner(backend: str, art_dir: str | Path, manifest: io.Manifest, family: str, *,
                threads: int | None = None, spin: bool = True) -> Runner:
    """Load graph family `family` ("target", "dspark", "mtp") of an artifact on `backend`.

    `spin=False` for a family that runs in turn with another (idle spinning threads steal its cores)."""
    if family not in manifest.graphs:
        raise SpecrtError(f"the artifact has no {family!r} graph (it has: {', '.join(manifest.graphs)})")
    if backend == "ort":
        from specrt.runtime.backends.ort import OrtRunner

        return OrtRunner(Path(art_dir), manifest.graphs[family], threads=threads, spin=spin)
    if backend == "torch":
        from specrt.runtime.backends.torch import TorchRunner

        return TorchRunner(Path(art_dir), manifest, family, threads=threads)
    raise SpecrtError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
