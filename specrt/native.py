"""specrt's native code, carried by the package in specrt/_native (compiled from runtime/cpp when specrt is built:
setup.py): libspecrt_ops, the ONNX Runtime kernels that graphs exported with `specrt export --kernels specrt` need
(their specrt::MatMulGGUF, GatherGGUF, RMSNorm, SkipRMSNorm, CacheAttention and PackedAttention nodes); libspecrt,
the C runtime; specrt-cpp, its example program. $SPECRT_OPS_LIB and $SPECRT_CPP_LIB override the library paths.

Where the build made nothing (no cmake or compiler, SPECRT_NATIVE=off), _native/build.json says why, and
`kernels_line` is what every command that runs a graph prints about it.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.kernels.ops import DOMAIN, KERNEL_OPS

ENV = "SPECRT_OPS_LIB"
REBUILD = "reinstall specrt where cmake and g++ are installed (`pip install 'specrt[cpu]'`, or `pip install .` in a clone)"
# what ONNX Runtime's stock kernels cost, measured (docs/kernels.md): said wherever they run in place of specrt's
STOCK_COST = ("ONNX Runtime's stock ones, which decoded about half as fast as specrt's where both were measured (an "
              "AVX2 EPYC) and, on AVX2-only CPUs, can give a verified token other bits than decoding gives it (greedy "
              "speculative output may then differ from plain decoding's)")


def native_dir() -> Path:
    """specrt/_native of this install (the source tree's, for an editable one)."""
    return Path(__file__).resolve().parent / "_native"


def build_record() -> dict:
    """What the build of this install made: {"built": true, ...} or {"built": false, "reason": ...}."""
    try:
        return json.loads((native_dir() / "build.json").read_text())
    except (OSError, ValueError):
        return {"built": False, "reason": "this specrt was not installed by pip (no specrt/_native/build.json): "
                                          "`pip install -e .` in the clone builds it"}


def _packaged(name: str, env: str | None, what: str) -> Path:
    given = os.environ.get(env) if env else None
    if given:
        if not Path(given).is_file():
            raise SpecrtError(f"${env} names {given}, which is not a file ({name})")
        return Path(given)
    path = native_dir() / name
    if path.is_file():
        return path
    record = build_record()
    why = record.get("reason") or f"{path} is missing"
    raise SpecrtError(f"{what}: {name} is not in this install ({why}): {REBUILD}" + (f", or set ${env}" if env else ""))


def ops_library(needed_by: str = "this artifact") -> Path:
    """libspecrt_ops: $SPECRT_OPS_LIB, else the package's; a SpecrtError naming the fix, also for a file that is not
    the library (which ONNX Runtime would refuse with a traceback)."""
    path = _packaged("libspecrt_ops.so", ENV, f"{needed_by} runs on specrt's CPU kernels (exported with --kernels "
                                              "specrt)")
    _isa(str(path))
    return path


def check_ops_library(path: Path) -> str:
    """The instruction set specrt's kernels library at `path` picks here; a SpecrtError when `path` is not a file or
    not that library."""
    if not path.is_file():
        raise SpecrtError(f"{path} is not a file (libspecrt_ops.so)")
    return _isa(str(path))


@functools.cache
def _isa(path: str) -> str:
    """The instruction set the library at `path` picks on this CPU (loading it once, as ONNX Runtime will)."""
    try:
        lib = ctypes.CDLL(path)
        lib.specrt_ops_isa.restype = ctypes.c_char_p
        return lib.specrt_ops_isa().decode()
    except (OSError, AttributeError) as e:
        raise SpecrtError(f"{path} is not specrt's kernels library (libspecrt_ops.so): "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def cpp_library() -> Path:
    """libspecrt: $SPECRT_CPP_LIB, else the package's."""
    return _packaged("libspecrt.so", "SPECRT_CPP_LIB", "specrt's C runtime")


def cpp_program() -> Path:
    """specrt-cpp, the C runtime's example program."""
    return _packaged("specrt-cpp", None, "the C runtime's example program")


def onnxruntime_library() -> Path | None:
    """The onnxruntime wheel's libonnxruntime.so.1.* (what libspecrt loads; found without importing onnxruntime)."""
    spec = importlib.util.find_spec("onnxruntime")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted((Path(folder) / "capi").glob("libonnxruntime.so.1*"))
        if found:
            return found[0]
    return None


def cpp_environ() -> dict:
    """This process's environment, in which libspecrt finds this Python's ONNX Runtime ($SPECRT_ONNXRUNTIME_LIB)."""
    env = dict(os.environ)
    lib = onnxruntime_library()
    if lib and not env.get("SPECRT_ONNXRUNTIME_LIB"):
        env["SPECRT_ONNXRUNTIME_LIB"] = str(lib)
    return env


def specrt_cpp() -> None:
    """The `specrt-cpp` command: runs the packaged program with this environment's ONNX Runtime."""
    import sys

    try:
        program = cpp_program()
    except SpecrtError as e:
        sys.exit(f"specrt-cpp: error: {e}")
    os.execve(program, [str(program), *sys.argv[1:]], cpp_environ())


@dataclass(frozen=True)
class Kernels:
    """The kernels library this install has: its path and the instruction set it picks on this CPU, or why none."""
    path: Path | None
    isa: str | None
    reason: str | None  # why there is no library (None when there is one)


def kernels() -> Kernels:
    """This install's kernels library and its instruction set here, or why there is none (a bad $SPECRT_OPS_LIB is a
    SpecrtError, not an absence)."""
    if not os.environ.get(ENV) and not (native_dir() / "libspecrt_ops.so").is_file():
        return Kernels(None, None, build_record().get("reason") or "libspecrt_ops.so is missing")
    path = ops_library()
    return Kernels(path, _isa(str(path)), None)


def available() -> bool:
    return kernels().path is not None


def kernels_line(artifact_kernels: str) -> str:
    """What a command running a graph says about its kernels: specrt's (where, which instruction set), or the stock
    ones, why, and what that costs."""
    k = kernels()
    if artifact_kernels == "specrt":
        if k.path is None:  # the engine's session fails with ops_library's error; say it first
            return f"kernels: specrt's, which this install does not have ({k.reason})"
        return f"kernels: specrt's ({k.isa}; {k.path})"
    why = (f"this install has no libspecrt_ops: {k.reason}" if k.path is None
           else "the artifact was exported for them; --kernels specrt needs a GGUF's blocks: docs/cli.md")
    return f"kernels: {STOCK_COST} ({why})"


def uses_kernels(nodes) -> bool:
    """Whether a graph's nodes (onnx NodeProtos) include an operator of the library."""
    return any(n.domain == DOMAIN and n.op_type in KERNEL_OPS for n in nodes)
