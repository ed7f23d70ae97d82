"""`specrt bench --concurrency`: requests in flight through the online engine, per method and scheduler."""
from __future__ import annotations

import json
from statistics import median

import pytest
from click.testing import CliRunner

from specrt.artifact import ExportSettings
from specrt.cli import main
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint

from test_distill_cli import target  # noqa: F401 (a fixture: a tiny llama with a word-level tokenizer)


@pytest.fixture(scope="module")
def art(target, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("conc")
    draft = random_dspark_checkpoint(root / "draft", target, layers=1, block_size=4, markov_rank=8)
    return export_artifact(target, root / "art", ExportSettings(batch=4, max_seq=96, prefill_chunk=16, verify_len=5),
                           draft=draft, progress=False)


def _prompts(tmp_path):
    """Prompts as text: the tiny models have a word-level tokenizer when built with one (see conftest)."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"turns": [f"{w} " * (3 + i)]}) + "\n"
                         for i, w in enumerate("the a cat dog sat ran".split())))
    return f


def test_rows_for_every_level_method_and_scheduler(art, tmp_path):
    r = CliRunner().invoke(main, ["bench", str(art), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "12",
                                  "--methods", "ar,dspark,ngram", "--concurrency", "1,4", "--schedulers", "fixed,sps",
                                  "--threads", "1", "--json", "--plot", str(tmp_path / "c.png")])
    assert r.exit_code == 0, r.output
    report = json.loads(next(line for line in r.output.splitlines() if line.startswith("{")))
    assert r.output.count("no ort cost profile") == 1  # measured once, then reused in the process
    assert report["identical"] and report["levels"] == [1, 4] and report["prompts"] == 6
    keys = {(row["method"], row["scheduler"], row["concurrency"]) for row in report["rows"]}
    assert keys == {(m, s, c) for c in (1, 4) for m, s in
                    [("ar", "-"), ("dspark", "fixed"), ("dspark", "sps"), ("ngram", "fixed"), ("ngram", "sps")]}
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and row["per_request_tokens_per_s"] > 0 and row["identical"]
        assert row["generated_tokens"] == 6 * 12
        assert row["tau"] >= 1.0 and (row["method"] != "ar" or row["mean_verify_len"] == 0.0)
        # parts of the wall time (rounded to the millisecond, hence the slack)
        assert 0 < row["prefill_s"] and 0 < row["decode_s"]
        assert row["prefill_s"] + row["decode_s"] <= row["wall_s"] + 0.002
        if row["method"] != "ar":
            assert row["draft_s"] + row["verify_s"] <= row["decode_s"] + 0.002
    at4 = [row for row in report["rows"] if row["concurrency"] == 4]
    assert max(row["vs_best_of_ar_and_fixed"] for row in at4 if row["scheduler"] in ("-", "fixed")) == 1.0
    assert (tmp_path / "c.png").stat().st_size > 0


def test_repeats_interleave_passes(art, tmp_path):
    """--repeats with --concurrency: every engine serves every pass (outputs identical each time), and a row's
    numbers are medians over its passes."""
    r = CliRunner().invoke(main, ["bench", str(art), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "8",
                                  "--methods", "ar,ngram", "--concurrency", "2", "--schedulers", "fixed,sps",
                                  "--repeats", "3", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(next(line for line in r.output.splitlines() if line.startswith("{")))
    assert report["identical"] and report["repeats"] == 3 and len(report["rows"]) == 3
    for row in report["rows"]:
        passes = sorted(row["passes_tokens_per_s"])
        assert len(passes) == 3 and row["tokens_per_s"] == passes[1] and row["generated_tokens"] == 6 * 8


def test_bracket_rates_each_engine_against_the_ar_passes_around_it(art, tmp_path):
    """--bracket: AR serves before every other engine and after the last, in every pass; an engine's ratio is the
    median over passes of its tok/s over the best of the mean of those two AR passes and the pass's fixed rows."""
    r = CliRunner().invoke(main, ["bench", str(art), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "8",
                                  "--methods", "ar,ngram", "--concurrency", "2", "--schedulers", "fixed,sps",
                                  "--repeats", "2", "--bracket", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(next(line for line in r.output.splitlines() if line.startswith("{")))
    assert report["identical"] and report["bracket"] and len(report["rows"]) == 3
    ar, fixed, sps = report["rows"]
    assert (ar["method"], fixed["scheduler"], sps["scheduler"]) == ("ar", "fixed", "sps")
    runs = ar["passes_tokens_per_s"]
    assert len(runs) == 2 * 3 and ar["tokens_per_s"] == pytest.approx(median(runs), abs=1e-3)  # AR, X, AR, Y, AR
    first, second = runs[:3], runs[3:]
    # pass 1 serves fixed then sps, pass 2 sps then fixed (rotating)
    around = [round((a + b) / 2, 3) for a, b in ((first[0], first[1]), (first[1], first[2]),
                                                 (second[0], second[1]), (second[1], second[2]))]
    assert fixed["ar_around_tokens_per_s"] == [around[0], around[3]]
    assert sps["ar_around_tokens_per_s"] == [around[1], around[2]]
    for row in (fixed, sps):
        ratios = [x / max(a, f) for x, a, f in zip(row["passes_tokens_per_s"], row["ar_around_tokens_per_s"],
                                                  fixed["passes_tokens_per_s"])]
        assert row["vs_best_of_ar_and_fixed"] == pytest.approx(sum(ratios) / 2, abs=2e-3)


def test_bad_concurrency_requests(art, tmp_path):
    art, prompts = str(art), str(_prompts(tmp_path))
    for extra, message in ((["--concurrency", "8"], "between 1 and the artifact's 4 request slots"),
                           (["--concurrency", "1,x"], "comma-separated integers"),
                           (["--concurrency", "1", "--schedulers", "fixed,nope"], "unknown scheduler nope"),
                           (["--schedulers", "sps"], "--schedulers goes with --concurrency"),
                           (["--concurrency", "1", "--baseline", "hf"], "--baseline runs at batch 1"),
                           (["--concurrency", "1", "--repeats", "0"], "--repeats must be >= 1"),
                           (["--bracket"], "--bracket goes with --concurrency")):
        r = CliRunner().invoke(main, ["bench", art, "--prompts", prompts, "--methods", "ar,ngram", *extra])
        assert r.exit_code != 0 and message in r.output, (extra, r.output)
        assert "Traceback" not in r.output
