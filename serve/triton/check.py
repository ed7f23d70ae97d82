"""`specrt triton --check REPO`: what tritonserver would refuse in a model repository, found before starting it.

Per model folder: config.pbtxt parses as Triton's own ModelConfig protobuf (tritonclient's model_config_pb2), its
name is the folder's, platform and backend agree, a numeric version folder holds the model file. ONNX models: the
I/O names, data types and dims match the graph (read without its weights) and its external data files are there.
Python models reading a specrt artifact: decoupled, model.py present, the artifact there, the I/O model.py uses.
Ensembles: every step names a model of the repository.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from specrt.errors import SpecrtError
from specrt.serve.triton.config import MODEL_FILES, PYTHON_INPUTS, PYTHON_OUTPUTS, TensorIO, engine_settings, graph_io

PLATFORM_BACKENDS = {"onnxruntime_onnx": "onnxruntime", "tensorrt_plan": "tensorrt", "pytorch_libtorch": "pytorch",
                     "tensorflow_savedmodel": "tensorflow", "tensorflow_graphdef": "tensorflow", "ensemble": ""}


def _model_config_pb2():
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise SpecrtError("specrt triton --check needs tritonclient: pip install 'specrt[triton]'") from None
    return model_config_pb2


def check_repository(repo: str | Path) -> dict[str, Any]:
    """Every model folder of `repo` checked; returns {"repository", "models": [...], "problems": [...]}."""
    pb2 = _model_config_pb2()
    repo = Path(repo)
    if not repo.is_dir():
        raise SpecrtError(f"{repo} is not a directory (a Triton model repository holds one folder per model)")
    folders = sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith("."))
    problems: list[str] = []
    if not folders:
        problems.append(f"{repo}: no model folders")
    configs = {}
    for folder in folders:
        cfg = _parse(folder, pb2, problems)
        if cfg is not None:
            configs[folder.name] = cfg
    models = []
    for name, cfg in configs.items():
        folder = repo / name
        kind = cfg.platform or cfg.backend
        versions = sorted((p.name for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=int)
        models.append({"name": name, "platform": cfg.platform, "backend": cfg.backend, "versions": versions})
        before = len(problems)
        _check_kind(name, cfg, problems)
        if not versions:
            problems.append(f"{name}: no version folder ({name}/1/)")
        for v in versions:
            _check_version(name, cfg, kind, folder / v, problems)
        if cfg.backend == "python" and "artifact" in cfg.parameters:
            _check_specrt(name, cfg, folder, versions, problems)
        for step in cfg.ensemble_scheduling.step:
            if step.model_name not in configs:
                problems.append(f"{name}: ensemble step names model {step.model_name!r}, not in the repository")
        models[-1]["ok"] = len(problems) == before
    return {"repository": str(repo), "models": models, "problems": problems}


def _parse(folder: Path, pb2, problems: list[str]):
    from google.protobuf import text_format

    path = folder / "config.pbtxt"
    if not path.is_file():
        problems.append(f"{folder.name}: no config.pbtxt")
        return None
    try:
        cfg = text_format.Parse(path.read_text(), pb2.ModelConfig())
    except (text_format.ParseError, UnicodeDecodeError) as e:
        problems.append(f"{folder.name}/config.pbtxt: not a valid Triton ModelConfig: {e}")
        return None
    if cfg.name and cfg.name != folder.name:
        problems.append(f"{folder.name}: config name {cfg.name!r} differs from the folder name")
    return cfg


def _check_kind(name: str, cfg, problems: list[str]) -> None:
    if cfg.platform:
        if cfg.platform not in PLATFORM_BACKENDS:
            problems.append(f"{name}: unknown platform {cfg.platform!r}")
        elif cfg.backend and cfg.backend != PLATFORM_BACKENDS[cfg.platform]:
            problems.append(f"{name}: platform {cfg.platform!r} runs on backend "
                            f"{PLATFORM_BACKENDS[cfg.platform] or '(none)'!r}, not {cfg.backend!r}")
    elif not cfg.backend:
        problems.append(f"{name}: neither platform nor backend is set")
    if cfg.platform == "tensorrt_plan" and any(g.kind == g.KIND_CPU for g in cfg.instance_group):
        problems.append(f"{name}: a TensorRT plan runs on a GPU, not instance_group kind KIND_CPU")


def _check_version(name: str, cfg, kind: str, version: Path, problems: list[str]) -> None:
    if kind not in MODEL_FILES:
        return  # ensembles have no file; other backends' files are theirs to judge
    file = version / (cfg.default_model_filename or MODEL_FILES[kind])
    where = f"{name}/{version.name}/{file.name}"
    if not file.is_file():
        problems.append(f"{where}: missing")
    elif kind == "onnxruntime_onnx":
        _check_onnx(where, cfg, file, problems)


def _check_onnx(where: str, cfg, file: Path, problems: list[str]) -> None:
    from specrt.serve.triton.repository import external_data

    try:
        inputs, outputs = graph_io(file)
        data = external_data(file)
    except Exception as e:  # noqa: BLE001 - any unreadable graph is one problem line
        problems.append(f"{where}: not a readable ONNX graph: {type(e).__name__}: {e}")
        return
    for d in data:
        if not (file.parent / d).is_file():
            problems.append(f"{where}: its external data {d} is missing (ONNX Runtime reads it beside the graph)")
    _check_ops(where, cfg, file, problems)
    batch = (-1,) if cfg.max_batch_size > 0 else ()
    declared = {t.name for t in cfg.input}
    for t in inputs:
        if t.name not in declared:
            problems.append(f"{where}: graph input {t.name!r} is not in config.pbtxt")
    _match(where, "input", cfg.input, {t.name: t for t in inputs}, batch, problems)
    _match(where, "output", cfg.output, {t.name: t for t in outputs}, batch, problems)


def _check_ops(where: str, cfg, file: Path, problems: list[str]) -> None:
    """A graph on specrt's kernels needs its config to name the kernels library (model_operations), which must be
    there and be that library; Triton's ONNX Runtime backend cannot load the graph otherwise."""
    from specrt import native
    from specrt.serve.triton.repository import graph_uses_kernels

    if not graph_uses_kernels(file):
        return
    libraries = list(cfg.model_operations.op_library_filename)
    if not libraries:
        problems.append(f"{where}: runs on specrt's kernels (exported with --kernels specrt) but config.pbtxt names no "
                        "op library (model_operations { op_library_filename }): Triton cannot load it; write the "
                        "repository again with this specrt")
        return
    for lib in libraries:
        try:
            native.check_ops_library(Path(lib))
        except SpecrtError as e:
            problems.append(f"{where}: its op library: {e}")


