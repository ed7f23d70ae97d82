"""specrt's layers import downward only, checked by import-linter's `layers` contract (pyproject.toml), run on the
checkout as it is: the source tree is the package tree (specrt/...), so any tool that follows imports finds the file
an import names. grimp reads every import statement, including those inside functions.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layers_import_downward(tmp_path):
    r = _lint(ROOT, tmp_path)
    assert r.returncode == 0 and "1 kept, 0 broken" in r.stdout, r.stdout + r.stderr
    analysed = int(r.stdout.split("Analyzed ")[1].split()[0])
    assert analysed == len(list((ROOT / "specrt").rglob("*.py")))  # every source file was seen


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path):
    """The check can fail: the runtime importing the CLI in a function body is reported, with the line."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "specrt", tree / "specrt", ignore=shutil.ignore_patterns("_native", "__pycache__"))
    engine = tree / "specrt" / "runtime" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _upward():\n    from specrt.cli import main\n    return main\n")
    r = _lint(tree, tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout and "specrt.runtime.engine -> specrt.cli" in r.stdout, r.stdout
