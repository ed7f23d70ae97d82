"""`specrt triton ART --out REPO --serve`: a real Triton Inference Server on the CPU, from the `nvidia-pytriton` wheel.

The wheel (`pip install 'specrt[triton-server]'`) bundles what a server needs, laid out for PyTriton's own launcher:

    pytriton/tritonserver/bin/tritonserver                    the server
    pytriton/tritonserver/backends/python/                    the Python backend (libtriton_python.so, its utils)
    pytriton/tritonserver/python_backend_stubs/3.X/...stub    the backend's stub process, one per Python version
    nvidia_pytriton.libs/                                     the shared libraries they link

Started by hand it needs four things this module supplies: the libraries on LD_LIBRARY_PATH (with this Python's
own libdir: the stub embeds libpython), a backend folder whose `python/` holds the stub for this Python, explicit
model control so only the `specrt` model loads (the wheel has no onnxruntime backend for the debugging models), and
a Python environment for the stub. The stub's interpreter ignores PYTHONPATH and virtual environments (its sys.path
is the base interpreter's), so the repository's model.py adds the environment `specrt triton` ran in
(`specrt_env.json`, written beside it) before it imports specrt; numpy there must be 1.x, see docs/serving.md.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError

READY_TIMEOUT_S = 300.0  # loading the model exports nothing; a large artifact's graphs take a while to load


@dataclass(frozen=True)
class Bundle:
    """Where the wheel put the server, its backends, the stubs and the libraries."""

    server: Path
    backends: Path
    stubs: Path
    libs: Path
    version: str  # the wheel's version (nvidia-pytriton)


def bundle() -> Bundle:
    """The server `nvidia-pytriton` installed in this environment, or a one-line error naming the extra."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise SpecrtError("--serve needs the Triton server that the nvidia-pytriton wheel bundles: "
                          "pip install 'specrt[triton-server]' (x86-64 Linux, glibc >= 2.35)")
    root = Path(spec.origin).parent / "tritonserver"
    found = Bundle(root / "bin" / "tritonserver", root / "backends", root / "python_backend_stubs",
                   Path(spec.origin).parent.parent / "nvidia_pytriton.libs",
                   importlib.metadata.version("nvidia-pytriton"))
    missing = [p for p in (found.server, found.backends / "python", found.stubs) if not p.exists()]
    if missing:
        raise SpecrtError(f"nvidia-pytriton {found.version} has no {missing[0]} (a broken install? reinstall it)")
    return found


def backend_folder(b: Bundle, work: Path) -> Path:
    """A backends folder for `--backend-directory`: the wheel's backends, with this Python's stub in `python/`."""
    stub = b.stubs / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
    if not stub.is_file():
        have = ", ".join(sorted(p.name for p in b.stubs.iterdir()))
        raise SpecrtError(f"nvidia-pytriton {b.version} has no Python backend stub for Python "
                          f"{sys.version_info.major}.{sys.version_info.minor} (it has {have})")
    out = work / "backends"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(b.backends, out, symlinks=True)
    shutil.copy2(stub, out / "python" / stub.name)
    return out


def environment(b: Bundle) -> dict[str, str]:
    """The server's environment: the bundled libraries and this Python's libdir on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = [str(b.libs), libdir, env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in paths if p)
    return env


def command(b: Bundle, repo: Path, backends: Path, *, http_port: int, grpc_port: int, metrics_port: int,
            models: list[str], address: str = "127.0.0.1", verbose: int = 0) -> list[str]:
    argv = [str(b.server), f"--model-repository={repo}", f"--backend-directory={backends}",
            f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}",
            f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
            "--model-control-mode=explicit", "--allow-metrics=true", "--allow-gpu-metrics=false",
            f"--log-verbose={verbose}"]
    return argv + [f"--load-model={m}" for m in models]


def check_environment() -> None:
    """The stub imports this environment's numpy (model.py adds it): the bundled stub needs numpy < 2."""
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise SpecrtError(f"--serve runs Triton's Python backend in this environment, whose numpy {numpy.__version__} "
                          "the bundled stub cannot use (it was built for NumPy 1: BYTES inputs would crash it); "
                          "install into an environment with numpy<2: pip install 'specrt[cpu,triton-server]'")


def start(repo: str | Path, work: str | Path, *, http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, models: tuple[str, ...] = ("specrt",), address: str = "127.0.0.1",
          log: Path | None = None) -> subprocess.Popen:
    """Start tritonserver on `repo` (backends prepared under `work`); returns the process once the server reports
    ready, or raises with the log's last lines if it exits or stays unready."""
    b = bundle()
    repo, work = Path(repo).resolve(), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    backends = backend_folder(b, work)
    argv = command(b, repo, backends, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                   models=list(models), address=address)
    log = log or work / "tritonserver.log"
    out = open(log, "ab")
    proc = subprocess.Popen(argv, env=environment(b), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    deadline = time.monotonic() + READY_TIMEOUT_S
    url = f"http://{address}:{http_port}/v2/health/ready"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SpecrtError(f"tritonserver exited with {proc.returncode} before it was ready: {log_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SpecrtError(f"tritonserver was not ready within {READY_TIMEOUT_S:.0f} s: {log_tail(log)}")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop the server and its stub processes (SIGTERM to its process group, then SIGKILL after `timeout`)."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stubs left behind
    except ProcessLookupError:
        pass
    proc.wait()


def log_tail(log: Path, lines: int = 6) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    errors = [x for x in text if x.startswith("E") or "error" in x.lower()]
    return " | ".join((errors or text)[-lines:])