def _shape(t) -> tuple[int, ...]:
    return tuple(t.reshape.shape) if t.HasField("reshape") else tuple(t.dims)


def _match(where: str, side: str, declared, actual: dict[str, TensorIO], batch: tuple[int, ...],
           problems: list[str]) -> None:
    from tritonclient.grpc import model_config_pb2 as pb2

    for t in declared:
        graph = actual.get(t.name)
        if graph is None:
            problems.append(f"{where}: config {side} {t.name!r} is not a graph {side} ({', '.join(actual)})")
            continue
        dtype = pb2.DataType.Name(t.data_type)
        if dtype != graph.data_type:
            problems.append(f"{where}: {side} {t.name!r} is {dtype} in config.pbtxt, {graph.data_type} in the graph")
        dims = batch + _shape(t)
        if dims != graph.dims:
            problems.append(f"{where}: {side} {t.name!r} has dims {list(dims)} in config.pbtxt, "
                            f"{list(graph.dims)} in the graph")


def _check_specrt(name: str, cfg, folder: Path, versions: list[str], problems: list[str]) -> None:
    """The Python model that owns a specrt engine: decoupled (it streams), its artifact and I/O in place."""
    from tritonclient.grpc import model_config_pb2 as pb2

    if not cfg.model_transaction_policy.decoupled:
        problems.append(f"{name}: the specrt model streams; set model_transaction_policy {{ decoupled: true }}")
    artifact = cfg.parameters["artifact"].string_value
    try:  # what model.py's initialize parses, with the same function
        engine_settings({k: p.string_value for k, p in cfg.parameters.items()})
    except SpecrtError as e:
        problems.append(f"{name}: {e}; model.py could not load")
    for v in versions:
        if not (folder / v / artifact / "manifest.json").is_file():
            problems.append(f"{name}/{v}/{artifact}: no specrt artifact (manifest.json) there")
    for side, want, declared in (("input", PYTHON_INPUTS, cfg.input), ("output", PYTHON_OUTPUTS, cfg.output)):
        have = {t.name: pb2.DataType.Name(t.data_type) for t in declared}
        for t in want:
            if t.name not in have:
                problems.append(f"{name}: {side} {t.name!r} ({t.data_type}) is missing; model.py uses it")
            elif have[t.name] != t.data_type:
                problems.append(f"{name}: {side} {t.name!r} is {have[t.name]}, model.py uses {t.data_type}")
