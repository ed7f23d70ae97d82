"""Bad input found in review: each gets one line `specrt: error: ...`, exit 1, and leaves nothing behind."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import EXPORT_FLAGS, assert_one_line_error, cli, cli_process

WORDS = "the a cat dog sat ran on under mat log and then it was big small red blue".split()


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture
def model_copy(model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "m"))


@pytest.fixture(scope="module")
def art(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_inputs") / "art"
    result = cli("export", model_dir, "--out", out, *EXPORT_FLAGS)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def tok_model(model_dir, tmp_path_factory) -> Path:
    """The tiny llama with a word-level tokenizer, so text prompts work."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = Path(shutil.copytree(model_dir, tmp_path_factory.mktemp("tok_model") / "model"))
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3,
                                      **{w: 4 + i for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


@pytest.fixture(scope="module")
def tok_art(tok_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_inputs_tok") / "art"
    result = cli("export", tok_model, "--out", out, *EXPORT_FLAGS)
    assert result.exit_code == 0, result.output
    return out


def prompts_file(path: Path, *texts: str) -> Path:
    path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    return path


# -- export: never delete an input, the current directory, or a file -----------------------------------


@pytest.mark.parametrize("where", ["model_dir", "model_parent"])
def test_export_refuses_out_holding_the_model(model_copy, tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path.parent)  # not inside `out`, so the model is what the check finds
    out = model_copy if where == "model_dir" else tmp_path
    before = snapshot(model_copy)
    assert_one_line_error(cli("export", model_copy, "--out", out, *EXPORT_FLAGS, "--force"),
                          "is or contains the input", "would delete")
    assert snapshot(model_copy) == before and names(tmp_path) == ["m"]


@pytest.mark.parametrize("out_name", ["model.gguf", "."])
def test_export_refuses_out_holding_a_gguf(tmp_path, monkeypatch, out_name):
    monkeypatch.chdir(tmp_path.parent)
    d = tmp_path / "g"
    d.mkdir()
    gguf = d / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)  # refused before it is read, so the content does not matter
    assert_one_line_error(cli("export", gguf, "--out", d / out_name, *EXPORT_FLAGS, "--force"),
                          "is or contains the input")
    assert gguf.read_bytes() == b"GGUF" + b"\x00" * 64 and names(d) == ["model.gguf"]


@pytest.mark.parametrize("flag", ["--draft", "--mtp"])
def test_export_refuses_out_holding_a_head(model_dir, tmp_path, monkeypatch, flag):
    monkeypatch.chdir(tmp_path.parent)
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    for out in (head, tmp_path):
        assert_one_line_error(cli("export", model_dir, "--out", out, flag, head, *EXPORT_FLAGS, "--force"),
                              "is or contains the input", "head")
    assert names(tmp_path) == ["head"] and names(head) == ["config.json"]


@pytest.mark.parametrize("out", [".", ".."])
def test_export_refuses_the_current_directory(model_dir, tmp_path, monkeypatch, out):
    cwd = tmp_path / "here"
    cwd.mkdir()
    (cwd / "keep.txt").write_text("x")
    monkeypatch.chdir(cwd)
    assert_one_line_error(cli("export", model_dir, "--out", out, *EXPORT_FLAGS, "--force"), "current directory")
    assert names(tmp_path) == ["here"] and names(cwd) == ["keep.txt"]


def test_export_onto_a_file_is_refused_even_with_force(model_dir, tmp_path):
    """--force replaces an earlier output directory; a file at --out is never one (likely a typo), so keep it."""
    f = tmp_path / "notes.txt"
    f.write_text("precious")
    assert_one_line_error(cli("export", model_dir, "--out", f, *EXPORT_FLAGS), "already exists")
    assert_one_line_error(cli("export", model_dir, "--out", f, *EXPORT_FLAGS, "--force"), "not a directory")
    assert f.read_text() == "precious" and names(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("command", ["export", "triton"])
def test_force_replaces_only_an_earlier_output_of_the_same_command(model_dir, art, tmp_path, command):
    """--force once deleted any directory at --out (a user's thesis included): now only an empty one or an
    untouched earlier output of the same command, whose marker lists the files it wrote."""
    from specrt.outdir import MARKER

    def run(out: Path, force: bool = True):
        src = (model_dir,) if command == "export" else (art,)
        extra = EXPORT_FLAGS if command == "export" else ()
        return cli(command, *src, "--out", out, *extra, *(("--force",) if force else ()))

    user = tmp_path / "u"
    user.mkdir()
    (user / "thesis.tex").write_text("keep")
    assert_one_line_error(run(user), "left as it is", "no .specrt-output.json")
    assert names(user) == ["thesis.tex"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(empty).exit_code == 0
    written = json.loads((empty / MARKER).read_text())
    assert written["command"] == command and sorted(written["files"]) == sorted(
        str(p.relative_to(empty)) for p in empty.rglob("*") if p.is_file() and p != empty / MARKER)
    assert run(empty).exit_code == 0  # an earlier output of the same command is replaced
    (empty / "sub").mkdir(exist_ok=True)
    (empty / "sub" / "notes.md").write_text("mine")  # ... unless the user added to it since
    assert_one_line_error(run(empty), "did not write (sub/notes.md)")
    assert (empty / "sub" / "notes.md").read_text() == "mine"
    other = "triton" if command == "export" else "export"
    (empty / "sub" / "notes.md").unlink()
    (empty / MARKER).write_text(json.dumps({**written, "command": other}))
    assert_one_line_error(run(empty), f"not written by `specrt {other}`")


# -- export: unwritable --out ------------------------------------------------------------------------------


@pytest.mark.parametrize("out, fragment", [
    ("/proc/specrt-art", "cannot create a directory in /proc"),
    ("/proc/self/specrt-art", "cannot create a directory in /proc/self"),
    ("/sys/specrt-art", "cannot create a directory in /sys"),
])
def test_export_out_in_a_pseudo_filesystem(model_dir, out, fragment):
    if not Path(out).parent.is_dir():
        pytest.skip(f"no {Path(out).parent} here")
    assert_one_line_error(cli("export", model_dir, "--out", out, *EXPORT_FLAGS), "cannot write", fragment)
    assert not Path(out).exists()


@pytest.mark.parametrize("below", ["art", "a/b/art"])
def test_export_out_under_a_regular_file(model_dir, tmp_path, below):
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line_error(cli("export", model_dir, "--out", f / below, *EXPORT_FLAGS), "cannot write",
                          "is a file, not a directory")
    assert names(tmp_path) == ["file"] and f.read_text() == "x"


def test_failed_export_removes_the_parents_it_made(model_copy, tmp_path):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli("export", model_copy, "--out", tmp_path / "new" / "deep" / "art", *EXPORT_FLAGS),
                          "hidden_size")
    assert names(tmp_path) == ["m"]


# -- export: interrupted by SIGTERM, and what killed runs left behind --------------------------------------

STALL = """
import pathlib, sys, time
from specrt.exporter import export as e
mark = pathlib.Path(sys.argv.pop())
def stall(*args, **kwargs):  # mid-export: weights and graphs are written, nothing is renamed yet
    mark.touch()
    time.sleep(120)
e._check_graphs = stall
from specrt.cli import main
main()
"""


def test_sigterm_during_export_cleans_up(model_dir, tmp_path):
    parent, mark = tmp_path / "o", tmp_path / "stalled"
    parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", STALL, "export", model_dir, "--out", parent / "art",
                             *EXPORT_FLAGS, mark], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), proc.communicate()
        assert any(".art.partial-" in n for n in names(parent))  # mid-export
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip() == "specrt: interrupted", err
    assert names(parent) == []


