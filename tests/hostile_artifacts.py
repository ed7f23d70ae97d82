"""One table of hostile artifacts, which both runtimes must refuse (tests/test_hostile_artifacts.py runs every case
through the Python engine and through the C++ runtime's `specrt-cpp`).

Each case edits a copy of a valid tiny artifact (a Llama exported with batch 2, verify length 4, prefill chunk 8,
160 positions) as someone handing out artifacts might, and names the words both one-line refusals must contain. The
rules they break are specrt/artifact.py's ("the rules an artifact is held to"); the C++ runtime reads the same rules
from runtime/cpp/src/rules.h, which scripts/gen_cpp_names.py writes from there."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

Edit = Callable[[Path, Path], None]  # (the artifact's copy, a folder outside it) -> None


@dataclass(frozen=True)
class Case:
    id: str
    edit: Edit
    fragments: tuple[str, ...]  # every one in both runtimes' one-line error


def _manifest(art: Path) -> dict[str, Any]:
    return json.loads((art / "manifest.json").read_text())


def _write(art: Path, d: dict[str, Any], raw: dict[str, str] | None = None) -> None:
    text = json.dumps(d, indent=1)
    for sentinel, value in (raw or {}).items():
        text = text.replace(json.dumps(sentinel), value)
    (art / "manifest.json").write_text(text)


def _at(d: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    *parents, key = path.split(".")
    for p in parents:
        d = d[p]
    return d, key


def set_(path: str, value: Any) -> Edit:
    """manifest[path] = value (dotted path); a callable value gets the old one."""
    def edit(art: Path, _: Path) -> None:
        d = _manifest(art)
        parent, key = _at(d, path)
        parent[key] = value(parent[key]) if callable(value) else value
        _write(art, d)
    return edit


def raw(path: str, text: str) -> Edit:
    """manifest[path] written as the JSON text `text` (numbers no JSON library here would write)."""
    def edit(art: Path, _: Path) -> None:
        d = _manifest(art)
        parent, key = _at(d, path)
        parent[key] = "@raw@"
        _write(art, d, {"@raw@": text})
    return edit


def whole(text: str) -> Edit:
    def edit(art: Path, _: Path) -> None:
        (art / "manifest.json").write_text(text)
    return edit


def regenerated(**export: int) -> Edit:
    """Export settings changed and every graph's buckets and max_seq made to agree with them, so that only the graph
    files (which record what they were exported for) tell the truth."""
    def edit(art: Path, _: Path) -> None:
        from specrt import artifact as io

        d = _manifest(art)
        d["export"].update(export)
        s = io.ExportSettings(**d["export"])
        for name, g in d["graphs"].items():
            g["buckets"] = io.target_buckets(s) if name == io.TARGET else io.head_buckets(s)
            g["max_seq"] = s.max_seq
        _write(art, d)
    return edit


def link_out(name: str) -> Edit:
    """`name` (a file or folder of the artifact) replaced by a link to a copy of it outside the artifact."""
    def edit(art: Path, outside: Path) -> None:
        target = art / name
        if not target.exists():  # a tokenizer folder the tiny model lacks
            target.mkdir()
            (target / "tokenizer.json").write_text("{}")
        copy = outside / Path(name).name
        (shutil.copytree if target.is_dir() else shutil.copy)(target, copy)
        (shutil.rmtree if target.is_dir() and not target.is_symlink() else os.unlink)(target)
        target.symlink_to(copy)
    return edit


def fifo(name: str) -> Edit:
    """`name` replaced by a FIFO, which blocks whoever opens it for reading until a writer comes."""
    def edit(art: Path, _: Path) -> None:
        path = art / name
        path.parent.mkdir(exist_ok=True)
        if path.exists():
            path.unlink()
        os.mkfifo(path)
    return edit


def chain(*edits: Edit) -> Edit:
    def edit(art: Path, outside: Path) -> None:
        for e in edits:
            e(art, outside)
    return edit


CASES = (
    # -- numbers: integers within the rules' bounds, agreeing with each other and with the graphs ----------------
    Case("vocab-1e12", set_("model.vocab_size", 10 ** 12), ("model.vocab_size must be an integer in 1..",)),
    Case("vocab-past-logits", set_("model.vocab_size", lambda v: v + 64),
         ("model.vocab_size", "differs from the target graph's logits")),
    Case("vocab-short-of-logits", set_("model.vocab_size", lambda v: v - 1), ("differs from the target graph's logits",)),
    Case("vocab-text", set_("model.vocab_size", "256"), ("model.vocab_size must be an integer",)),
    Case("vocab-5000-digits", raw("model.vocab_size", "9" * 5000), ("manifest.json is malformed",)),
    Case("batch-0", set_("export.batch", 0), ("export.batch must be an integer in 1..4096",)),
    Case("batch-negative", set_("export.batch", -1), ("export.batch must be an integer in 1..4096",)),
    Case("batch-2^63", set_("export.batch", 2 ** 63), ("export.batch must be an integer in 1..4096",)),
    Case("batch-2^64+4", set_("export.batch", 2 ** 64 + 4), ("export.batch must be an integer in 1..4096",)),
    Case("batch-true", set_("export.batch", True), ("export.batch must be an integer in 1..4096",)),
    Case("batch-float", set_("export.batch", 2.5), ("export.batch must be an integer in 1..4096",)),
    Case("batch-past-buckets", set_("export.batch", 4), ("buckets are not those of the export settings",)),
    Case("prefill-bucket-1e9", set_("graphs.target.buckets.prefill", [{"B": 1, "T": 10 ** 9, "P": 10 ** 9, "R": 1}]),
         ("buckets are not those of the export settings",)),
    Case("graph-max-seq-1e9", set_("graphs.target.max_seq", 10 ** 9), ("graphs.target.max_seq must be an integer in",)),
    Case("graph-max-seq-other", set_("graphs.target.max_seq", 96), ("max_seq 96 differs from export.max_seq 160",)),
    Case("batch-the-graphs-lack", regenerated(batch=64), ("exported for other shapes", "disagree")),
    Case("max-seq-the-graphs-lack", regenerated(max_seq=4096), ("exported for 160 cache positions", "disagree")),
    Case("verify-len-1e6", set_("export.verify_len", 10 ** 6), ("export.verify_len must be an integer in 1..256",)),
    Case("format-version-3", set_("format_version", 3), ("artifact format version 3",)),
    Case("format-version-huge", set_("format_version", 2 ** 70), ("artifact format version",)),
    Case("not-an-object", whole("[1, 2]"), ("manifest.json is malformed", "expected a JSON object")),
    Case("not-json", whole("{"), ("manifest.json is malformed",)),
    Case("nested-deeply", whole('{"format_version": 5, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
         ("manifest.json is malformed",)),
    # -- paths: inside the artifact, links followed; regular files where a file is read ---------------------------
    Case("graph-file-up", set_("graphs.target.file", "../../etc/passwd"), ("leads outside the artifact",)),
    Case("graph-file-absolute", set_("graphs.target.file", "/etc/passwd"), ("is not a path inside the artifact",)),
    Case("graph-file-empty", set_("graphs.target.file", ""), ("is not a path inside the artifact",)),
    Case("weights-file-up", set_("weights.file", "../weights.bin"), ("weights file '../weights.bin' leads outside",)),
    Case("target-onnx-linked-out", link_out("target.onnx"), ("target graph file 'target.onnx' leads outside",)),
    Case("weights-linked-out", link_out("weights.bin"), ("weights file 'weights.bin' leads outside",)),
    Case("tokenizer-folder-linked-out", link_out("tokenizer"), ("'tokenizer' leads outside",)),
    Case("manifest-linked-out", link_out("manifest.json"), ("'manifest.json' leads outside",)),
    Case("manifest-fifo", fifo("manifest.json"), ("manifest.json: the manifest is not a regular file",)),
    Case("profile-fifo", fifo("profile.json"), ("profile.json: the file is not a regular file",)),
    Case("tokenizer-json-fifo", fifo("tokenizer/tokenizer.json"), ("tokenizer.json: the file is not a regular file",)),
    Case("profile-a-folder", lambda art, _: (art / "profile.json").mkdir(), ("profile.json: the file is not a regular",)),
)


def build(case: Case, art: Path, root: Path) -> Path:
    """A copy of `art` with `case`'s edit made, under `root` (with the folder outside it that links lead to)."""
    outside = root / f"{case.id}-outside"
    outside.mkdir(parents=True)
    copy = Path(shutil.copytree(art, root / case.id / "art", symlinks=True))
    case.edit(copy, outside)
    return copy
