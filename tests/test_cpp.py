"""The C++ runtime (runtime/cpp, its first slice: greedy `ar` and `ngram` through the C API of specrt.h), built here with CMake
against ONNX Runtime's headers (scripts/cpp_deps.sh: Debian's libonnxruntime-dev 1.21 through a private APT
configuration) and the onnxruntime wheel's library: token-identical to the Python engine on tiny Llama and Qwen3
targets (standard and cpu attention, whose cache grows) and on the default model; bad artifacts and requests are
one-line errors and exit 1, never a crash."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams

ROOT = Path(__file__).parents[1]
BUILD, DEPS = ROOT / "build" / "cpp", ROOT / "build" / "cpp-deps"


def _run(cmd: list, what: str, timeout: int = 900) -> None:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        pytest.fail(f"{what} failed:\n{(r.stdout + r.stderr)[-3000:]}")


@pytest.fixture(scope="session")
def specrt_cpp() -> Path:
    missing = [t for t in ("cmake", "g++", "apt-get", "dpkg-deb") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"building the C++ runtime needs {', '.join(missing)} (Debian: apt-get install cmake g++)")
    _run([ROOT / "scripts" / "cpp_deps.sh", DEPS], "scripts/cpp_deps.sh (ONNX Runtime's headers)")
    _run(["cmake", "-S", ROOT / "runtime" / "cpp", "-B", BUILD, f"-DSPECRT_DEPS={DEPS}",
          f"-DPython3_EXECUTABLE={sys.executable}"], "cmake configure")
    _run(["cmake", "--build", BUILD, "-j2"], "cmake --build")
    return BUILD / "specrt-cpp"


def _cpp(binary: Path, art: Path, ids: list[int], max_new: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), str(art), "--input-ids", ",".join(map(str, ids)), "--max-new-tokens",
                           str(max_new), "--threads", "1", "--json", *extra], capture_output=True, text=True,
                          timeout=300)


def _python(art: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    with Engine(art, method="ar", threads=1) as engine:
        outs, _ = engine.generate([Request(p, params, id=i) for i, p in enumerate(prompts)])
    return [o.output_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_arts(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpp")
    arts = {}
    for kind in ("llama", "qwen3"):
        for attention in ("standard", "cpu"):
            settings = ExportSettings(batch=2, max_seq=160, prefill_chunk=8, verify_len=4, attention=attention)
            arts[f"{kind}-{attention}"] = export_artifact(tiny_model_dir(kind), root / f"{kind}-{attention}", settings,
                                                          progress=False)
    return arts


def _python_rounds(art: Path, prompt: list[int], max_new: int) -> tuple[list[int], int, int]:
    """The Python engine's n-gram run (fixed lengths): tokens, rounds after prefill, drafts accepted."""
    with Engine(art, method="ngram", scheduler="fixed", threads=1) as engine:
        outs, stats = engine.generate([Request(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))])
    return outs[0].output_ids, len(stats.rounds), sum(a for _, a, _ in stats.rounds)


@pytest.mark.parametrize("name", ["llama-standard", "llama-cpu", "qwen3-standard", "qwen3-cpu"])
def test_greedy_is_token_identical_to_python(specrt_cpp, tiny_arts, name):
    """Prompts shorter and longer than a prefill chunk (repeating pieces, so lookups hit), 90 new tokens: the cpu
    lowering's cache grows past 64 positions mid-generation. `ar` and `ngram` give AR's tokens; `ngram` also runs
    the Python engine's rounds: as many, with as many drafts accepted."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (1, 7)]
    prompts += [(rng.integers(3, 256, k).tolist() * 6)[:n] for k, n in ((3, 8), (5, 19), (4, 40))]
    want = _python(tiny_arts[name], prompts, 90)
    hits = 0
    for prompt, ids in zip(prompts, want):
        r = _cpp(specrt_cpp, tiny_arts[name], prompt, 90, "--ignore-eos")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["output_ids"] == ids
        r = _cpp(specrt_cpp, tiny_arts[name], prompt, 90, "--ignore-eos", "--method", "ngram")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        tokens, rounds, accepted = _python_rounds(tiny_arts[name], prompt, 90)
        assert got["output_ids"] == ids == tokens
        assert (got["rounds"], got["accepted"]) == (rounds, accepted)
        hits += accepted
    assert hits > 0  # the lookups found drafts the target accepted


@pytest.mark.slow
def test_default_model_greedy_is_token_identical(specrt_cpp, served_art):
    from specrt.runtime.prompts import encode_prompt

    with Engine(served_art, method="ar", threads=1) as engine:
        prompts = [encode_prompt(engine.tokenizer, p) for p in
                   ("Why is the sky blue?", "Write a Python function that reverses a string.")]
    want = _python(served_art, prompts, 48)
    for prompt, ids in zip(prompts, want):
        for method in ("ar", "ngram"):
            r = _cpp(specrt_cpp, served_art, prompt, 48, "--ignore-eos", "--method", method)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["output_ids"] == ids, method
    # without --ignore-eos it stops at the artifact's end-of-sequence token, as the Python engine does
    r = _cpp(specrt_cpp, served_art, prompts[0], 400)
    with Engine(served_art, method="ar", threads=1) as engine:
        out = engine.generate([Request(prompts[0], SamplingParams(max_new_tokens=400))])[0][0].output_ids
    assert json.loads(r.stdout)["output_ids"] == out


def test_bad_artifacts_and_requests_are_one_line_errors(specrt_cpp, tiny_arts, tmp_path):
    art = tiny_arts["llama-standard"]

    def broken(name: str, edit) -> Path:
        copy = Path(shutil.copytree(art, tmp_path / name))
        edit(copy)
        return copy

    def bump(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        m["format_version"] = 3
        (d / "manifest.json").write_text(json.dumps(m))

    def shape(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        m["graphs"]["target"]["inputs"][0]["shape"] = ["B", 7]
        (d / "manifest.json").write_text(json.dumps(m))

    cases = [(tmp_path / "nowhere", [5, 6], "not a specrt artifact"),
             (broken("old", bump), [5, 6], "format 3"),
             (broken("nograph", lambda d: (d / "target.onnx").unlink()), [5, 6], "missing"),
             (broken("corrupt", lambda d: (d / "target.onnx").write_bytes(b"not onnx")), [5, 6], "cannot load"),
             (broken("badjson", lambda d: (d / "manifest.json").write_text("{")), [5, 6], "not a valid manifest"),
             (broken("shape", shape), [5, 6], "input_ids is [B, T] in the graph, [B, 7] in the manifest"),
             (art, [5, 10 ** 6], "outside the vocabulary"),
             (art, [5] * 150, "exceeds the artifact's 159 cache positions")]
    for where, ids, message in cases:
        r = _cpp(specrt_cpp, where, ids, 20)
        assert r.returncode == 1, (where, r.returncode, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run([str(specrt_cpp), str(art), "--input-ids", "5,x"], capture_output=True, text=True)
    assert r.returncode == 2 and "comma-separated" in r.stderr
    r = _cpp(specrt_cpp, art, [5, 6], 4, "--method", "dspark")
    assert r.returncode == 1 and "runs ar and ngram" in r.stderr
