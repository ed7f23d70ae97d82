"""Which folders of specrt may import which: the directions that hold today, checked on every source file.

import-linter (grimp) cannot see this layout: the folders are mapped into `specrt.*` by setuptools' package-dir,
so `specrt.runtime` is not a directory under `specrt/` and grimp reports it missing. This test reads each file's
imports (module level and inside functions) with `ast` instead. The rules are the downward directions already
true; the ones still broken (exporter <-> runtime, exporter <-> distill, exporter <-> configs) are the open part
of the "one direction" issue. specrt/ holds the bottom layer (the artifact contract, the model config, errors),
which imports no other folder, and the CLI on top.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("specrt", "exporter", "runtime", "serve", "distill", "tools", "configs", "plugins", "datasets")
FORBIDDEN = {  # folder -> folders it must never import
    "runtime": {"tools", "serve", "distill", "configs", "cli"},
    "tools": {"serve", "distill", "configs", "cli"},
    "serve": {"tools", "distill", "cli"},
    "exporter": {"tools", "serve", "cli"},
    "distill": {"tools", "serve", "cli"},
    "configs": {"tools", "serve", "cli"},
    "plugins": {"exporter", "runtime", "tools", "serve", "distill", "configs", "cli"},
}


def _target(module: str) -> str | None:
    """The folder (or `cli`) a `specrt.*` module lives in."""
    parts = module.split(".")
    if parts[0] != "specrt" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FOLDERS or parts[1] == "cli" else "specrt"


def imports(folder: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Per source file of `folder`, the folders its `specrt.*` imports reach."""
    found = {}
    for path in sorted((root / folder).rglob("*.py")):
        reached = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            reached |= {t for t in map(_target, names) if t is not None}
        found[str(path.relative_to(root))] = reached
    return found


def test_the_contract_layer_imports_nothing_above_it():
    bottom = {f: sorted(reached - {"specrt"}) for f, reached in imports("specrt").items()
              if f != "specrt/cli.py" and reached - {"specrt"}}
    assert not bottom, f"specrt/ (but cli.py) must import no other folder: {bottom}"


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_point_downward(folder):
    bad = {f: sorted(reached & FORBIDDEN[folder]) for f, reached in imports(folder).items()
           if reached & FORBIDDEN[folder]}
    assert not bad, f"{folder}/ must not import {sorted(FORBIDDEN[folder])}: {bad}"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """A function-level import counts too (how the cycles of the past were written), in every import form."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "x.py").write_text("import numpy\nfrom specrt.errors import SpecrtError\n"
                                               "def f():\n    from specrt.tools import bench\n"
                                               "    import specrt.serve.app\n    from specrt import cli\n")
    assert imports("runtime", tmp_path) == {"runtime/x.py": {"specrt", "tools", "serve", "cli"}}
