"""FR-Spec draft vocabularies (`specrt export --draft-vocab N`): token counts, the chosen subset, the reduced
DSpark and MTP graphs against the full ones, and exactness (greedy identity, the target distribution under
sampling)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specrt import artifact as io
from specrt.artifact import ExportSettings
from specrt.cli import main
from specrt.exporter.vocab import count_tokens, coverage, draft_vocab, read_counts, write_counts
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint
from specrt.runtime.backends import infer, load_runner
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams

from test_speculative import _exact_pair_probs, _pvalue, peaked  # noqa: F401 (a fixture)
from power import ALPHA, samples_for

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
VOCAB = 512  # the fixture's


def test_counts_and_subset():
    counts = count_tokens([[1, 2, 2, 5], [5, 5, 7]], 8)
    assert counts.tolist() == [0, 1, 2, 0, 0, 3, 0, 1]
    assert draft_vocab(counts, 3).tolist() == [1, 2, 5]  # 5 (3), 2 (2), then 1 before 7 (tie: lower id)
    assert draft_vocab(counts, 3, keep=[0]).tolist() == [0, 2, 5]  # EOS kept whatever its count
    assert draft_vocab(counts, 6).tolist() == [0, 1, 2, 3, 5, 7]  # unseen tokens by id
    assert coverage(counts, np.array([5, 2])) == pytest.approx(5 / 7)
    with pytest.raises(SpecrtError, match="between"):
        draft_vocab(counts, 9)
    with pytest.raises(SpecrtError, match="outside the vocabulary"):
        count_tokens([[8]], 8)


def test_counts_file_errors(tmp_path):
    write_counts(tmp_path / "c.npy", np.arange(8))
    assert read_counts(tmp_path / "c.npy", 8).tolist() == list(range(8))
    with pytest.raises(SpecrtError, match="not non-negative counts for a 16-token"):
        read_counts(tmp_path / "c.npy", 16)
    (tmp_path / "bad.npy").write_text("nope")
    with pytest.raises(SpecrtError, match="not a token-count file"):
        read_counts(tmp_path / "bad.npy", 8)
    with pytest.raises(SpecrtError, match="not found"):
        read_counts(tmp_path / "missing.npy", 8)


def _prompts() -> list[list[int]]:
    """DeepSpec's own trace prompts (its head gets drafts accepted on them) and two random ones."""
    rng = np.random.default_rng(11)
    return ([s["prompt_ids"] for s in json.loads((FIXTURE / "expected_trace.json").read_text())["samples"]]
            + [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (5, 13)])


def _ar_counts(art: Path, out: Path) -> Path:
    """Counts of the fixture target's own greedy outputs (what distillation counts), on the prompts the
    tests decode: the fixture's head only gets repeated tokens right, so its vocabulary must hold them."""
    outs, _ = Engine(art, method="ar", threads=1).generate(
        [Request(prompt_ids=p, params=SamplingParams(max_new_tokens=40, ignore_eos=True), id=i)
         for i, p in enumerate(_prompts())])
    write_counts(out, count_tokens([o.output_ids for o in outs], VOCAB))
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fr")
    s = ExportSettings(batch=4, max_seq=256, prefill_chunk=16, verify_len=5)
    mtp = random_mtp_checkpoint(root / "mtp", FIXTURE / "target", seed=5)  # shares the target's head
    full = export_artifact(FIXTURE / "target", root / "full", s, draft=FIXTURE / "draft", mtp=mtp, progress=False)
    counts = _ar_counts(full, root / "counts.npy")
    small = export_artifact(FIXTURE / "target", root / "small", dataclasses.replace(s, draft_vocab=64),
                            draft=FIXTURE / "draft", mtp=mtp, token_counts=counts, progress=False)
    return {"full": full, "small": small, "counts": counts}


def test_manifest_records_the_vocabulary(arts):
    m = io.load_manifest(arts["small"])
    ids = np.asarray(m.heads["dspark"].vocab_ids)
    assert m.heads["mtp"].vocab_ids == m.heads["dspark"].vocab_ids  # one vocabulary per export
    assert m.export.draft_vocab == 64 and len(ids) == 64 and (np.diff(ids) > 0).all()
    counts = read_counts(arts["counts"], VOCAB)
    assert set(m.eos_ids) <= set(ids.tolist())
    assert counts[ids].min() >= np.sort(counts)[-64 + len(m.eos_ids)]  # the most frequent ones
    for head in ("dspark", "mtp"):
        probs = next(t for t in m.graphs[head].outputs if t.name == io.DRAFT_PROBS)
        assert probs.shape[-1] == 64
    assert not io.load_manifest(arts["full"]).heads["dspark"].vocab_ids
    shown = CliRunner().invoke(main, ["inspect", str(arts["small"])])
    assert shown.exit_code == 0 and "draft vocabulary of 64 tokens" in shown.output


