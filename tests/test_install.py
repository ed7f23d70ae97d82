"""specrt installed as a user installs it: the wheel `pip wheel .` builds, installed non-editable with only the runtime
extra (`specrt[cpu]`, pinned by requirements/ci.lock) into a fresh venv. It carries specrt's kernels and C runtime:
`specrt run`, the Python API and the C API's example program (`specrt-cpp`) run the default model's artifact there
(exported with specrt's kernels), each with the tokens this suite's editable install gives, and never import torch,
transformers or matplotlib. A wheel built where the native code cannot be (SPECRT_NATIVE=off stands in for a machine
without cmake or g++) installs, and every command that runs a graph says which kernels it uses and why."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams

from venvs import ROOT, build_wheel, make_venv, site_packages_mb

pytestmark = pytest.mark.slow  # the default model's artifact (conftest's served_art)
HEAVY = ("torch", "transformers", "matplotlib", "fastapi", "uvicorn", "gguf", "safetensors", "accelerate")
PROMPT = "Why is the sky blue?"
SCRIPT = """
import json, sys
from specrt.cli import main
from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams
art = sys.argv[1]
with Engine(art, method="dspark+ngram", scheduler="sps", threads=1) as engine:
    ids = encode_prompt(engine.tokenizer, %r)
    outs, _ = engine.generate([Request(ids, SamplingParams(max_new_tokens=16))])
try:
    main(["run", art, "--prompt", %r, "--method", "dspark+ngram", "--max-new-tokens", "16",
          "--threads", "1", "--json"], standalone_mode=False)
except SystemExit as e:
    assert not e.code, e.code
import importlib.util
print(json.dumps({"ids": outs[0].output_ids, "modules": sorted({m.split(".")[0] for m in sys.modules}),
                  "installed": {m: importlib.util.find_spec(m) is not None for m in %r}}))
"""


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory, wheel):
    venv = tmp_path_factory.mktemp("runtime_install") / "venv"
    return venv, make_venv(venv, "cpu", ROOT / "requirements" / "ci.lock", wheel=wheel)


@pytest.fixture(scope="module")
def reference(served_art) -> tuple[list[int], list[int]]:
    """The prompt's ids and its 16 greedy tokens from this suite's (editable) install."""
    with Engine(served_art, method="ar", threads=1) as engine:
        ids = encode_prompt(engine.tokenizer, PROMPT)
        return ids, engine.generate([Request(ids, SamplingParams(max_new_tokens=16))])[0][0].output_ids


def _in(venv_bin, *args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv_bin / args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=600,
                          env=env, cwd=cwd)


def test_the_wheel_carries_its_native_code(wheel):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for f in ("libspecrt_ops.so", "libspecrt.so", "specrt-cpp", "build.json", "include/specrt.h"):
        assert f"specrt/_native/{f}" in names, f
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")  # native code, no Python extension


def test_the_runtime_install_runs_an_artifact_without_the_heavy_packages(runtime_venv, served_art, reference, tmp_path):
    venv, bin_dir = runtime_venv
    r = _in(bin_dir, "python", "-c", SCRIPT % (PROMPT, PROMPT, HEAVY), served_art, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    cli = json.loads(lines[-2])  # `specrt run --json`
    assert not any(report["installed"].values()), report["installed"]  # not even installed
    assert not set(HEAVY) & set(report["modules"])
    assert report["ids"] == reference[1] and cli["requests"][0]["output_ids"] == reference[1]
    # the kernels it ran on are the wheel's, and it said so
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert f"specrt: kernels: specrt's (" in r.stderr and str(site / "specrt" / "_native" / "libspecrt_ops.so") in r.stderr
    print(f"\nthe runtime install (specrt[cpu] from the wheel): {site_packages_mb(venv):.0f} MB of packages")


def test_the_c_api_example_from_the_wheel_gives_the_same_tokens(runtime_venv, served_art, reference, tmp_path):
    _, bin_dir = runtime_venv
    ids, want = reference
    r = _in(bin_dir, "specrt-cpp", served_art, "--input-ids", ",".join(map(str, ids)), "--max-new-tokens", "16",
            "--method", "dspark+ngram", "--threads", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["outputs"][0] == want


def test_doctor_reports_the_installed_kernels(runtime_venv, tmp_path):
    venv, bin_dir = runtime_venv
    r = _in(bin_dir, "specrt", "doctor", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert report["specrt"]["kind"] == "installed"
    assert report["kernels"]["path"] == str(site / "specrt" / "_native" / "libspecrt_ops.so")
    assert report["kernels"]["isa"] in ("scalar", "avx2", "avx512vnni", "amx") and report["kernels"]["build"]["built"]
    assert report["cpp"]["onnxruntime_library"].startswith(str(site / "onnxruntime"))
    assert report["torch"]["version"] is None  # the runtime extra alone
    text = _in(bin_dir, "specrt", "doctor", cwd=tmp_path).stdout
    assert text.splitlines()[2].startswith("kernels    specrt's, ")


@pytest.fixture(scope="module")
def pure_python_venv(tmp_path_factory):
    """A wheel built where the native build cannot run (SPECRT_NATIVE=off: what a machine without cmake or g++ gets),
    installed with the runtime extra."""
    work = tmp_path_factory.mktemp("no_native")
    env = {**os.environ, "SPECRT_NATIVE": "off"}
    old = os.environ.get("SPECRT_NATIVE")
    os.environ.update(env)
    try:
        wheel = build_wheel(work / "wheel")
    finally:
        os.environ.pop("SPECRT_NATIVE") if old is None else os.environ.update(SPECRT_NATIVE=old)
    return make_venv(work / "venv", "cpu", ROOT / "requirements" / "ci.lock", wheel=wheel)


def test_without_the_native_build_every_command_says_which_kernels_it_runs(pure_python_venv, served_art,
                                                                           tiny_model_dir, tmp_path):
    bin_dir = pure_python_venv
    # an artifact exported for specrt's kernels: a one-line error naming why this install has none
    r = _in(bin_dir, "specrt", "run", served_art, "--prompt", PROMPT, "--max-new-tokens", "4", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "SPECRT_NATIVE=off" in r.stderr.splitlines()[-1] and "libspecrt_ops.so" in r.stderr.splitlines()[-1]
    # an artifact for the stock kernels runs, and says what they cost and why they run
    from click.testing import CliRunner

    from specrt.cli import main

    art = tmp_path / "stock"
    out = CliRunner().invoke(main, ["export", str(tiny_model_dir("llama")), "--out", str(art), "--quiet"])
    assert out.exit_code == 0, out.output
    r = _in(bin_dir, "specrt", "run", art, "--input-ids", "1,2,3", "--max-new-tokens", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("specrt: kernels:"))
    assert "stock" in line and "half as fast" in line and "SPECRT_NATIVE=off" in line
    doctor = json.loads(_in(bin_dir, "specrt", "doctor", "--json", cwd=tmp_path).stdout)
    assert doctor["kernels"]["path"] is None and not doctor["kernels"]["build"]["built"]
    r = _in(bin_dir, "specrt-cpp", art, "--input-ids", "1,2", cwd=tmp_path)
    assert r.returncode == 1 and "SPECRT_NATIVE=off" in r.stderr, r.stderr
