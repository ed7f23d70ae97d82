"""Every hostile artifact of tests/hostile_artifacts.py through both runtimes: `specrt run` (the Python engine) and
`specrt-cpp` (the C++ runtime, through its C API) refuse each with one line naming the problem and exit 1, within
seconds (a FIFO read or a spin would hang), never a crash."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hostile_artifacts import CASES, build
from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact
from test_cli import assert_one_line_error, cli_process

IDS = [c.id for c in CASES]


@pytest.fixture(scope="module")
def hostile(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    art = export_artifact(tiny_model_dir("llama"), root / "valid", ExportSettings(batch=2, max_seq=160, prefill_chunk=8,
                                                                                   verify_len=4), progress=False)
    return {c.id: build(c, art, root) for c in CASES} | {"valid": art}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_python_refuses(hostile, case):
    r = cli_process("run", hostile[case.id], "--input-ids", "5,6", "--max-new-tokens", "2", "--threads", "1")
    assert_one_line_error(r, *case.fragments)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpp_refuses(cpp_build, hostile, case):
    start = time.monotonic()
    r = subprocess.run([str(cpp_build / "specrt-cpp"), str(hostile[case.id]), "--input-ids", "5,6",
                        "--max-new-tokens", "2", "--threads", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specrt-cpp: "), r.stderr
    assert all(f in lines[0] for f in case.fragments), (case.fragments, lines[0])
    assert time.monotonic() - start < 30


def test_the_valid_artifact_runs_in_both(cpp_build, hostile):
    """The table's cases differ from an artifact both runtimes run only by their edit."""
    r = cli_process("run", hostile["valid"], "--input-ids", "5,6", "--max-new-tokens", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(cpp_build / "specrt-cpp"), str(hostile["valid"]), "--input-ids", "5,6",
                        "--max-new-tokens", "2", "--threads", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_threads_are_capped_at_the_cores(cpp_build, hostile):
    """100,000 threads asked for: both open the artifact at once (as many as there are cores), and decode."""
    for command in ([sys.executable, "-m", "specrt.cli", "run"], [str(cpp_build / "specrt-cpp")]):
        start = time.monotonic()
        r = subprocess.run([*command, str(hostile["valid"]), "--input-ids", "5,6", "--max-new-tokens", "2",
                            "--threads", "100000"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - start < 60, command
