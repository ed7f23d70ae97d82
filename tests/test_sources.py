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


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress((CORPUS / f"{name}.jsonl.gz").read_bytes()).decode().splitlines()]


@pytest.mark.parametrize("name", sorted(sources.CHAT_SOURCES))
def test_the_committed_chat_sets_are_their_templates_over_their_subjects(name):
    rows = _rows(name)
    templates = (sources.CAREER_TEMPLATES if name == "careers" else
                 sources.COUNTRY_TEMPLATES + sources.LANGUAGE_TEMPLATES + sources.CURRENCY_TEMPLATES)
    assert len(rows) > 1000 and {r["licence"] for r in rows} == {sources.CHAT_SOURCES[name].licence}
    texts = [r["turns"][0] for r in rows]
    assert len(set(texts)) == len(texts)
    for r in rows:  # each text is one of the source's templates, about its subject
        subject = r["subject"]
        assert r["turns"][0] in {t.format(s=subject, a=sources._article(subject)) for t in templates}, r
    held_out = {t for ts in eval_prompts(DATASETS_DIR).values() for t in ts}
    assert not held_out & set(texts)
    assert f"| `{name}.jsonl.gz` |" in (CORPUS / "README.md").read_text()
    try:  # rebuilding needs the package the subjects come from (not a dependency of specrt)
        rebuilt = sources.chat_prompts(name)
    except SpecrtError as e:
        pytest.skip(f"{e} (only rebuilding the committed set needs it)")
    assert rebuilt == rows


def test_chat_subjects_read_naturally():
    assert sources._job("Engineer, civil (contracting)") == "civil engineer (contracting)"
    assert sources._job("IT trainer") == "IT trainer"
    assert sources._reading_order("Korea, Republic of") == "Republic of Korea"
    assert sources._article("engineer") == "an" and sources._article("nurse") == "a"
    with pytest.raises(SpecrtError, match="unknown chat source 'nope'"):
        sources.chat_prompts("nope")


def test_followups_continue_a_training_conversation():
    """Each multi-turn row is a base training prompt, the default model's answer to it, and a second request of
    the prompt's kind (mt-bench's own second turn where it has one); all read as conversations disjoint from the
    eval rows."""
    from specrt.distill.prompts import dataset_files
    from specrt.runtime.prompts import read_conversations

    rows = _rows("followups")
    base = training_prompts(files=[p.stem for p in dataset_files()],
                            prompt_files=[CORPUS / f"{n}.jsonl.gz" for n in sorted(sources.SOURCES)])
    first = {(f"corpus/{Path(p.file).name}" if "/" in p.file else p.file, p.row): p.text for p in base.prompts}
    mt_bench = [json.loads(line)["turns"] for line in (DATASETS_DIR / "mt-bench.jsonl").read_text().splitlines()]
    assert len(rows) > 1500
    for r in rows:
        file, _, row = r["from"].rpartition(":")
        assert r["turns"][0] == first[(file, int(row))] and len(r["replies"]) == 1 and r["replies"][0].strip()
        kind = sources.FILE_KINDS[file.removesuffix(".jsonl.gz")][0]
        second = mt_bench[int(row)][1] if file == "mt-bench" else None
        assert r["turns"][1] == second if second else r["turns"][1] in sources.FOLLOWUPS[kind], r["from"]
    conversations = read_conversations(CORPUS / "followups.jsonl.gz")
    assert conversations[0] == (rows[0]["turns"][0], rows[0]["replies"][0], rows[0]["turns"][1])
    split = training_prompts(prompt_files=[CORPUS / "followups.jsonl.gz"])
    assert len(split.prompts) == len(rows) and split.prompts[0].turns == conversations[0]
    assert sources.followup_prompts([(r["from"], tuple(r["turns"][:1]) if not r["from"].startswith("mt-bench")
                                      else (r["turns"][0], r["turns"][1]), r["replies"][0]) for r in rows]) == rows


def test_a_conversation_file_is_checked_and_held_out(tmp_path):
    from specrt.runtime.prompts import read_conversations

    evals = eval_prompts(DATASETS_DIR)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"turns": ["a question", "more"], "replies": ["an answer"]}) + "\n"
                    + json.dumps({"turns": [evals["gsm8k"][0], "more"], "replies": ["x"]}) + "\n"
                    + json.dumps({"turns": ["single"]}) + "\n")
    assert read_conversations(path) == [("a question", "an answer", "more"), (evals["gsm8k"][0], "x", "more"),
                                         ("single",)]
    assert read_prompts_file(path) == ["a question", evals["gsm8k"][0], "single"]  # first turns, as before
    split = training_prompts(prompt_files=[path])  # a conversation opening with an eval row is dropped
    assert [p.turns for p in split.prompts] == [("a question", "an answer", "more"), ("single",)]
    path.write_text(json.dumps({"turns": ["a", "b"], "replies": []}) + "\n")
    with pytest.raises(SpecrtError, match=r"c.jsonl:1: \"replies\" must be one string per turn but the last"):
        read_conversations(path)


RESPONSES = sorted((CORPUS / "responses").glob("*.jsonl.gz"))


@pytest.mark.parametrize("path", RESPONSES, ids=[p.name for p in RESPONSES])
def test_the_committed_responses_answer_their_parts_prompts_in_order(path):
    """datasets/corpus/responses/<part>-<sampling>-<n> (scripts/corpus_generate.py): one response per training prompt
    of the part, in the order `part_prompts` gives them, each prompt's file and row recorded."""
    part, sampling, _ = path.name.removesuffix(".jsonl.gz").split("-", 2)
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    meta = json.loads(path.with_name(path.name.replace(".jsonl.gz", ".meta.json")).read_text())
    split = sources.part_prompts(part)
    assert meta["sampling"] == sampling and meta["num_prompts"] == len(rows) == len(split.prompts)
    assert [r["index"] for r in rows] == list(range(len(rows)))
    assert [(r["file"], r["row"]) for r in rows] == [
        (f"corpus/{Path(p.file).name}" if "/" in p.file else p.file, p.row) for p in split.prompts]
    assert {r["finish_reason"] for r in rows} <= {"eos", "length", "prompt_too_long"}
    assert all(r["prompt_ids"] and len(r["response_ids"]) <= meta["sampling_params"]["max_new_tokens"] for r in rows)
    assert sum(len(r["response_ids"]) for r in rows) == meta["response_tokens"]
    assert f"| `responses/{path.name}` |" in (CORPUS / "README.md").read_text()


def test_the_corpus_totals_row_is_the_committed_files_sum():
    """datasets/corpus/README.md's "all" row: the committed responses' count and response tokens, summed from their
    .meta.json files."""
    metas = [json.loads(p.read_text()) for p in sorted((CORPUS / "responses").glob("*.meta.json"))]
    readme = (CORPUS / "README.md").read_text()
    responses = sum(m["num_prompts"] for m in metas)
    tokens = sum(m["response_tokens"] for m in metas)
    assert f"| all | {responses:,} responses to " in readme and f"| **{tokens:,}** |" in readme
