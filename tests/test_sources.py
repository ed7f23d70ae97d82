"""Corpus prompt sets built from packaged material (specrt/distill/sources.py) and the committed datasets/corpus/."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from specrt.datasets import DATASETS_DIR
from specrt.distill import sources
from specrt.distill.prompts import eval_prompts, training_prompts
from specrt.errors import SpecrtError
from specrt.runtime.prompts import read_prompts_file

CORPUS = Path(__file__).resolve().parents[1] / "datasets" / "corpus"


def test_a_source_is_a_fixed_list_of_distinct_documented_prompts():
    rows = sources.prompts("stdlib")
    assert rows == sources.prompts("stdlib")  # a pure function of the installed library
    texts = [r["turns"][0] for r in rows]
    assert len(set(texts)) == len(texts) > 1000
    assert {r["licence"] for r in rows} == {"PSF-2.0"} and {r["source"] for r in rows} == {"stdlib"}
    heads = {t.split("`")[0] for t in texts}  # every prompt is one of the templates, naming its callable
    assert heads <= {t.split("`")[0] for t in sources.TEMPLATES}, heads
    assert all(f"`{r['callable']}`" in r["turns"][0] for r in rows)
    dedent = next(r for r in rows if r["callable"] == "textwrap.dedent")
    assert "common leading whitespace" in dedent["turns"][0]  # the documentation is quoted
    with pytest.raises(SpecrtError, match="unknown prompt source 'nope'"):
        sources.prompts("nope")


def test_a_written_set_is_the_same_bytes_and_reads_as_prompts(tmp_path):
    rows = sources.prompts("numpy")[:50]
    a, b = sources.write(rows, tmp_path / "a.jsonl.gz"), sources.write(rows, tmp_path / "b.jsonl.gz")
    assert a.read_bytes() == b.read_bytes()  # no timestamp in the gzip header
    assert not list(tmp_path.glob("*.partial"))
    assert read_prompts_file(a) == [r["turns"][0] for r in rows]
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(a.read_bytes()[:40])
    with pytest.raises(SpecrtError, match="cannot read prompts file"):
        read_prompts_file(bad)


@pytest.mark.parametrize("name", sorted(sources.SOURCES))
def test_the_committed_sets_are_disjoint_from_the_eval_rows(name):
    path = CORPUS / f"{name}.jsonl.gz"
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    assert {r["source"] for r in rows} == {name} and {r["licence"] for r in rows} == {sources.SOURCES[name].licence}
    texts = [r["turns"][0] for r in rows]
    assert len(set(texts)) == len(texts)
    held_out = {t for ts in eval_prompts(DATASETS_DIR).values() for t in ts}
    assert held_out and not held_out & set(texts)
    split = training_prompts(prompt_files=[path])  # what distillation reads: checked disjoint again there
    assert len(split.prompts) == len(rows)
    assert f"| `{name}.jsonl.gz` |" in (CORPUS / "README.md").read_text()  # its row in the README: source, licence


def test_the_committed_responses_answer_the_training_prompts_in_order():
    """datasets/corpus/responses/greedy-256 (scripts/corpus_generate.py): one greedy response per training prompt, in
    the order `training_prompts` gives them, each prompt's file and row recorded."""
    from specrt.distill.prompts import dataset_files

    base = CORPUS / "responses" / "greedy-256"
    rows = [json.loads(line) for line in gzip.decompress(Path(f"{base}.jsonl.gz").read_bytes()).decode().splitlines()]
    meta = json.loads(Path(f"{base}.meta.json").read_text())
    split = training_prompts(files=[p.stem for p in dataset_files()], prompt_files=sorted(CORPUS.glob("*.jsonl.gz")))
    assert meta["num_prompts"] == len(rows) == len(split.prompts)
    assert [r["index"] for r in rows] == list(range(len(rows)))
    assert [(r["file"], r["row"]) for r in rows] == [
        (f"corpus/{Path(p.file).name}" if "/" in p.file else p.file, p.row) for p in split.prompts]
    assert {r["finish_reason"] for r in rows} <= {"eos", "length", "prompt_too_long"}
    assert all(r["prompt_ids"] and len(r["response_ids"]) <= meta["sampling_params"]["max_new_tokens"] for r in rows)
    assert sum(len(r["response_ids"]) for r in rows) == meta["response_tokens"]
