"""`specrt build`: one TensorRT engine per graph family of an artifact, through Polygraphy's API.

    plan = build_plan(manifest)          # which graphs, one optimization profile per bucket (pure, tested here)
    build_engines(art, precision="fp16") # NetworkFromOnnxPath -> CreateConfig -> EngineFromNetwork -> SaveEngine

Every bucket is a fixed shape, so each profile has min = opt = max; the runtime gives each bucket its own execution
context bound to that profile (runtime/backends/tensorrt.py). KV caches are inputs `past.*` over the call's slots
(B) and the whole cache length; the engine writes `present.*` and the runner copies those rows back.
The DSpark graph's specrt::ConfidenceTruncate node resolves to the registered plugin (plugins/trt_confidence_
truncate.py): the ONNX local function that ONNX Runtime runs is removed from a copy of the graph first (TensorRT's
parser would inline it), and the build checks that a plugin layer produces the op's outputs.
Precision: an artifact exported in the asked precision builds strongly typed (the precision is in the ONNX, as
TensorRT 10+ prefers); a float32 artifact builds weakly typed with the fp16 / bf16 builder flag.
The engines and what built them (TensorRT version, GPU, options) are recorded in the manifest's `engines`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.outdir import note_written
from specrt.plugins.confidence_truncate import DOMAIN, OP
from specrt.plugins.tensorrt import require_tensorrt

PRECISIONS = {"fp16": "float16", "bf16": "bfloat16"}
ENGINE_DIR = io.ENGINE_DIR


@dataclass(frozen=True)
class Profile:
    """One optimization profile: a bucket's exact input shapes."""

    use: str
    bucket: io.Bucket
    shapes: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class EnginePlan:
    family: str
    onnx: str  # the family's graph file in the artifact
    engine: str  # where its engine goes, relative to the artifact
    profiles: tuple[Profile, ...]
    plugin: bool  # the graph holds specrt::ConfidenceTruncate


def input_shapes(spec: io.GraphSpec, bucket: io.Bucket) -> dict[str, tuple[int, ...]]:
    """Every input's shape at `bucket`: host inputs at its sizes, caches over its B slots and the whole length."""
    sizes = {**bucket, io.CACHE_LEN: spec.max_seq}
    return {t.name: t.resolve(sizes) for t in spec.inputs}


def build_plan(manifest: io.Manifest) -> list[EnginePlan]:
    """One engine per graph family, one profile per exported bucket (in the manifest's bucket order)."""
    plans = []
    for family, spec in manifest.graphs.items():
        profiles = tuple(Profile(use, dict(b), input_shapes(spec, b)) for use, bs in spec.buckets.items() for b in bs)
        plugin = any(o.name == io.SURVIVAL for o in spec.outputs)
        plans.append(EnginePlan(family, spec.file, f"{ENGINE_DIR}/{family}.plan", profiles, plugin))
    return plans


def without_local_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model minus the specrt::ConfidenceTruncate local function, so the node resolves to the plugin."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.functions[:]
    out.functions.extend(f for f in model.functions if not (f.domain == DOMAIN and f.name == OP))
    return out


def plugin_layers(network, trt) -> list[str]:
    """Names of the network's plugin layers that produce the op's outputs (the build-time check)."""
    kinds = {getattr(trt.LayerType, k) for k in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3") if hasattr(trt.LayerType, k)}
    found = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        outputs = {layer.get_output(j).name for j in range(layer.num_outputs)}
        if layer.type in kinds and io.SURVIVAL in outputs:
            found.append(layer.name)
    return found


def build_engines(art_dir: str | Path, *, precision: str = "fp16", workspace_gb: float | None = None,
                  progress: bool = True) -> dict[str, Any]:
    """Build every family's engine into ART/engines/ and record them in the manifest; returns that record."""
    if precision not in PRECISIONS:
        raise SpecrtError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if workspace_gb is not None and workspace_gb <= 0:
        raise SpecrtError(f"--workspace must be a positive number of GB, got {workspace_gb}")
    art = Path(art_dir)
    manifest = io.load_manifest(art)
    trt = require_tensorrt()
    import torch
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, SaveEngine
    from polygraphy.backend.trt import Profile as TrtProfile

    from specrt.plugins.trt_confidence_truncate import register_plugin

    register_plugin()
    strong = manifest.export.dtype == PRECISIONS[precision]
    (art / ENGINE_DIR).mkdir(exist_ok=True)
    record: dict[str, Any] = {"tensorrt": trt.__version__, "gpu": torch.cuda.get_device_name(),
                              "precision": precision, "workspace_gb": workspace_gb, "strongly_typed": strong,
                              "families": {}}
    for plan in build_plan(manifest):
        if progress:
            print(f"specrt build: {plan.family}: {len(plan.profiles)} profiles", flush=True)
        source = art / plan.onnx
        if plan.plugin:  # beside the original, so its external weights resolve; removed after the build
            source = art / f"{plan.family}.trt.onnx"
            onnx.save(without_local_function(onnx.load(str(art / plan.onnx), load_external_data=False)), str(source))
        try:
            builder, network, parser = NetworkFromOnnxPath(str(source), strongly_typed=strong)()
            if plan.plugin and not plugin_layers(network, trt):
                raise SpecrtError(f"{plan.family}: no plugin layer produces {io.SURVIVAL}; is the specrt "
                                  "ConfidenceTruncate plugin registered?")
            profiles = []
            for p in plan.profiles:
                prof = TrtProfile()
                for name, shape in p.shapes.items():
                    prof.add(name, min=shape, opt=shape, max=shape)
                profiles.append(prof)
            limits = {trt.MemoryPoolType.WORKSPACE: int(workspace_gb * (1 << 30))} if workspace_gb else None
            flags = {} if strong else {precision: True}
            config = CreateConfig(profiles=profiles, memory_pool_limits=limits, **flags)
            engine = EngineFromNetwork((builder, network, parser), config=config)
            target = art / plan.engine
            tmp = target.with_suffix(".plan.tmp")
            SaveEngine(engine, path=str(tmp))()
            os.replace(tmp, target)
        finally:
            if plan.plugin:
                source.unlink(missing_ok=True)
        record["families"][plan.family] = {"engine": plan.engine, "plugin": plan.plugin,
                                           "profiles": [{"use": p.use, **p.bucket} for p in plan.profiles]}
    tmp = art / (io.MANIFEST + ".tmp")
    tmp.write_text(dataclasses.replace(manifest, engines=record).to_json())
    os.replace(tmp, art / io.MANIFEST)
    note_written(art, *(f["engine"] for f in record["families"].values()))
    return record
