"""`specrt profile`: the measured cost table, how it is stored in the artifact and read back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrt.artifact import ExportSettings
from specrt.cli import main
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.runtime.engine import Engine
from specrt.runtime.profile import (PROFILE_FILE, Profile, load_profile, placement, profile_options,
                                    save_profile)
from specrt.runtime.measure import measure

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "art"
    return export_artifact(FIXTURE / "target", out, ExportSettings(batch=2, max_seq=64, prefill_chunk=8,
                                                                   verify_len=3), draft=FIXTURE / "draft",
                           progress=False)


def test_measure_covers_every_bucket(art):
    p = measure(art, threads=1, position=20, repeats=1, calls=1, progress=False)
    # total verified tokens: one slot 1..verify_len; two slots a decode step (2) and the packed budgets above it
    assert sorted(p.verify) == [1, 2] and sorted(p.verify[1]) == [1, 2, 3] and sorted(p.verify[2]) == [2, 4, 6]
    assert sorted(p.draft) == ["dspark"] and sorted(p.draft["dspark"]) == [1, 2]
    assert all(ms > 0 for row in p.verify.values() for ms in row.values())
    assert p.step_ms(1) == p.verify[1][1] and p.step_ms(2) == p.verify[2][2]
    assert p.verify_ms(2, 3) == p.verify[2][4]  # rounded up to the next profiled budget
    assert p.verify_ms(2, 9) == p.verify[2][6]  # beyond the table: its last column
    assert p.draft_ms("ngram", 1) == 0.0  # no graph
    s = p.summary()
    assert s["verify_steps"][1] == 1.0 and s["draft_steps"]["dspark"] > 0


def test_draft_calls_are_timed_after_a_target_step(art, monkeypatch):
    """As in a round, a draft call follows the target's (whose weights have just evicted the head's from the caches):
    timed back to back the head measured ~30% cheaper than an engine sees it. Every draft call after the warm-up is
    preceded by a decoding step of the same batch."""
    import specrt.runtime.measure as tools_profile

    calls = []  # (graph, bucket) in call order
    real = tools_profile.load_runner

    def recording(backend, art_dir, manifest, name, **kw):
        r = real(backend, art_dir, manifest, name, **kw)
        run = r.run

        def logged(slot, bucket, **k):
            calls.append((name, dict(bucket)))
            return run(slot, bucket, **k)

        r.run = logged
        return r

    monkeypatch.setattr(tools_profile, "load_runner", recording)
    measure(art, threads=1, position=20, repeats=2, calls=2, progress=False)
    warm_up = 3 + 3 + 2 * 2  # every configuration once: verify budgets of batch 1 and 2, drafts of 1 and 2 rows
    assert [name for name, _ in calls[:warm_up]].count("dspark") == 4
    timed = calls[warm_up:]
    drafts = [i for i, (name, _) in enumerate(timed) if name == "dspark"]
    assert len(drafts) == 2 * 2 * 2 * 2  # repeats x calls x batches x rows
    for i in drafts:
        name, bucket = timed[i - 1]
        assert i > 0 and name == "target" and bucket["T"] == 1 and bucket["B"] == timed[i][1]["B"]
    assert len(timed) == 2 * 2 * (6 + 4 * 2)  # the verify calls, and each draft call with its step


def test_measure_on_the_torch_backend_in_another_precision(art):
    """The GPU check measures its table this way (device="cuda" there); ONNX Runtime takes no device or dtype."""
    p = measure(art, backend="torch", device="cpu", dtype="bfloat16", threads=1, position=20, repeats=1, calls=1,
                progress=False)
    assert p.backend == "torch@cpu:bfloat16" and sorted(p.verify[2]) == [2, 4, 6] and p.draft_ms("dspark", 1) > 0
    with pytest.raises(SpecrtError, match="torch backend's"):
        measure(art, device="cpu", dtype="bfloat16", threads=1, position=20, repeats=1, calls=1, progress=False)
    # stored apart from the CPU's float32 table, and what an engine in that precision plans on
    save_profile(art, p)
    assert load_profile(art, backend="torch@cpu:bfloat16", threads=1) == p
    assert load_profile(art, backend="torch", threads=1) is None
    assert placement("torch", "cuda", "bfloat16") == "torch@cuda:bfloat16" and placement("ort") == "ort"
    assert profile_options("torch@cuda:bfloat16") == " --backend torch --device cuda --dtype bfloat16"
    with Engine(art, method="dspark", scheduler="sps", backend="torch", dtype="bfloat16", threads=1) as engine:
        assert engine.costs.profile == p
    with pytest.raises(SpecrtError, match="--backend torch --device cpu --dtype float16"):
        Engine(art, method="dspark", scheduler="sps", backend="torch", dtype="float16", threads=1)
    (art / PROFILE_FILE).unlink()


def test_saved_per_backend_and_threads(art):
    p = measure(art, threads=1, position=20, repeats=1, calls=1, progress=False)
    save_profile(art, p)
    q = Profile.from_dict({**p.to_dict(), "threads": 2, "verify": {"1": {"1": 9.0}}, "draft": {}})
    save_profile(art, q)
    data = json.loads((art / PROFILE_FILE).read_text())
    assert sorted(data["profiles"]) == ["ort/1", "ort/2"]
    assert load_profile(art, threads=1) == p
    assert load_profile(art, threads=2).verify == {1: {1: 9.0}}
    assert load_profile(art, threads=7).backend == "ort"  # another thread count: the backend's first entry
    assert load_profile(art, backend="torch") is None
    (art / PROFILE_FILE).write_text("{oops")
    with pytest.raises(SpecrtError, match="not a specrt profile"):
        load_profile(art)
    (art / PROFILE_FILE).unlink()


def test_cli(art, tmp_path):
    r = CliRunner().invoke(main, ["profile", str(art), "--threads", "1", "--position", "20", "--repeats", "1",
                                  "--json", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["in_steps"]["verify_steps"]["1"] == 1.0 and (tmp_path / "p.png").stat().st_size > 0
    assert load_profile(art, threads=1) is not None
    r = CliRunner().invoke(main, ["profile", str(art), "--position", "70"])
    assert r.exit_code != 0 and "--position must be between" in r.output
    r = CliRunner().invoke(main, ["profile", str(art), "--plot", str(tmp_path / "p.svg")])
    assert r.exit_code != 0 and "PNG" in r.output
    r = CliRunner().invoke(main, ["profile", str(tmp_path / "missing")])
    assert r.exit_code != 0 and "Traceback" not in r.output


def test_the_engine_plans_on_a_profile_it_is_given_and_never_measures_one(tmp_path_factory):
    """An artifact without a stored profile: an engine whose rounds plan on costs refuses with the fix named; given a
    profile (what `Engine.open` measures once per process, with a warning) it runs on that one; methods that plan on
    nothing need none."""
    from specrt.runtime.engine import Engine
    from specrt.runtime.config import EngineConfig
    from specrt.runtime.engine import Engine

    bare = export_artifact(FIXTURE / "target", tmp_path_factory.mktemp("bare") / "art",
                           ExportSettings(batch=1, max_seq=64, prefill_chunk=8, verify_len=3), draft=FIXTURE / "draft",
                           progress=False)
    assert load_profile(bare) is None
    with pytest.raises(SpecrtError, match=r"has none for ort: run `specrt profile .*art` once"):
        Engine(bare, method="dspark", scheduler="sps", threads=1)
    with Engine(bare, method="dspark", scheduler="fixed", threads=1) as engine:
        assert engine.costs is None
    given = measure(bare, threads=1, position=20, repeats=1, calls=1, progress=False)
    with Engine(bare, method="dspark+ngram", threads=1, profile=given) as engine:
        assert engine.costs is not None and "profile measured" in engine.costs.source
    with Engine.open(bare, EngineConfig(method="dspark", scheduler="sps", threads=1)) as engine:
        assert engine.costs is not None
    assert load_profile(bare) is None  # measured for this process, never written into the artifact
