"""Building runtime/cpp: what `pip install` (setup.py) and the test suite (tests/conftest.py) both run.

    headers()  ONNX Runtime's C/C++ API, nlohmann-json and PCRE2's headers: $SPECRT_CPP_DEPS if set, else fetched
               once by scripts/cpp_deps.sh (Debian's archive, checksummed) into $SPECRT_CACHE/cpp-deps
    build()    cmake configure + build of the named targets into a build folder, one builder at a time

A plain module with no specrt imports: setup.py loads it by path before specrt is installed.
"""
from __future__ import annotations

import fcntl
import os
import platform
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "runtime" / "cpp"
# what the package carries (setup.py copies them into specrt/_native)
FILES = {"specrt_ops": "libspecrt_ops.so", "specrt": "libspecrt.so", "specrt-cpp": "specrt-cpp"}  # target: file
PACKAGED = tuple(FILES)


class Unbuildable(Exception):
    """This machine lacks something the build needs (a tool, the headers); the message names it and the fix."""


def missing_tools() -> str | None:
    """Why runtime/cpp cannot be built here, or None."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"specrt's kernels are x86-64 Linux code (this is {sys.platform} {platform.machine()})"
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not _compiler():
        missing.append("a C++ compiler (g++)")
    if missing:
        return f"{' and '.join(missing)} not found (Debian/Ubuntu: apt-get install cmake g++)"
    return None


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cache_dir() -> Path:
    """specrt's cache, as specrt/configs/fetch.py has it (this module imports nothing of specrt)."""
    return Path(os.environ.get("SPECRT_CACHE") or Path.home() / ".cache" / "specrt").expanduser()


@contextmanager
def _locked(path: Path):
    """One builder at a time per folder (parallel test workers, a test's venv install beside the suite's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def headers() -> Path:
    """The folder whose include/ holds the headers the build needs (fetched once)."""
    given = os.environ.get("SPECRT_CPP_DEPS")
    if given:
        if not (Path(given) / "include" / "onnxruntime" / "onnxruntime_cxx_api.h").is_file():
            raise Unbuildable(f"$SPECRT_CPP_DEPS ({given}) has no include/onnxruntime/onnxruntime_cxx_api.h")
        return Path(given)
    dest = cache_dir() / "cpp-deps"
    missing = [t for t in ("apt-get", "dpkg-deb", "dpkg-query") if shutil.which(t) is None]
    if missing and not (dest / "include" / "pcre2.h").is_file():
        raise Unbuildable(f"{', '.join(missing)} not found: ONNX Runtime's headers come from Debian's archive "
                          "(scripts/cpp_deps.sh); on other systems set $SPECRT_CPP_DEPS to a folder with "
                          "include/onnxruntime/, include/nlohmann/json.hpp and include/pcre2.h")
    with _locked(dest):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "cpp_deps.sh"), str(dest)], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unbuildable(f"fetching ONNX Runtime's headers failed (scripts/cpp_deps.sh): {tail[0]}")
    return dest


def build(build_dir: Path, targets: tuple[str, ...] | None = None, *, sanitize: bool = False,
          python: str | None = None, jobs: int | None = None, log=None) -> Path:
    """Configure and build runtime/cpp into `build_dir` (all targets, or `targets`); returns `build_dir`.
    Raises Unbuildable when a tool or the headers are missing, CalledProcessError when compiling fails."""
    why = missing_tools()
    if why:
        raise Unbuildable(why)
    deps = headers()
    jobs = jobs or os.cpu_count() or 2
    configure = ["cmake", "-S", str(SOURCE), "-B", str(build_dir), f"-DSPECRT_DEPS={deps}",
                 f"-DPython3_EXECUTABLE={python or sys.executable}", f"-DSPECRT_SANITIZE={'ON' if sanitize else 'OFF'}"]
    make = ["cmake", "--build", str(build_dir), "-j", str(jobs)] + (["--target", *targets] if targets else [])
    with _locked(build_dir):
        _forget_other_source(build_dir)
        for cmd in (configure, make):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if log:
                log(r.stdout + r.stderr)
            if r.returncode:
                raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
    return build_dir


def _forget_other_source(build_dir: Path) -> None:
    """A build folder configured from another source folder (a checkout that moved) is cleared: CMake refuses to
    reuse it."""
    cache = build_dir / "CMakeCache.txt"
    try:
        home = next((line.split("=", 1)[1] for line in cache.read_text().splitlines()
                     if line.startswith("CMAKE_HOME_DIRECTORY:")), None)
    except OSError:
        return
    if home and Path(home).resolve() != SOURCE.resolve():
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
        cache.unlink()


def versions() -> dict[str, str]:
    """The tools a build used, for the package's build record."""
    def first_line(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            return "?"
    return {"cmake": first_line(["cmake", "--version"]), "compiler": first_line([_compiler() or "c++", "--version"])}
