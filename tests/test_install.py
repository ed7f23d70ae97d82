"""The lean runtime install: `pip install -e '.[cpu]'` (pinned by requirements/ci.lock) into a fresh venv has what
running an exported artifact needs and nothing else; `specrt run` and the Python API run the default model's
artifact there (the hybrid under sps, from its stored profile), with the tokens of this environment's engine, and
never import torch, transformers or matplotlib."""
from __future__ import annotations

import json
import subprocess

import pytest

from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams

from venvs import ROOT, make_venv, site_packages_mb

pytestmark = pytest.mark.slow  # the default model's artifact (conftest's served_art)
HEAVY = ("torch", "transformers", "matplotlib", "fastapi", "uvicorn", "gguf", "safetensors", "accelerate")
SCRIPT = """
import json, sys
from specrt.cli import main
from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams
art = sys.argv[1]
with Engine(art, method="dspark+ngram", scheduler="sps", threads=1) as engine:
    ids = encode_prompt(engine.tokenizer, "Why is the sky blue?")
    outs, _ = engine.generate([Request(ids, SamplingParams(max_new_tokens=16))])
try:
    main(["run", art, "--prompt", "Why is the sky blue?", "--method", "dspark+ngram", "--max-new-tokens", "16",
          "--threads", "1", "--json"], standalone_mode=False)
except SystemExit as e:
    assert not e.code, e.code
import importlib.util
print(json.dumps({"ids": outs[0].output_ids, "modules": sorted({m.split(".")[0] for m in sys.modules}),
                  "installed": {m: importlib.util.find_spec(m) is not None for m in %r}}))
"""


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("runtime_install") / "venv"
    return venv, make_venv(venv, "cpu", ROOT / "requirements" / "ci.lock")


def test_the_runtime_install_runs_an_artifact_without_the_heavy_packages(runtime_venv, served_art):
    venv, bin_dir = runtime_venv
    r = subprocess.run([str(bin_dir / "python"), "-c", SCRIPT % (HEAVY,), str(served_art)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    cli = json.loads(lines[-2])  # `specrt run --json`
    assert not any(report["installed"].values()), report["installed"]  # not even installed
    assert not set(HEAVY) & set(report["modules"])
    with Engine(served_art, method="ar", threads=1) as engine:
        ids = encode_prompt(engine.tokenizer, "Why is the sky blue?")
        want = engine.generate([Request(ids, SamplingParams(max_new_tokens=16))])[0][0].output_ids
    assert report["ids"] == want and cli["requests"][0]["output_ids"] == want
    print(f"\nthe runtime install (specrt[cpu]): {site_packages_mb(venv):.0f} MB of packages")
