"""specrt's build: the Python package (pyproject.toml) and its native code, compiled from runtime/cpp with CMake by
`pip install .`, `pip wheel .` and `pip install -e .` alike (scripts/native_build.py):

    specrt/_native/libspecrt_ops.so   the ONNX Runtime kernels graphs exported with --kernels specrt need
    specrt/_native/libspecrt.so       the C runtime (include/specrt.h) and specrt-cpp, its example program
    specrt/_native/include/           specrt.h, specrt.hpp
    specrt/_native/build.json         what was built with what, or why nothing was

Where cmake, a C++ compiler or the headers are missing, the package installs without them and build.json says why;
every command that runs a graph then says which kernels it runs and what that costs (specrt/native.py).
SPECRT_NATIVE=require makes that an install error instead; SPECRT_NATIVE=off skips the native build.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("specrt_native_build", ROOT / "scripts" / "native_build.py")
native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)


class BuildNative(build_ext):
    """Builds runtime/cpp (no Python extension: the package's shared libraries and program) into specrt/_native."""

    def run(self) -> None:
        editable = self.inplace or getattr(self, "editable_mode", False)
        out = (ROOT if editable else Path(self.build_lib)) / "specrt" / "_native"
        out.mkdir(parents=True, exist_ok=True)
        for f in out.iterdir():  # nothing stale from an earlier build
            shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()
        mode = os.environ.get("SPECRT_NATIVE", "auto")
        try:
            if mode == "off":
                raise native.Unbuildable("the native build was switched off (SPECRT_NATIVE=off)")
            native.build(ROOT / "build" / "cpp", native.PACKAGED, log=lambda text: print(text, file=sys.stderr))
        except native.Unbuildable as e:
            if mode == "require":
                sys.exit(f"specrt: cannot build specrt's kernels: {e}")
            record = {"built": False, "reason": str(e)}
            print(f"specrt: WARNING: installing without specrt's kernels and C runtime: {e}. Artifacts will run on "
                  "ONNX Runtime's stock kernels (`specrt doctor` says what that costs)", file=sys.stderr)
        except subprocess.CalledProcessError as e:
            tail = "\n".join((e.stdout + e.stderr).splitlines()[-40:])
            sys.exit(f"specrt: compiling runtime/cpp failed ({' '.join(e.cmd[:3])} ...):\n{tail}")
        else:
            # an editable install links to the build folder, so a rebuild there (cmake, the suite's) is what it runs
            place = (lambda src, dst: dst.symlink_to(src)) if editable else shutil.copy2
            for target in native.PACKAGED:
                place(ROOT / "build" / "cpp" / native.FILES[target], out / native.FILES[target])
            (out / "include").mkdir()
            for header in ("specrt.h", "specrt.hpp"):
                place(native.SOURCE / "include" / header, out / "include" / header)
            record = {"built": True, "files": [native.FILES[t] for t in native.PACKAGED], **native.versions()}
        (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
        self._outputs = [str(p) for p in out.rglob("*") if p.is_file()]

    def get_outputs(self) -> list[str]:
        return getattr(self, "_outputs", [])

    def get_output_mapping(self) -> dict[str, str]:  # editable: the files are in the source tree already
        return {}


class Wheel(bdist_wheel):
    """The wheel holds native code but no Python extension: any Python 3, this platform (py3-none-PLATFORM)."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(ext_modules=[Extension("specrt._native", sources=[])], cmdclass={"build_ext": BuildNative, "bdist_wheel": Wheel})
