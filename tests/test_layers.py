"""specrt's layers import downward only, checked by import-linter's `layers` contract (pyproject.toml).

The design card's top-level folders are linked into the package (specrt/runtime -> ../runtime, ...), so the checkout
is the package tree: `lint-imports` runs in it as it is, and grimp, which reads every import statement (those inside
functions too), walks the same files an installed wheel holds.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _sources(tree: Path) -> list[Path]:
    """Every .py file of the package under tree/specrt, through its links."""
    return [Path(d, f) for d, _, files in os.walk(tree / "specrt", followlinks=True) for f in files
            if f.endswith(".py")]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layers_import_downward_in_the_checkout():
    r = _lint(ROOT)
    assert r.returncode == 0 and "1 kept, 0 broken" in r.stdout, r.stdout + r.stderr
    analysed = int(r.stdout.split("Analyzed ")[1].split()[0])
    assert analysed == len(_sources(ROOT))  # every source file was seen (none hidden behind a link)


def test_the_checkout_imports_as_it_installs():
    """`from specrt.runtime.engine import Engine` in the checkout lands on runtime/engine.py."""
    code = "import specrt.runtime.engine as m, specrt.cli as c; print(m.__file__); print(c.__file__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    engine, cli = (Path(line).resolve() for line in r.stdout.split())
    assert (engine, cli) == (ROOT / "runtime" / "engine.py", ROOT / "cli" / "__init__.py"), r.stderr


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path):
    """The check can fail: the runtime importing the CLI in a function body is reported, with the line (on a copy
    of the package, links resolved)."""
    shutil.copytree(ROOT / "specrt", tmp_path / "specrt", ignore=shutil.ignore_patterns("_native", "__pycache__"))
    engine = tmp_path / "specrt" / "runtime" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _upward():\n    from specrt.cli import main\n    return main\n")
    r = _lint(tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout and "specrt.runtime.engine -> specrt.cli" in r.stdout, r.stdout


SWITCHES = re.compile(
    r"isinstance\([^)]*(Drafter|Scheduler)\b"  # a drafter or scheduler recognised by its class
    r"|(==|!=|\bin \(|\bin \[)\s*[\"'](fixed|threshold|sps|sps-async)[\"']"  # ... or by its name
    r"|[\"'](fixed|threshold|sps|sps-async)[\"']\s*(==|!=)|startswith\([\"']sps"
    r"|\b(scheduler|scheduler_name|policy)(\.name)?\s*(==|!=|\bin )")


def _switches(folders: list[Path]) -> list[str]:
    return [f"{path}:{n}: {line.strip()}" for folder in folders for path in folder.rglob("*.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if SWITCHES.search(line)]


def test_nothing_on_the_engine_path_switches_on_drafter_or_scheduler_names_or_classes():
    """Plug-ins declare what a round needs (a drafter's `graph`, `picks`, `backlog_rounds`, `plan`; a scheduler's
    registry traits and `rule`): the runtime, the server and the CLI never ask which one they have."""
    assert _switches([ROOT / "runtime", ROOT / "serve", ROOT / "cli"]) == []


def test_the_switch_check_can_fail(tmp_path):
    (tmp_path / "round.py").write_text('if self.policy in ("sps", "sps-async"):\n    pass\n'
                                       'hybrid = isinstance(drafter, HybridDrafter)\n')
    assert len(_switches([tmp_path])) == 2
