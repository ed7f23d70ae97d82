"""The default model end to end (SmolLM2-135M-Instruct Q4_1 GGUF): greedy output equals transformers."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from specrt import artifact as io
from specrt.exporter.export import export_artifact
from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).parent / "fixtures" / "prompts_smoke.jsonl"
SETTINGS = io.ExportSettings(batch=4, max_seq=1024, prefill_chunk=64, verify_len=8)
NEW_TOKENS = 128


@pytest.fixture(scope="session")
def gguf() -> Path:
    from specrt.configs.fetch import default_model_path

    return default_model_path(progress=False)


@pytest.fixture(scope="session")
def smollm2_art(gguf, tmp_path_factory) -> Path:
    return export_artifact(gguf, tmp_path_factory.mktemp("smollm2") / "art", SETTINGS, progress=False)


@pytest.fixture(scope="session")
def engine(smollm2_art) -> Engine:
    return Engine(smollm2_art)


@pytest.fixture(scope="session")
def hf_model(gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompt_ids(engine) -> list[list[int]]:
    prompts = read_prompts_file(PROMPTS)
    assert [json.loads(line)["source"] for line in PROMPTS.read_text().splitlines()] == [
        "gsm8k", "humaneval", "math500", "mbpp", "mt-bench"]
    return [encode_prompt(engine.tokenizer, p) for p in prompts]


def test_artifact_of_default_model(smollm2_art, engine):
    m = io.load_manifest(smollm2_art)
    assert (m.model.family, m.model.num_layers, m.model.hidden_size) == ("llama", 30, 576)
    assert (m.model.num_heads, m.model.num_kv_heads, m.model.vocab_size) == (9, 3, 49152)
    assert m.model.tie_word_embeddings is True
    assert m.tokenizer and m.tokenizer.get("chat_template")
    assert engine.tokenizer is not None and engine.eos_ids


def test_prompts_rendered_with_chat_template(engine, gguf, prompt_ids):
    """Our template rendering + encoding gives the ids transformers' own tokenizer gives."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text, ids in zip(read_prompts_file(PROMPTS), prompt_ids):
        want = hf_tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        assert ids == list(want)
        assert engine.tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        assert len(ids) + NEW_TOKENS < SETTINGS.max_seq - 1