def test_staged_removes_its_directory_on_sigterm(tmp_path):
    from specrt.outdir import staged, Terminated

    with pytest.raises(Terminated):
        with staged(tmp_path / "x" / "art", "export") as tmp:
            (tmp / "half.bin").write_bytes(b"0" * 100)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert names(tmp_path) == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_export_removes_stale_partials_of_its_target(model_dir, art, tmp_path):
    out = Path(shutil.copytree(art, tmp_path / "art"))
    dead = _dead_pid()
    for name in (f".art.partial-{dead}", f".art.old-{dead}", ".art.partial-1", f".other.partial-{dead}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights.bin").write_bytes(b"0" * 10)
    result = cli("export", model_dir, "--out", out, *EXPORT_FLAGS, "--force")
    assert result.exit_code == 0, result.output
    # pid 1 is alive (a live run's partial stays); another target's partial is not ours to remove
    assert names(tmp_path) == sorted([f".other.partial-{dead}", ".art.partial-1", "art"])


# -- export: model directories that cannot be read ---------------------------------------------------------


@pytest.mark.parametrize("edit, fragment", [
    (lambda c: c.pop("hidden_size"), "missing key 'hidden_size'"),
    (lambda c: c.pop("vocab_size"), "missing key 'vocab_size'"),
    (lambda c: c.pop("num_hidden_layers"), "missing key 'num_hidden_layers'"),
    (lambda c: c.update(num_attention_heads=None), "num_attention_heads must be an integer"),
    (lambda c: c.update(intermediate_size="big"), "intermediate_size must be an integer"),
])
def test_config_without_required_keys(model_copy, tmp_path, edit, fragment):
    cfg = json.loads((model_copy / "config.json").read_text())
    edit(cfg)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli_process("export", model_copy, "--out", tmp_path / "art", "--quiet"),
                          "config.json", fragment)
    assert names(tmp_path) == ["m"]


