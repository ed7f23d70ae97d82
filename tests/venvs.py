"""Fresh virtual environments with specrt installed from this checkout, for the tests of what a user installs."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def make_venv(where: Path, extras: str, lock: Path) -> Path:
    """A new venv at `where` (this interpreter's Python) with `pip install -c LOCK -e ROOT[extras]` (editable: the
    same sources as the suite), through uv where the test extra installed it (seconds from its cache, where pip
    takes most of a minute); returns its bin folder. A failed install fails the test with the installer's last
    lines."""
    bin_dir = where / "bin"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(where)], check=True)
        cmd = [uv, "pip", "install", "-q", "--python", str(bin_dir / "python"), "-c", str(lock),
               "-e", f"{ROOT}[{extras}]"]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        cmd = [str(bin_dir / "pip"), "install", "-q", "--disable-pip-version-check", "-c", str(lock),
               "-e", f"{ROOT}[{extras}]"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        tail = "\n".join(line for line in (r.stdout + r.stderr).splitlines() if "WARNING: Location" not in line)[-2000:]
        pytest.fail(f"{Path(cmd[0]).name} install -e '.[{extras}]' into a fresh venv failed:\n{tail}")
    return bin_dir


def site_packages_mb(venv: Path) -> float:
    """The size of a venv's installed packages, in MB."""
    sp = next((venv / "lib").glob("python3*/site-packages"))
    return sum(p.stat().st_size for p in sp.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6
