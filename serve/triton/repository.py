"""`specrt triton ART --out REPO`: a self-contained Triton Inference Server model repository for an artifact.

    REPO/specrt/config.pbtxt               decoupled Python model: owns a specrt engine, streams tokens
    REPO/specrt/1/model.py                 (serve/triton/model.py)
    REPO/specrt/1/specrt_env.json          the Python environment model.py adds for Triton's stub (site folders)
    REPO/specrt/1/artifact/...             the artifact, hard-linked where possible (else copied)
    REPO/specrt_target/config.pbtxt        one debugging model per graph: platform onnxruntime_onnx ...
    REPO/specrt_target/1/model.onnx        ... with its external weights beside it (weights.bin)
    REPO/specrt_dspark/...                 ... or tensorrt_plan over `specrt build`'s engine (model.plan)
    REPO/specrt_target/libspecrt_ops.so    specrt's kernels, for a graph exported with --kernels specrt (its config's
                                           model_operations names it by absolute path)

No ensemble or BLS pipeline: the speculative loop (draft, verify, accept, commit, per-slot KV caches) lives in the
engine, so splitting it into Triton models would only add a round trip per graph call; the per-graph models are
there to inspect one graph's outputs with any Triton client, not to be chained.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from specrt import artifact as io, native
from specrt.errors import SpecrtError
from specrt.serve.triton.config import ENGINE_BACKENDS, PLATFORMS, graph_config, graph_io, python_config

PYTHON_MODEL = "specrt"
VERSION = "1"
ARTIFACT_DIR = "artifact"  # in the Python model's version folder
OPS_LIBRARY = "libspecrt_ops.so"  # beside a graph model's config.pbtxt, when the graph runs on specrt's kernels


def write_repository(art_dir: str | Path, out: str | Path, *, backend: str = "onnxruntime", instances: int = 1,
                     method: str = "ar", gamma: int | None = None, scheduler: str = "sps", max_tokens: int = 128,
                     threads: int | None = None, force: bool = False) -> dict[str, Any]:
    """Write the repository (staged beside `out`, swapped in when complete); returns what was written."""
    from specrt.outdir import check_out, staged

    art, out = Path(art_dir), Path(out)
    manifest = io.load_manifest(art)
    _check_settings(manifest, backend=backend, instances=instances, method=method, gamma=gamma,
                    scheduler=scheduler, max_tokens=max_tokens, threads=threads)
    graphs = _graph_models(art, manifest, backend)
    check_out(out, sources=[art], force=force, command="triton")
    if art.resolve() in out.resolve().parents:
        raise SpecrtError(f"--out {out} is inside the artifact {art}; write the repository elsewhere (each run would "
                          "copy the previous repository into the next)")
    files = _artifact_files(art)
    counts = {"linked": 0, "copied": 0}
    models = []
    with staged(out, "triton") as tmp:
        version = tmp / PYTHON_MODEL / VERSION
        for rel in files:
            _place(art / rel, version / ARTIFACT_DIR / rel, counts)
        shutil.copyfile(Path(__file__).with_name("model.py"), version / "model.py")
        (version / "specrt_env.json").write_text(json.dumps(python_environment(), indent=1) + "\n")
        params = {"artifact": ARTIFACT_DIR, "backend": ENGINE_BACKENDS[backend], "method": method,
                  "gamma": "" if gamma is None else str(gamma), "scheduler": scheduler, "max_tokens": str(max_tokens),
                  "slots": str(manifest.export.batch), "threads": "" if threads is None else str(threads)}
        gpu = backend == "tensorrt"
        (tmp / PYTHON_MODEL / "config.pbtxt").write_text(python_config(PYTHON_MODEL, params, instances=instances,
                                                                       gpu=gpu))
        models.append({"name": PYTHON_MODEL, "backend": "python", "parameters": params})
        for name, onnx_file, model_file in graphs:
            version = tmp / name / VERSION
            target = "model.plan" if backend == "tensorrt" else "model.onnx"
            _place(art / model_file, version / target, counts)
            if backend == "onnxruntime":  # ORT resolves external data next to the model file
                for data in external_data(art / onnx_file):
                    _place(art / data, version / data, counts)
            inputs, outputs = graph_io(art / onnx_file)
            op_library = ""
            if backend == "onnxruntime" and graph_uses_kernels(art / onnx_file):
                # Triton's ONNX Runtime backend registers it from the model config (the path as given: absolute)
                _place(native.ops_library(onnx_file), tmp / name / OPS_LIBRARY, counts)
                op_library = str(out.resolve() / name / OPS_LIBRARY)
            (tmp / name / "config.pbtxt").write_text(graph_config(name, PLATFORMS[backend], inputs, outputs, gpu=gpu,
                                                                  op_library=op_library))
            models.append({"name": name, "platform": PLATFORMS[backend], "graph": onnx_file})
    return {"repository": str(out), "artifact": str(art), "backend": backend, "models": models, **counts}


def python_environment() -> dict[str, Any]:
    """This interpreter's version and site folders: what the repository's model.py puts first on the stub's sys.path."""
    paths = sysconfig.get_paths()
    folders = list(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"]) if p))
    return {"python": list(sys.version_info[:2]), "site": folders}


def _check_settings(manifest: io.Manifest, *, backend: str, instances: int, method: str, gamma: int | None,
                    scheduler: str, max_tokens: int, threads: int | None) -> None:
    """The settings the Python model will load the engine with, checked now rather than at tritonserver start."""
    from specrt.runtime.config import SCHEDULERS, Method

    if backend not in PLATFORMS:
        raise SpecrtError(f"--backend must be one of {', '.join(PLATFORMS)}, got {backend!r}")
    head = Method.parse(method).head
    if head is not None and head not in manifest.heads:
        raise SpecrtError(f"--method {method} needs the artifact's {head} head; it has "
                          f"{', '.join(manifest.heads) or 'no draft heads'}")
    if gamma is not None and not 1 <= gamma <= manifest.gamma:
        raise SpecrtError(f"--gamma must be between 1 and {manifest.gamma} (the artifact's verify length - 1), "
                          f"got {gamma}")
    if scheduler not in SCHEDULERS:
        raise SpecrtError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    if instances < 1 or max_tokens < 1 or (threads is not None and threads < 1):
        raise SpecrtError("--instances, --max-tokens and --threads must be >= 1")


def _graph_models(art: Path, manifest: io.Manifest, backend: str) -> list[tuple[str, str, str]]:
    """(model name, ONNX file for its I/O, file it serves) per debugging model: every graph file, or engine."""
    if backend == "tensorrt":
        engines = (manifest.engines or {}).get("families") or {}
        if not engines:
            raise SpecrtError(f"{art} has no TensorRT engines; run `specrt build {art}` first")
        models = []
        for family, spec in manifest.graphs.items():
            engine = (engines.get(family) or {}).get("engine", "")
            if not engine or not (art / engine).is_file():
                raise SpecrtError(f"{art}: the {family} engine is missing; run `specrt build {art}` again")
            models.append((f"{PYTHON_MODEL}_{family}", spec.file, engine))
        return models
    files = [f for spec in manifest.graphs.values() for f in (spec.file, spec.greedy_file) if f]
    return [(f"{PYTHON_MODEL}_{Path(f).stem.replace('.', '_')}", f, f) for f in files]


def graph_uses_kernels(onnx_path: str | Path) -> bool:
    """Whether an ONNX graph runs operators of specrt's kernels library (weights not read)."""
    import onnx

    return native.uses_kernels(onnx.load(str(onnx_path), load_external_data=False).graph.node)


def external_data(onnx_path: str | Path) -> list[str]:
    """The external data files an ONNX graph's tensors name (relative to the graph), weights not read."""
    import onnx

    return io.external_locations(onnx.load(str(onnx_path), load_external_data=False))


def _artifact_files(art: Path) -> list[str]:
    """The artifact's files to ship (relative paths): a link must stay inside the artifact (one to a host file
    would put that file in the repository), and a link to a folder is refused."""
    from specrt.outdir import MARKER, output_files

    files = []
    for rel in output_files(art):
        path = art / rel
        if path.is_symlink():
            io.inside(art, rel, "link")
            if path.is_dir():
                raise SpecrtError(f"{art}: {rel} is a link to a folder; replace it with the folder itself")
        if rel != MARKER:
            files.append(rel)
    return sorted(files)


def _place(src: Path, dst: Path, counts: dict[str, int]) -> None:
    """Hard-link `src` to `dst` (no copy of gigabytes of weights), or copy it where links are refused."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
        counts["linked"] += 1
    except OSError:
        shutil.copy2(src, dst)
        counts["copied"] += 1