def _head_call(art: Path, head: str, backend: str = "ort") -> dict[str, np.ndarray]:
    """One propose call of `head` on one slot with fixed inputs (DSpark: 5 context rows, MTP: 3)."""
    r = load_runner(backend, art, io.load_manifest(art), head, threads=1)
    r.allocate(1)
    c = 5 if head == "dspark" else 3
    rng = np.random.default_rng(3 if head == "dspark" else 4)
    feeds = {t.name: np.zeros(t.resolve({"B": 1, "C": c}), t.dtype) for t in r.spec.host_inputs()}
    if head == "dspark":
        feeds[io.CTX_FEATURES][:] = rng.standard_normal(feeds[io.CTX_FEATURES].shape)
        feeds[io.CTX_POSITIONS][0] = np.arange(c)
        feeds[io.CTX_LEN][:] = c
        feeds[io.ANCHOR_IDS][:] = 17
    else:
        feeds[io.MTP_TOKENS][0] = [17, 40, 3]
        feeds[io.MTP_HIDDEN][:] = rng.standard_normal(feeds[io.MTP_HIDDEN].shape)
        feeds[io.MTP_POSITIONS][0] = np.arange(c)
        feeds[io.MTP_LAST_ROW][:] = c - 1
    return {k: v.copy() for k, v in infer(r, 0, feeds).items()}


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_reduced_graph_scores_the_same_columns(arts, backend):
    """The first draft position sees the same Markov input (the anchor) in both graphs: its logits over the
    draft vocabulary are the full graph's logits in those columns, and its token is their argmax's id."""
    full, small = _head_call(arts["full"], "dspark", backend), _head_call(arts["small"], "dspark", backend)
    ids = np.asarray(io.load_manifest(arts["small"]).heads["dspark"].vocab_ids)
    np.testing.assert_allclose(small[io.DRAFT_LOGITS][:, 0], full[io.DRAFT_LOGITS][:, 0, ids], atol=1e-4)
    assert small[io.DRAFT_TOKENS][0, 0] == ids[np.argmax(full[io.DRAFT_LOGITS][0, 0, ids])]
    assert np.isin(small[io.DRAFT_TOKENS], ids).all()
    np.testing.assert_allclose(small[io.DRAFT_PROBS].sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(small[io.CONFIDENCE_LOGITS][:, 0], full[io.CONFIDENCE_LOGITS][:, 0], atol=1e-5)


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_reduced_mtp_head_scores_the_same_columns(arts, backend):
    """MTP's first chained step sees the same input in both graphs: its logits over the draft vocabulary are
    the full head's in those columns; every draft is a vocabulary token, fed back by its token id."""
    full, small = _head_call(arts["full"], "mtp", backend), _head_call(arts["small"], "mtp", backend)
    ids = np.asarray(io.load_manifest(arts["small"]).heads["mtp"].vocab_ids)
    np.testing.assert_allclose(small[io.DRAFT_LOGITS][:, 0], full[io.DRAFT_LOGITS][:, 0, ids], atol=1e-4)
    assert small[io.DRAFT_TOKENS][0, 0] == ids[np.argmax(full[io.DRAFT_LOGITS][0, 0, ids])]
    assert np.isin(small[io.DRAFT_TOKENS], ids).all()
    np.testing.assert_allclose(small[io.DRAFT_PROBS].sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("method", ["dspark", "mtp"])
@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_greedy_output_unchanged(arts, backend, method):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reqs = [Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(_prompts())]
    ar, _ = Engine(arts["full"], method="ar", threads=1).generate(reqs)
    spec, stats = Engine(arts["small"], method=method, threads=1, backend=backend).generate(reqs)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    if method == "dspark":  # the fixture's trained head; the random MTP head rarely guesses right
        assert sum(a for _, a, _ in stats.rounds) > 0  # the reduced head still gets drafts accepted


def test_sampling_keeps_the_target_distribution(peaked, tmp_path):  # noqa: F811
    """q is zero outside the draft vocabulary; rejection sampling's residual covers the rest, exactly."""
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=21, ignore_eos=True)
    target = peaked["target"]
    draft = random_dspark_checkpoint(tmp_path / "draft", target, layers=1, block_size=3, markov_rank=8, init_std=0.5)
    write_counts(tmp_path / "counts.npy", np.arange(32)[::-1])  # keeps tokens 0..7
    art = export_artifact(target, tmp_path / "art", ExportSettings(batch=8, max_seq=32, prefill_chunk=8, verify_len=4,
                                                                   draft_vocab=8),
                          draft=draft, token_counts=tmp_path / "counts.npy", progress=False)
    prompt = [5, 9, 14, 3]
    probs = _exact_pair_probs(target, prompt, params)
    outs, _ = Engine(art, method="dspark", threads=1).generate(
        [Request(prompt_ids=prompt, params=params, id=i) for i in range(samples_for(probs))])  # tests/power.py
    pairs = np.array([o.output_ids[:2] for o in outs])
    assert _pvalue(pairs, probs) > ALPHA
    assert (pairs[:, 1] >= 8).any()  # tokens outside the draft vocabulary still come (from the residual)


def test_cli_errors(tmp_path):
    r = CliRunner().invoke(main, ["export", str(FIXTURE / "target"), "--out", str(tmp_path / "a"), "--draft-vocab",
                                  "8", "--quiet"])
    assert r.exit_code != 0 and "give --draft or --mtp" in r.output and not (tmp_path / "a").exists()
    r = CliRunner().invoke(main, ["export", str(FIXTURE / "target"), "--out", str(tmp_path / "b"), "--draft",
                                  str(FIXTURE / "draft"), "--draft-vocab", "8", "--quiet"])
    assert r.exit_code != 0 and "give --token-counts" in r.output and not (tmp_path / "b").exists()
    write_counts(tmp_path / "c.npy", np.ones(VOCAB, np.int64))
    r = CliRunner().invoke(main, ["export", str(FIXTURE / "target"), "--out", str(tmp_path / "c"), "--draft",
                                  str(FIXTURE / "draft"), "--draft-vocab", "9999", "--token-counts",
                                  str(tmp_path / "c.npy"), "--quiet"])
    assert r.exit_code != 0 and "--draft-vocab must be between" in r.output and not (tmp_path / "c").exists()
    r = CliRunner().invoke(main, ["export", str(FIXTURE / "target"), "--out", str(tmp_path / "d"), "--draft-vocab",
                                  "-3", "--quiet"])
    assert r.exit_code != 0 and "--draft-vocab must be" in r.output


def test_heads_with_their_counts_get_the_default_vocabulary(arts, tmp_path, monkeypatch):
    """A head exported with the token counts `specrt distill` writes beside it scores the default draft vocabulary
    (the fixture's vocabulary is smaller than 2048, so the default is scaled down here); without counts, all of it."""
    import specrt.exporter.vocab as vocab
    from specrt.exporter.vocab import default_draft_vocab

    assert default_draft_vocab([]) == 0 and default_draft_vocab([arts["counts"]]) == 0  # 512 tokens: not larger
    monkeypatch.setattr(vocab, "DEFAULT_DRAFT_VOCAB", 64)
    assert default_draft_vocab([arts["counts"]]) == 64
    (tmp_path / "bad.npy").write_text("not counts")
    with pytest.raises(SpecrtError, match="bad.npy is not a token-count file"):
        default_draft_vocab([tmp_path / "bad.npy"])
    args = ["export", str(FIXTURE / "target"), "--batch", "1", "--max-seq-len", "64", "--prefill-chunk", "8",
            "--draft", str(FIXTURE / "draft"), "--no-profile"]
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "with"), "--token-counts", str(arts["counts"])])
    assert r.exit_code == 0, r.output
    assert "draft vocabulary: the 64 tokens" in r.output
    assert len(io.load_manifest(tmp_path / "with").heads["dspark"].vocab_ids) == 64
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "without"), "--quiet"])  # the fixture has no counts
    assert r.exit_code == 0, r.output
    assert not io.load_manifest(tmp_path / "without").heads["dspark"].vocab_ids
