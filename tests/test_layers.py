"""specrt's layers import downward only, checked by import-linter's `layers` contract (pyproject.toml).

The folders are mapped into `specrt.*` by setuptools' package-dir, a layout import-linter's graph builder (grimp)
cannot walk: `specrt.runtime` is not a directory under `specrt/`. So the test lays the mapped folders out as the
one package an installed wheel holds (every .py file, copied to `specrt/<subpackage>/...` in a temporary folder) and
runs `lint-imports` on that copy with the project's contract. grimp reads every import statement, including those
inside functions.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lay_out(dest: Path) -> Path:
    """Copy every mapped folder's sources into dest/specrt/... as pyproject's package-dir maps them."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            out = dest.joinpath(*package.split("."), path.relative_to(ROOT / folder))
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out)
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT), str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layers_import_downward(tmp_path):
    r = _lint(_lay_out(tmp_path))
    assert r.returncode == 0 and "1 kept, 0 broken" in r.stdout, r.stdout + r.stderr
    analysed = int(r.stdout.split("Analyzed ")[1].split()[0])
    assert analysed == len(list(tmp_path.rglob("*.py")))  # every source file was seen (none hidden by the layout)


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path):
    """The check can fail: the runtime importing the CLI in a function body is reported, with the line."""
    tree = _lay_out(tmp_path)
    engine = tree / "specrt" / "runtime" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _upward():\n    from specrt.cli import main\n    return main\n")
    r = _lint(tree)
    assert r.returncode != 0 and "BROKEN" in r.stdout and "specrt.runtime.engine -> specrt.cli" in r.stdout, r.stdout