def test_directory_where_a_weights_file_is_expected(model_copy, tmp_path):
    """Works as root too: a directory named like the weights (or listed by the index) is not readable weights."""
    (model_copy / "model.safetensors").unlink()
    (model_copy / "model.safetensors").mkdir()
    assert_one_line_error(cli("export", model_copy, "--out", tmp_path / "art", *EXPORT_FLAGS), "no model.safetensors")
    assert names(tmp_path) == ["m"]


@pytest.fixture(scope="module")
def unprivileged(tmp_path_factory) -> list[str]:
    """A command prefix under which chmod 000 really makes a file unreadable (root drops its DAC override)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    probe = tmp_path_factory.mktemp("probe") / "secret"
    probe.write_text("x")
    probe.chmod(0)
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"] if setpriv else []
    if not setpriv or subprocess.run([*prefix, "cat", str(probe)], capture_output=True).returncode == 0:
        pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE (no setpriv), so nothing is unreadable")
    return prefix


def run_unprivileged(prefix: list[str], *args) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "specrt.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("target, fragment", [
    (".", "cannot read"),  # the directory itself
    ("config.json", "config.json: cannot read: Permission denied"),
    ("model.safetensors", "model.safetensors: cannot read: Permission denied"),
])
def test_unreadable_model(unprivileged, model_copy, tmp_path, target, fragment):
    path = model_copy / target
    mode = path.stat().st_mode
    path.chmod(0)
    try:
        line = assert_one_line_error(run_unprivileged(unprivileged, "export", model_copy, "--out", tmp_path / "art",
                                                      "--quiet"), fragment)
        assert "No such file" not in line
    finally:
        path.chmod(mode)
    assert names(tmp_path) == ["m"]


def test_out_in_a_read_only_directory(unprivileged, model_dir, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for out in (ro / "art", ro / "a" / "art"):
            assert_one_line_error(run_unprivileged(unprivileged, "export", model_dir, "--out", out, "--quiet"),
                                  "cannot write", "Permission denied")
        assert names(ro) == []
    finally:
        ro.chmod(0o755)


# -- distill -------------------------------------------------------------------------------------------------

DISTILL = ("--head", "mtp", "--steps", "1", "--max-new-tokens", "8", "--max-seq-len", "32", "--gen-batch", "2",
           "--quiet")


def test_distill_missing_target_leaves_no_work_dir(tmp_path):
    p = prompts_file(tmp_path / "p.jsonl", "the cat")
    assert_one_line_error(cli("distill", tmp_path / "nope", "--prompts", p, "--out", tmp_path / "ck", *DISTILL),
                          "not found")
    assert names(tmp_path) == ["p.jsonl"]


def test_distill_target_without_tokenizer(model_dir, tmp_path):
    p = prompts_file(tmp_path / "p.jsonl", "the cat")
    line = assert_one_line_error(cli("distill", model_dir, "--prompts", p, "--out", tmp_path / "ck", *DISTILL),
                                 "no tokenizer", "distill needs one")
    assert "--input-ids" not in line
    assert names(tmp_path) == ["p.jsonl"]


def test_distill_refuses_out_holding_its_inputs(tok_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = Path(shutil.copytree(tok_model, tmp_path / "t"))
    p = prompts_file(tmp_path / "p.jsonl", "the cat")
    before = snapshot(target)
    for out in (target, p):
        assert_one_line_error(cli("distill", target, "--prompts", p, "--out", out, *DISTILL, "--force"),
                              "is or contains the input")
    assert_one_line_error(cli("distill", target, "--prompts", p, "--out", tmp_path / "ck", "--work",
                              tmp_path / "ck" / "w", *DISTILL), "--work", "inside --out")
    assert_one_line_error(cli("distill", target, "--prompts", p, "--out", "/proc/specrt-ck", "--work",
                              tmp_path / "w", *DISTILL), "cannot write")
    assert snapshot(target) == before and names(tmp_path) == ["p.jsonl", "t"]


# -- run and bench ------------------------------------------------------------------------------------------


def test_negative_stop_token_id(art):
    assert_one_line_error(cli_process("run", art, "--input-ids", "1,2", "--stop-token-id", "-1"),
                          "--stop-token-id must be >= 0", "-1")
    assert_one_line_error(cli("run", art, "--input-ids", "1,2", "--stop-token-id", "256"),
                          "--stop-token-id 256", "vocabulary")


def test_sampling_params_validate_stops():
    from specrt.errors import SpecrtError
    from specrt.runtime.sampling import SamplingParams

    with pytest.raises(SpecrtError, match="--stop-token-id must be >= 0"):
        SamplingParams(stop_token_ids=(5, -2))
    with pytest.raises(SpecrtError, match="--stop must not be empty"):
        SamplingParams(stop_strings=("",))
    assert SamplingParams(stop_token_ids=(0, 7), stop_strings=("\n",)).stop_token_ids == (0, 7)


def test_too_long_prompt_names_file_and_line(tok_art, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"turns": ["the cat"]}) + "\n\n" + json.dumps({"turns": ["the cat sat " * 60]}) + "\n")
    assert_one_line_error(cli_process("run", tok_art, "--prompts", p, "--max-new-tokens", "4"),
                          f"{p}:3: ", "180")
    result = cli("run", tok_art, "--prompts", p, "--limit", "1", "--max-new-tokens", "4", "--json", "--threads", "1")
    assert result.exit_code == 0, result.output


def test_bench_without_tokenizer_does_not_suggest_input_ids(art, tmp_path):
    p = prompts_file(tmp_path / "p.jsonl", "the cat")
    line = assert_one_line_error(cli_process("bench", art, "--prompts", p, "--max-new-tokens", "4"),
                                 "no tokenizer", "text prompts need one")
    assert "--input-ids" not in line


# -- artifacts are input too (a user may run an artifact someone else exported) ---------------------------------


def _edit_manifest(art: Path, dest: Path, edit) -> Path:
    from specrt import artifact as io

    copy = Path(shutil.copytree(art, dest))
    d = json.loads((copy / io.MANIFEST).read_text())
    edit(d)
    (copy / io.MANIFEST).write_text(json.dumps(d))
    return copy


def test_links_and_external_data_leaving_the_artifact_are_refused(art, tmp_path):
    import onnx

    from specrt import artifact as io

    elsewhere = Path(shutil.copytree(art, tmp_path / "elsewhere"))
    linked = Path(shutil.copytree(art, tmp_path / "linked"))
    (linked / "target.onnx").unlink()
    (linked / "target.onnx").symlink_to(elsewhere / "target.onnx")
    assert_one_line_error(cli("run", linked, "--input-ids", "1,2"), "target graph file 'target.onnx' leads outside")
    (linked / "tokenizer").mkdir(exist_ok=True)
    (linked / "target.onnx").unlink()
    shutil.copy(art / "target.onnx", linked / "target.onnx")
    (linked / "tokenizer" / "tokenizer.json").symlink_to(tmp_path / "host.json")
    assert_one_line_error(cli("run", linked, "--input-ids", "1,2"), "tokenizer/tokenizer.json' leads outside")
    # a graph whose tensors read their weights from a file outside the artifact
    moved = Path(shutil.copytree(art, tmp_path / "moved" / "art"))
    model = onnx.load(str(moved / "target.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../weights.bin"
    onnx.save(model, str(moved / "target.onnx"))
    shutil.copy(moved / io.WEIGHTS_FILE, moved.parent / "weights.bin")
    assert_one_line_error(cli("run", moved, "--input-ids", "1,2"), "target.onnx's external data", "leads outside")


def _regenerate_buckets(d: dict) -> None:
    from specrt import artifact as io

    s = io.ExportSettings(**d["export"])
    for name, g in d["graphs"].items():
        g["buckets"] = io.target_buckets(s) if name == io.TARGET else io.head_buckets(s)
        g["max_seq"] = s.max_seq


# Absurd numbers, paths and special files in a manifest: tests/hostile_artifacts.py, through both runtimes.


def test_allocations_are_estimated_before_they_are_made(art, tmp_path):
    """Graphs exported before they recorded their shapes are checked by the memory estimate: 4,096 slots of 4M
    positions is one line naming the size and the memory available, not an attempt at terabytes."""
    import onnx

    from specrt.errors import SpecrtError
    from specrt.runtime.engine import Engine

    def edit(d):
        d["export"].update(batch=4096, max_seq=1 << 22)
        _regenerate_buckets(d)

    bad = _edit_manifest(art, tmp_path / "bad", edit)
    model = onnx.load(str(bad / "target.onnx"), load_external_data=False)
    del model.metadata_props[:]
    onnx.save(model, str(bad / "target.onnx"))
    with pytest.raises(SpecrtError, match=r"needs [\d.]+ [GTP]iB, more than the [\d.]+ GiB of memory available"):
        Engine(bad, slots=4096)
    from serving import free_port

    assert_one_line_error(cli_process("serve", bad, "--port", str(free_port())), "of memory available")


def test_deep_manifest_and_broken_profile(art, tmp_path):
    from specrt import artifact as io

    deep = Path(shutil.copytree(art, tmp_path / "deep"))
    (deep / io.MANIFEST).write_text('{"format_version": 4, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert_one_line_error(cli_process("inspect", deep), "nested too deeply")
    assert_one_line_error(cli_process("run", deep, "--input-ids", "1,2"), "nested too deeply")
    digits = Path(shutil.copytree(art, tmp_path / "digits"))  # past Python's limit on an integer's digits
    (digits / io.MANIFEST).write_text('{"format_version": ' + "9" * 5000 + "}")
    assert_one_line_error(cli_process("run", digits, "--input-ids", "1,2"), "is malformed", "integer")
    prof = Path(shutil.copytree(art, tmp_path / "prof"))
    d = json.loads((prof / "profile.json").read_text())
    for entry in d["profiles"].values():
        del entry["verify"]
    (prof / "profile.json").write_text(json.dumps(d))
    assert_one_line_error(cli_process("run", prof, "--input-ids", "1,2", "--method", "ngram", "--scheduler", "sps"),
                          "profile.json: entry", "malformed (no 'verify')")


def test_chat_template_output_is_bounded(tok_art, tmp_path):
    from specrt import artifact as io
    from specrt.errors import SpecrtError
    from specrt.runtime.tokenizer import Tokenizer

    for template, fragment in [("{{ 'x' * 4000000000 }}", "repeats a sequence"),
                               ("{{ 2 ** 100000000 }}", "too large a power"),
                               ("{% for i in range(10000) %}{{ 'y' * 1000 }}{% endfor %}", "output exceeds"),
                               # work, not only size: 10^10 empty iterations
                               ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                "ran more than 4000000 steps"),
                               ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
                               # exceptions of any kind are one line
                               ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
                               ("{{ messages + 1 }}", "TypeError: can only concatenate list"),
                               # strings that format, pad, join or replace their way past the bound
                               ("{{ '%999999999s' % 'a' }}", "pads a string"),
                               ("{{ '%*s' % (999999999, 'a') }}", "pads a string"),
                               ("{{ '{:>999999999}'.format('a') }}", "pads a string"),
                               ("{{ '{0:{1}}'.format('a', 999999999) }}", "pads a string"),
                               ("{{ 'a'.center(999999999) }}", "pads a string (center)"),
                               ("{{ 'a'|center(999999999) }}", "pads a string (center)"),
                               ("{{ 'a'|indent(999999999) }}", "indents a string"),
                               ("{{ '%999999999s'|format('a') }}", "pads a string"),
                               ("{{ ('x' * 4000000).replace('x', 'yy') }}", "grows a string (replace)"),
                               ("{{ ('x' * 4000000)|replace('x', 'yy') }}", "grows a string (replace)"),
                               ("{{ (['x' * 4000000] * 100)|join }}", "joins a string"),
                               ("{{ ''.join(['x' * 4000000] * 100) }}", "joins a string")]:
        start = time.monotonic()
        with pytest.raises(SpecrtError, match=re.escape(fragment)):
            Tokenizer(None, {"chat_template": template}).apply_chat_template([{"role": "user", "content": "hi"}])
        assert time.monotonic() - start < 10, template  # refused before the work, or within its budget
    # the same bounds hold while compiling, where Jinja folds constant expressions (it used to build these there)
    for template in ("{{ '%999999999s' % 'a' }}", "{{ 'a'|center(999999999) }}"):
        with pytest.raises(SpecrtError, match="pads a string"):
            Tokenizer(None, {"chat_template": template}).apply_chat_template([{"role": "user", "content": "hi"}])
    # ordinary uses of the same operations still render
    ok = ("{{ 'ab'.replace('a', 'c') }} {{ 'x'.center(5) }} {{ '%5s' % 'a' }} {{ ['a', 'b']|join(',') }} "
          "{{ '{:>3}'.format(1) }} {{ 'a'|indent(2) }} {{ '%s-%s'|format(1, 2) }}")
    out = Tokenizer(None, {"chat_template": ok}).apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "cb   x       a a,b   1 a 1-2"
    zero = _edit_manifest(tok_art, tmp_path / "zero", lambda d: d["tokenizer"].update(chat_template="{{ 1/0 }}"))
    assert_one_line_error(cli_process("run", zero, "--prompt", "the cat", "--max-new-tokens", "2"),
                          "chat template error: ZeroDivisionError")
    bad = _edit_manifest(tok_art, tmp_path / "bad",
                         lambda d: d["tokenizer"].update(chat_template="{{ 'x' * 4000000000 }}"))
    assert_one_line_error(cli_process("run", bad, "--prompt", "the cat", "--max-new-tokens", "2"),
                          "chat template error", "repeats a sequence")
    assert (bad / io.MANIFEST).is_file()
