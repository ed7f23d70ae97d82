"""Fresh virtual environments with specrt installed from this checkout, for the tests of what a user installs: from
the wheel `pip wheel .` builds (as a user installs it) or editable."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def build_wheel(out: Path) -> Path:
    """`pip wheel --no-deps .` of this checkout into `out` (its native code compiled by setup.py, reusing build/cpp);
    made once per test run however many workers ask (a lock beside `out`)."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    (ROOT / "build").mkdir(exist_ok=True)
    with open(ROOT / "build" / "pip-wheel.lock", "w") as lock:  # one in-tree build at a time (setuptools' build/)
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(out.glob("specrt-*.whl"))
        if found:
            return found[0]
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                            str(ROOT), "-w", str(out)], capture_output=True, text=True, timeout=1800)
        if r.returncode:
            pytest.fail(f"pip wheel . failed:\n{_tail(r)}")
        return sorted(out.glob("specrt-*.whl"))[0]


def _tail(r: subprocess.CompletedProcess) -> str:
    return "\n".join(line for line in (r.stdout + r.stderr).splitlines() if "WARNING: Location" not in line)[-2000:]


def make_venv(where: Path, extras: str, lock: Path, wheel: Path | None = None) -> Path:
    """A new venv at `where` (this interpreter's Python) with specrt[extras] pinned by `lock`: from `wheel`
    (non-editable, as a user installs it) or else `-e ROOT` (editable: the same sources as the suite), through uv
    where the test extra installed it (seconds from its cache, where pip takes most of a minute); returns its bin
    folder. A failed install fails the test with the installer's last lines."""
    bin_dir = where / "bin"
    target = [f"specrt[{extras}] @ {wheel.as_uri()}"] if wheel else ["-e", f"{ROOT}[{extras}]"]
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(where)], check=True)
        cmd = [uv, "pip", "install", "-q", "--python", str(bin_dir / "python"), "-c", str(lock), *target]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        cmd = [str(bin_dir / "pip"), "install", "-q", "--disable-pip-version-check", "-c", str(lock), *target]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        pytest.fail(f"{Path(cmd[0]).name} install {' '.join(target)} into a fresh venv failed:\n{_tail(r)}")
    return bin_dir


def site_packages_mb(venv: Path) -> float:
    """The size of a venv's installed packages, in MB."""
    sp = next((venv / "lib").glob("python3*/site-packages"))
    return sum(p.stat().st_size for p in sp.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6
