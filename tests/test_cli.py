"""The `specrt` command line on a tiny exported artifact: commands, JSON output, one-line errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrt import artifact as io
from specrt.cli import main

EXPORT_FLAGS = ["--batch", "4", "--max-seq-len", "128", "--prefill-chunk", "16", "--verify-len", "5", "--quiet"]


def cli(*args: str):
    """Run the CLI in-process; returns click's Result (stdout and stderr kept apart)."""
    return CliRunner().invoke(main, [str(a) for a in args])


def cli_process(*args: str) -> subprocess.CompletedProcess:
    """Run `python -m specrt.cli` as a real process, so the real exit path and stderr are tested."""
    return subprocess.run([sys.executable, "-m", "specrt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def assert_one_line_error(result, *fragments: str) -> str:
    """Exit status 1 and exactly one line `specrt: error: ...` on stderr, no traceback anywhere."""
    code = result.returncode if isinstance(result, subprocess.CompletedProcess) else result.exit_code
    assert code == 1, (code, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specrt: error: "), result.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def art(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "art"
    result = cli("export", model_dir, "--out", out, *EXPORT_FLAGS)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {out}"
    return out


def run_json(art: Path, *args: str) -> dict:
    result = cli("run", art, "--threads", "1", "--json", *args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


# -- commands that work ---------------------------------------------------------------------------------


def test_export_writes_artifact(art):
    m = io.load_manifest(art)
    assert (m.export.batch, m.export.max_seq, m.export.prefill_chunk, m.export.verify_len) == (4, 128, 16, 5)
    assert m.export.dtype == "float32" and set(m.graphs) == {"target"}
    assert set(m.graphs["target"].buckets) == {"prefill", "decode", "verify"}


def test_export_existing_and_force(model_dir, art, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(art, out)
    assert_one_line_error(cli("export", model_dir, "--out", out, *EXPORT_FLAGS), "already exists", "--force")
    result = cli("export", model_dir, "--out", out, *EXPORT_FLAGS, "--force")
    assert result.exit_code == 0, result.output


def test_export_bad_settings(model_dir, tmp_path):
    assert_one_line_error(cli("export", model_dir, "--out", tmp_path / "a", "--max-seq-len", "16",
                              "--prefill-chunk", "16", "--quiet"), "must exceed the prefill chunk")
    assert_one_line_error(cli("export", model_dir, "--out", tmp_path / "b", "--batch", "0", "--quiet"),
                          "--batch must be >= 1")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_interrupted(model_dir, tmp_path, monkeypatch):
    from specrt.exporter import export as export_mod

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, "_check_graphs", interrupt)
    out = tmp_path / "art"
    result = cli("export", model_dir, "--out", out, *EXPORT_FLAGS)
    assert result.exit_code == 130 and result.stderr.strip() == "specrt: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_inspect(art):
    result = cli("inspect", art)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "llama: 2 layers, d=64, heads 4/2 kv, vocab 256" in out
    assert "B=4 S_MAX=128 prefill_chunk=16 verify_len=5 dtype=float32 attention=standard" in out
    assert "none (use --input-ids)" in out
    assert "target.onnx" in out and "logits['R', 256]" in out
    assert "bucket verify   (B=1,T=2,P=2,R=2)" in out and "(B=4,T=5,P=8,R=8)" in out


def test_inspect_json(art):
    result = cli("inspect", art, "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["format_version"] == io.FORMAT_VERSION
    assert d["export"]["max_seq"] == 128 and set(d["graphs"]) == {"target"}
    assert d["graphs"]["target"]["buckets"]["decode"] == [{"B": b, "T": 1, "P": b, "R": b} for b in (1, 2, 4)]


def test_run_json(art):
    d = run_json(art, "--input-ids", "1,2,3", "--max-new-tokens", "8", "--ignore-eos")
    assert set(d) == {"requests", "stats"}
    (req,) = d["requests"]
    assert len(req["output_ids"]) == 8 and all(0 <= t < 256 for t in req["output_ids"])
    assert req["prompt_tokens"] == 3 and req["finish_reason"] == "length" and req["id"] == 0
    s = d["stats"]
    assert s["method"] == "ar" and s["generated_tokens"] == 8 and s["requests"] == 1
    assert s["decode_tokens_per_s"] > 0 and s["prefill_ms"] > 0


def test_run_json_matches_engine(art):
    from specrt.runtime.engine import Engine, Request
    from specrt.runtime.sampling import SamplingParams

    d = run_json(art, "--input-ids", "5, 6, 7, 8", "--max-new-tokens", "12", "--ignore-eos")
    outs, _ = Engine(art, threads=1).generate([Request([5, 6, 7, 8], SamplingParams(max_new_tokens=12,
                                                                                     ignore_eos=True))])
    assert d["requests"][0]["output_ids"] == outs[0].output_ids


def test_run_plain_output_without_tokenizer(art):
    result = cli("run", art, "--threads", "1", "--input-ids", "1,2,3", "--max-new-tokens", "4", "--ignore-eos")
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith("[0] ") and len(line[4:].split(",")) == 4
    assert "4 tokens" in result.stderr and "tok/s" in result.stderr


def test_sampling_seed_and_filters(art):
    def ids(*flags: str) -> list[int]:
        return run_json(art, "--input-ids", "10,20,30", "--max-new-tokens", "16", "--ignore-eos",
                        *flags)["requests"][0]["output_ids"]

    greedy = ids()
    sampled = ids("--temperature", "1.0", "--seed", "7")
    assert ids("--temperature", "1.0", "--seed", "7") == sampled  # reproducible
    assert ids("--temperature", "1.0", "--seed", "8") != sampled
    assert sampled != greedy
    assert ids("--temperature", "1.0", "--seed", "7", "--top-k", "1") == greedy  # top-1 is argmax
    assert ids("--temperature", "1.0", "--seed", "7", "--top-p", "1e-6") == greedy  # nucleus of one token
    assert ids("--temperature", "1.0", "--seed", "7", "--top-k", "3") != sampled
    assert ids("--temperature", "1.0", "--seed", "7", "--top-p", "0.5") != sampled
    assert ids("--temperature", "5.0", "--seed", "7") != sampled


def test_prompts_need_a_tokenizer(art, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"question {i}"]}) for i in range(5)) + "\n")
    assert_one_line_error(cli("run", art, "--prompts", prompts, "--limit", "3"), "no tokenizer", "--input-ids")
    assert_one_line_error(cli("run", art, "--prompt", "hello"), "no tokenizer")


# -- bad input: one line on stderr, exit 1, no traceback ----------------------------------------------


def test_python_m_entry_point_works(art):
    proc = cli_process("run", art, "--threads", "1", "--input-ids", "1,2,3", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert len(d["requests"][0]["output_ids"]) <= 8 and d["stats"]["method"] == "ar"


def test_missing_paths(tmp_path):
    assert_one_line_error(cli_process("export", tmp_path / "nope", "--out", tmp_path / "art"), "not found")
    assert_one_line_error(cli_process("run", tmp_path / "nope", "--input-ids", "1"), "artifact not found")
    assert_one_line_error(cli("inspect", tmp_path / "nope"), "artifact not found")
    assert_one_line_error(cli("inspect", tmp_path), "not a specrt artifact")
    assert not (tmp_path / "art").exists()


def test_unsupported_architecture(model_dir, tmp_path):
    d = Path(shutil.copytree(model_dir, tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli_process("export", d, "--out", tmp_path / "art", "--quiet"),
                          "unsupported architecture", "GPT2LMHeadModel")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_truncated_safetensors(model_dir, tmp_path):
    d = Path(shutil.copytree(model_dir, tmp_path / "m"))
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert_one_line_error(cli_process("export", d, "--out", tmp_path / "art", "--quiet"), "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize("payload", [b"\x00\x01garbage" * 100, b"GGUF" + b"\xff" * 64])
def test_corrupt_gguf(tmp_path, payload):
    f = tmp_path / "model.gguf"
    f.write_bytes(payload)
    assert_one_line_error(cli_process("export", f, "--out", tmp_path / "art", "--quiet"), "model.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_artifact_with_other_format_version(art, tmp_path):
    old = Path(shutil.copytree(art, tmp_path / "old"))
    d = json.loads((old / io.MANIFEST).read_text())
    d["format_version"] = 0
    (old / io.MANIFEST).write_text(json.dumps(d))
    assert_one_line_error(cli_process("run", old, "--input-ids", "1,2"), "format version 0", "re-export")
    assert_one_line_error(cli("inspect", old), "format version 0")


@pytest.mark.parametrize("damage", ["json_list", "unreadable", "vocab", "cache_shape", "no_target", "bad_bucket"])
def test_malformed_manifest(art, tmp_path, damage):
    """A manifest that is not an object, cannot be read, or disagrees with its graphs: one line, no traceback."""
    broken = Path(shutil.copytree(art, tmp_path / "broken"))
    path = broken / io.MANIFEST
    d = json.loads(path.read_text())
    if damage == "json_list":
        path.write_text(json.dumps([d]))
        expect = "expected a JSON object"
    elif damage == "unreadable":
        path.unlink()
        path.mkdir()  # a directory where the file should be: unreadable whoever runs the test
        expect = "manifest.json"
    elif damage == "vocab":
        d["graphs"]["target"]["outputs"][0]["shape"][-1] += 1
        path.write_text(json.dumps(d))
        expect = "differs from the target graph's logits"
    elif damage == "cache_shape":
        for t in d["graphs"]["target"]["inputs"]:
            if t["name"].startswith("past."):
                t["shape"][2] = 7
        path.write_text(json.dumps(d))
        expect = "disagree"
    elif damage == "no_target":
        del d["graphs"]["target"]
        path.write_text(json.dumps(d))
        expect = "no 'target' graph"
    else:
        d["graphs"]["target"]["buckets"] = {"prefill": "oops"}
        path.write_text(json.dumps(d))
        expect = "malformed"
    assert_one_line_error(cli_process("run", broken, "--input-ids", "1,2"), expect)


def test_trace_path_errors(art, tmp_path):
    assert_one_line_error(cli("run", art, "--input-ids", "1,2", "--method", "ngram", "--trace", tmp_path),
                          "is a directory")
    assert_one_line_error(cli("run", art, "--input-ids", "1,2", "--method", "ngram", "--trace",
                              tmp_path / "nope" / "t.jsonl"), "cannot write --trace")
    res = cli("run", art, "--input-ids", "1,2", "--trace", tmp_path / "t.jsonl", "--max-new-tokens", "4")
    assert res.exit_code == 0 and "--trace is ignored with --method ar" in res.output
    assert not (tmp_path / "t.jsonl").exists()


def test_artifact_missing_graph(art, tmp_path):
    broken = Path(shutil.copytree(art, tmp_path / "broken"))
    (broken / "target.onnx").unlink()
    assert_one_line_error(cli("run", broken, "--input-ids", "1,2"), "target.onnx is missing")


@pytest.mark.parametrize("damage", ["corrupt_graph", "missing_weights", "truncated_weights"])
def test_damaged_artifact(art, tmp_path, damage):
    broken = Path(shutil.copytree(art, tmp_path / "broken"))
    if damage == "corrupt_graph":
        (broken / "target.onnx").write_bytes(b"garbage\x00\xff" * 10)
    elif damage == "missing_weights":
        (broken / io.WEIGHTS_FILE).unlink()
    else:
        w = broken / io.WEIGHTS_FILE
        w.write_bytes(w.read_bytes()[:1000])
    assert_one_line_error(cli_process("run", broken, "--input-ids", "1,2"), "cannot load target.onnx")


def test_prompt_longer_than_artifact(art):
    ids = ",".join(str(3 + i % 200) for i in range(200))
    assert_one_line_error(cli_process("run", art, "--input-ids", ids, "--max-new-tokens", "8"),
                          "200 tokens", "--max-seq-len")
    # fits alone, but not with the requested new tokens
    ids = ",".join(["5"] * 100)
    assert_one_line_error(cli("run", art, "--input-ids", ids, "--max-new-tokens", "64"), "exceeds")


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--seed", "-3"], "--seed"),
])
def test_invalid_sampling_values(art, flags, fragment):
    assert_one_line_error(cli("run", art, "--input-ids", "1,2,3", *flags), fragment)


def test_invalid_sampling_values_process(art):
    assert_one_line_error(cli_process("run", art, "--input-ids", "1,2,3", "--top-p", "0"), "--top-p")


def test_input_ids_outside_vocabulary(art):
    assert_one_line_error(cli_process("run", art, "--input-ids", "1,2,999"), "999", "vocabulary")
    assert_one_line_error(cli("run", art, "--input-ids", "1,-4"), "-4", "vocabulary")


@pytest.mark.parametrize("text", ["1,a,3", "1.5,2", "0x10"])
def test_input_ids_not_integers(art, text):
    assert_one_line_error(cli("run", art, "--input-ids", text), "--input-ids", "integers")


def test_input_ids_not_integers_process(art):
    assert_one_line_error(cli_process("run", art, "--input-ids", "1,a,3"), "--input-ids")


def test_empty_input_ids(art):
    assert_one_line_error(cli("run", art, "--input-ids", ","), "--input-ids is empty")


@pytest.mark.parametrize("content, fragment", [
    ('{"turns": ["ok"]}\n{not json\n', ":2:"),
    ('{"turns": []}\n', ":1:"),
    ('{"prompt": "x"}\n', ":1:"),
    ('{"turns": [3]}\n', "turns[0] must be a string"),
    ('{"turns": "a whole string"}\n', ":1:"),
    ('["turns"]\n', ":1:"),
    ('\n\n', "has no prompts"),
])
def test_malformed_prompts_jsonl(art, tmp_path, content, fragment):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    assert_one_line_error(cli("run", art, "--prompts", f), fragment)


@pytest.mark.parametrize("limit", ["0", "-2"])
def test_prompts_limit_must_be_positive(art, tmp_path, limit):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n')
    assert_one_line_error(cli("run", art, "--prompts", f, "--limit", limit), "--limit must be >= 1")


def test_malformed_prompts_jsonl_process(art, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["ok"]}\n{not json\n')
    assert_one_line_error(cli_process("run", art, "--prompts", f), "p.jsonl:2:")
    assert_one_line_error(cli_process("run", art, "--prompts", tmp_path / "missing.jsonl"),
                          "prompts file not found")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\x80\n")
    assert_one_line_error(cli_process("run", art, "--prompts", binary), "binary.jsonl")


def test_conflicting_prompt_sources(art, tmp_path):
    assert_one_line_error(cli_process("run", art, "--prompt", "hi", "--input-ids", "1,2"), "exactly one of")
    assert_one_line_error(cli("run", art), "exactly one of")


def test_debug_flag_shows_traceback(art):
    proc = cli_process("--debug", "run", art, "--input-ids", "1,a")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "SpecrtError" in proc.stderr


def test_the_cli_offers_exactly_the_registries():
    """Methods, schedulers, backends and dtypes are named once (runtime/config.py); every command's choices are
    those names, and the implementations cover them."""
    import click

    from specrt import artifact as io
    from specrt.runtime import config
    from specrt.runtime.schedulers import SCHEDULER_CLASSES
    from specrt.serve.triton.config import PLATFORMS
    from specrt.distill.pipeline import WORK_BACKENDS

    assert tuple(SCHEDULER_CLASSES) == config.SCHEDULERS
    registry = {"method": config.METHODS, "scheduler": config.SCHEDULERS, "backend": config.BACKENDS,
                "dtype": config.DTYPES}
    special = {("triton", "backend"): tuple(PLATFORMS), ("export", "dtype"): io.DTYPES,
               ("distill", "dtype"): ("bfloat16", "float16", "float32"),  # what is written, not what runs
               ("distill", "backend"): WORK_BACKENDS}  # where its work target runs
    seen = set()
    for name, command in main.commands.items():
        for p in command.params:
            if p.name in registry and isinstance(p.type, click.Choice):
                want = special.get((name, p.name), registry[p.name])
                assert tuple(p.type.choices) == tuple(want), (name, p.name)
                seen.add(p.name)
    assert seen == set(registry)


def test_a_method_is_parsed_once_into_a_typed_value():
    from specrt.errors import SpecrtError
    from specrt.runtime.config import METHODS, EngineConfig, Method

    parsed = {m: Method.parse(m) for m in METHODS}
    assert [(p.head, p.ngram, p.speculative, p.hybrid) for p in parsed.values()] == [
        (None, False, False, False), (None, True, True, False), ("mtp", False, True, False),
        ("dspark", False, True, False), ("dspark", True, True, True), ("mtp", True, True, True)]
    for bad, fragment in [(dict(method="eagle"), "unknown method"), (dict(scheduler="fast"), "unknown scheduler"),
                          (dict(backend="vulkan"), "unknown backend"), (dict(slots=0), "--slots must be >= 1"),
                          (dict(gamma=True), "--gamma must be >= 1")]:
        with pytest.raises(SpecrtError, match=fragment):
            EngineConfig(**bad)


def test_python_m_from_a_folder_holding_a_clone_named_specrt(tmp_path):
    """`python -m specrt.cli` where the working folder holds a clone named `specrt` (which Python takes as a
    namespace package before an editable install's finder, so `specrt.__file__` is None): the commands still run."""
    (tmp_path / "specrt").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    for args in (["--help"], ["doctor", "--json"]):
        r = subprocess.run([sys.executable, "-m", "specrt.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert json.loads(r.stdout)["kernels"]["build"] is not None
