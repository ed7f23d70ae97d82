"""`specrt doctor`: what this install has, one line each (`--json` for bug reports)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import click

from specrt import native
from specrt.errors import SpecrtError

# the instruction sets the kernels choose among (ops/gguf_kernels.cpp), as /proc/cpuinfo names their flags
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8")


# what each of the kernels' instruction sets needs of the CPU
ISAS = (("avx2", ("avx2", "fma")), ("avx512-vnni", ("avx512bw", "avx512vl", "avx512_vnni")), ("amx", ("amx_tile", "amx_int8")))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu() -> dict:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": "?", "flags": []}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", "?"), "cores": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags]}


def _install() -> dict:
    dist = importlib.metadata.distribution("specrt")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    editable = bool(direct.get("dir_info", {}).get("editable"))
    return {"version": dist.version, "package": str(native.native_dir().parent),
            "kind": "editable" if editable else "installed"}


def _kernels() -> dict:
    record = native.build_record()
    try:
        k = native.kernels()
    except SpecrtError as e:  # $SPECRT_OPS_LIB names something else
        return {"path": None, "isa": None, "problem": str(e), "build": record}
    out = {"path": str(k.path) if k.path else None, "isa": k.isa, "build": record}
    if k.path is None:
        out["problem"] = f"none ({k.reason}); artifacts run on {native.STOCK_COST}"
    elif os.environ.get(native.ENV):
        out["override"] = f"${native.ENV}"
    return out


def _cpp() -> dict:
    out = {"native": str(native.native_dir())}
    for name, find in (("libspecrt", native.cpp_library), ("specrt-cpp", native.cpp_program)):
        try:
            out[name] = str(find())
        except SpecrtError:
            out[name] = None
    lib = native.onnxruntime_library()
    out["onnxruntime_library"] = str(lib) if lib else None
    return out


def _onnxruntime() -> dict:
    if importlib.util.find_spec("onnxruntime") is None:
        return {"version": None, "problem": "not installed: pip install 'specrt[cpu]' (or [gpu]) to run artifacts"}
    import onnxruntime as ort

    return {"version": ort.__version__, "providers": ort.get_available_providers()}


def _torch() -> dict:
    if importlib.util.find_spec("torch") is None:
        return {"version": None, "note": "not installed (the [export] extra: export, distill, the torch backend)"}
    import torch

    cuda = torch.cuda.is_available()
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}


def _triton() -> dict:
    out = {"tritonclient": _version("tritonclient"), "nvidia-pytriton": _version("nvidia-pytriton")}
    spec = importlib.util.find_spec("pytriton")
    if spec and spec.origin:
        server = Path(spec.origin).parent / "tritonserver" / "bin" / "tritonserver"
        out["tritonserver"] = str(server) if server.is_file() else None
    return out


def _cache() -> dict:
    from specrt.configs.fetch import MODEL_FILENAME, cache_dir

    root = cache_dir()
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
    return {"path": str(root), "mb": round(size / 1e6, 1),
            "default_model": (root / "models" / MODEL_FILENAME).is_file()}


def report() -> dict:
    return {"specrt": _install(), "cpu": _cpu(), "kernels": _kernels(), "cpp": _cpp(), "onnxruntime": _onnxruntime(),
            "torch": _torch(), "tensorrt": {"version": _version("tensorrt")}, "triton": _triton(),
            "baselines": {"llama-cpp-python": _version("llama_cpp_python"), "openvino-genai": _version("openvino-genai"),
                          "transformers": _version("transformers")},
            "cache": _cache()}


def _lines(r: dict) -> list[str]:
    k, cpp, ort, t, tri, c = r["kernels"], r["cpp"], r["onnxruntime"], r["torch"], r["triton"], r["cache"]
    build = k["build"]
    built = (f"built with {build.get('compiler', '?')}" if build.get("built") else f"not built: {build.get('reason')}")
    lines = [
        f"specrt     {r['specrt']['version']} ({r['specrt']['kind']}) at {r['specrt']['package']}",
        f"cpu        {r['cpu']['model']}, {r['cpu'].get('cores')} cores: "
        + ", ".join(f"{isa} {'yes' if all(f in r['cpu']['flags'] for f in flags) else 'no'}" for isa, flags in ISAS),
        (f"kernels    specrt's, {k['isa']} on this CPU: {k['path']}" + (f" ({k['override']})" if k.get("override") else "")
         if k["path"] else f"kernels    {k['problem']}"),
        f"native     {built}",
        f"c runtime  libspecrt {cpp['libspecrt'] or 'missing'}; specrt-cpp {cpp['specrt-cpp'] or 'missing'}; "
        f"ONNX Runtime library {cpp['onnxruntime_library'] or 'missing (pip install onnxruntime)'}",
        (f"onnxruntime {ort['version']}, providers {', '.join(ort['providers'])}" if ort["version"]
         else f"onnxruntime {ort['problem']}"),
        (f"torch      {t['version']}, CUDA {t['cuda'] or 'none'}"
         + (f": {', '.join(t['devices'])}" if t.get("devices") else " (no GPU visible)") if t["version"]
         else f"torch      {t['note']}"),
        f"tensorrt   {r['tensorrt']['version'] or 'not installed (the [gpu] extra)'}",
        (f"triton     server {tri['tritonserver']} (nvidia-pytriton {tri['nvidia-pytriton']})" if tri.get("tritonserver")
         else "triton     no server (pip install 'specrt[cpu,triton-server]' in a venv of its own)")
        + f"; client {tri['tritonclient'] or 'not installed'}",
        "baselines  " + ", ".join(f"{n} {v or 'not installed'}" for n, v in r["baselines"].items()),
        f"cache      {c['path']} ({c['mb']} MB; default model {'present' if c['default_model'] else 'not fetched yet'})",
    ]
    return lines


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for bug reports).")
def doctor(as_json: bool) -> None:
    """What this install has: specrt's kernels (path, the instruction set chosen, what the CPU offers), the C runtime,
    ONNX Runtime, torch / CUDA / TensorRT, the Triton server, the bench's baselines, the model cache."""
    r = report()
    if as_json:
        click.echo(json.dumps(r))
        return
    for line in _lines(r):
        click.echo(line)