def _hf_greedy(model, prompt: list[int], eos: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers(engine, hf_model, prompt_ids):
    eos = sorted(engine.eos_ids)
    requests = [Request(ids, SamplingParams(max_new_tokens=NEW_TOKENS), id=i) for i, ids in enumerate(prompt_ids)]
    outputs, stats = engine.generate(requests)
    for r, o in zip(requests, outputs):
        want = _hf_greedy(hf_model, r.prompt_ids, eos, NEW_TOKENS)
        assert o.output_ids == want, f"prompt {r.id}: first difference at token " + str(
            next((i for i, (a, b) in enumerate(zip(o.output_ids, want)) if a != b), min(len(want), len(o.output_ids))))
        assert o.finish_reason == ("eos" if want[-1] in eos else "length")
        assert o.text.strip()
    assert stats.requests == 5


def test_batch_equals_single(engine, prompt_ids):
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    requests = [Request(ids, params, id=i) for i, ids in enumerate(prompt_ids)]
    batched, _ = engine.generate(requests)
    for r, o in zip(requests, batched):
        assert len(o.output_ids) == 32
        assert o.output_ids == engine.generate([r])[0][0].output_ids, f"prompt {r.id}"


def test_cli_runs_prompts_file(smollm2_art):
    from click.testing import CliRunner

    from specrt.cli import main

    result = CliRunner().invoke(main, ["run", str(smollm2_art), "--prompts", str(PROMPTS), "--limit", "3",
                                       "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert len(d["requests"]) == 3 and all(1 <= len(r["output_ids"]) <= 8 and r["text"] for r in d["requests"])
    assert d["stats"]["method"] == "ar"


@pytest.fixture(scope="session")
def smollm2_heads_art(gguf, tmp_path_factory) -> Path:
    """SmolLM2 with untrained (random) DSpark (Llama layers, block 7) and MTP heads."""
    from specrt.exporter.loaders import load_target
    from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
    from specrt.exporter.loaders.mtp import random_mtp_checkpoint

    root = tmp_path_factory.mktemp("smollm2_heads")
    target = load_target(gguf)
    draft = random_dspark_checkpoint(root / "dspark", target, layers=1, block_size=7, markov_rank=32)
    (root / "target_config").mkdir()
    (root / "target_config" / "config.json").write_text(json.dumps(target.config.to_hf()))
    mtp = random_mtp_checkpoint(root / "mtp", root / "target_config")
    settings = io.ExportSettings(batch=4, max_seq=512, prefill_chunk=64, verify_len=8)
    return export_artifact(gguf, root / "art", settings, draft=draft, mtp=mtp, progress=False)


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_untrained_heads_keep_greedy_output_identical(smollm2_heads_art, method):
    engine = Engine(smollm2_heads_art, method="ar")
    prompts = [encode_prompt(engine.tokenizer, p) for p in read_prompts_file(PROMPTS)]
    params = SamplingParams(max_new_tokens=24)
    reqs = [Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)]
    ar, _ = engine.generate(reqs)
    spec_engine = Engine(smollm2_heads_art, method=method)
    one, _ = spec_engine.generate(reqs[:1])  # batch 1
    assert one[0].output_ids == ar[0].output_ids
    spec, stats = spec_engine.generate(reqs)  # 5 mixed-length prompts on 4 slots
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    assert stats.to_dict()["rounds"] > 0


# -- the trained heads shipped for the default model ----------------------------------------------------------


@pytest.fixture(scope="session")
def shipped_art(gguf, cpp_build, tmp_path_factory) -> Path:
    """`specrt export smollm2` (the preset, which brings its shipped heads), batch 1, on specrt's kernels (the
    preset's default once libspecrt_ops is built: verifying gives each token the bits decoding gives it)."""
    from click.testing import CliRunner

    from specrt.cli import main

    out = tmp_path_factory.mktemp("smollm2_shipped") / "art"
    r = CliRunner().invoke(main, ["export", "smollm2", "--out", str(out), "--batch", "1", "--max-seq-len", "512",
                                  "--quiet"])
    assert r.exit_code == 0, r.output
    return out


def test_preset_export_carries_the_shipped_heads(shipped_art):
    from specrt.configs.presets import HEADS_DIR

    m = io.load_manifest(shipped_art)
    assert set(m.heads) == {"dspark", "mtp"} and m.gamma == 7
    assert (m.export.weights, m.export.attention, m.export.kernels) == ("gguf", "cpu", "specrt")
    cfg = json.loads((HEADS_DIR / "smollm2" / "dspark" / "config.json").read_text())
    assert list(m.heads["dspark"].temperatures) == cfg["confidence_temperatures"]
    # the shipped token counts pick the draft vocabulary (FR-Spec): the preset default, 2048 tokens with EOS
    assert m.export.draft_vocab == 2048 and len(m.heads["dspark"].vocab_ids) == 2048
    assert set(m.eos_ids) <= set(m.heads["dspark"].vocab_ids)
    size = sum(f.stat().st_size for d in ("dspark", "mtp") for f in (HEADS_DIR / "smollm2" / d).iterdir())
    assert size <= 40e6  # the committed heads stay small: bf16, embedding and head shared with the target


@pytest.mark.parametrize("method", ["dspark", "mtp", "dspark+ngram"])
def test_shipped_heads_are_trained_and_lossless(shipped_art, method):
    engine = Engine(shipped_art, method="ar")
    prompts = [encode_prompt(engine.tokenizer, p) for p in read_prompts_file(PROMPTS)][:2]
    params = SamplingParams(max_new_tokens=64)
    # fixed: every draft verified, so τ measures the head (under sps a head that does not pay here is not called);
    # a hybrid calls its head only when this machine's cost table says it pays, so its τ measures the machine
    hybrid = "+" in method
    spec_engine = Engine(shipped_art, method=method, scheduler="sps" if hybrid else "fixed")
    for i, ids in enumerate(prompts):
        req = Request(prompt_ids=ids, params=params, id=i)
        (ar,), _ = engine.generate([req])
        (spec,), stats = spec_engine.generate([req])
        assert spec.output_ids == ar.output_ids
        # an untrained head gets tau ~1.0 on these prompts; a trained one accepts drafts
        assert hybrid or stats.to_dict()["tau"] > 1.3, stats.to_dict()


def test_bench_openvino_baselines_on_the_default_model(smollm2_art, tmp_path):
    """OpenVINO GenAI (plain and prompt lookup) on the default GGUF, each in its own process, given specrt's prompt
    ids, stop tokens and budget; reported beside specrt's ar with the first difference and paired ratios."""
    pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is the optional extra specrt[openvino]")
    from click.testing import CliRunner

    from specrt.cli import main
    from specrt.tools.bench_workers import OPENVINO_LOOKUP

    lines = PROMPTS.read_text().splitlines()[:2]
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(main, ["bench", str(smollm2_art), "--prompts", str(p), "--max-new-tokens", "24",
                                  "--baseline", "openvino,openvino-lookup", "--threads", "2", "--json"])
    assert r.exit_code == 0, (r.output, r.stderr)
    report = json.loads(r.stdout)
    rows = {row["method"]: row for row in report["pooled"]}
    assert list(rows) == ["ar", "openvino", "openvino-lookup"]
    for name in ("openvino", "openvino-lookup"):
        row = rows[name]
        assert row["tokens_per_s"] > 0 and 2 <= row["generated_tokens"] <= 2 * 24
        assert row["first_difference"]["prompts"] == 2 and "identical" not in row  # reported, not required
        assert rows["ar"]["vs"][name]["median"] > 0 and row["speedup_ci"][0] <= row["speedup"]
    assert report["engines"]["openvino-lookup"]["prompt_lookup"] == OPENVINO_LOOKUP
    assert len({info["pid"] for info in report["engines"].values()}) == 3


def test_demo_compares_plain_decoding_with_speculation(cpp_build):
    """`specrt demo`: the default artifact (on specrt's kernels, built by the README's demo command), ar and
    dspark+ngram on one prompt, each one's speed, the speedup, and the outputs checked identical."""
    from click.testing import CliRunner

    from specrt.cli import main

    r = CliRunner().invoke(main, ["demo", "--max-new-tokens", "48"])
    assert r.exit_code == 0, r.output
    assert re.search(r"specrt dspark\+ngram: decode [\d.]+ tokens/s, tau [\d.]+ tokens per target call: [\d.]+x ar",
                     r.output), r.output
    assert "outputs identical: all 48 tokens (checked)" in r.output
    assert "specrt ar (gguf weights, cpu attention)" in r.output
    assert re.search(r"^kernels: specrt's \((scalar|avx2|avx512vnni|amx); .*libspecrt_ops\.so\)$", r.output, re.M), r.output
