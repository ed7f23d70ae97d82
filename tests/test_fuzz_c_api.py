"""scripts/fuzz_c_api.py on the C++ runtime's C API: random manifests, options and requests through ctypes, in a
process of its own (a crash or a hang fails the test with the input named, not the test run). A tiny Llama with a
byte-level BPE vocabulary trained here and a ChatML template, so text, chat and tokenizer calls run too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact

ROOT = Path(__file__).parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenized_model(model_dir: Path, out: Path, vocab: int) -> Path:
    """`model_dir` (a tiny HF model of `vocab` tokens) with a byte-level BPE of that many tokens, trained on the
    prompt sets, and a ChatML chat template."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(shutil.copytree(model_dir, out))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [t for f in sorted((ROOT / "datasets").glob("*.jsonl"))
             for line in f.read_text().splitlines()[:200] for t in json.loads(line)["turns"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>",
                                                           "bos_token": None, "tokenizer_class": "GPT2Tokenizer"}))
    return out


@pytest.fixture(scope="module")
def fuzz_art(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    model = tokenized_model(tiny_model_dir("llama", vocab_size=512), root / "model", 512)
    return export_artifact(model, root / "art", ExportSettings(batch=2, max_seq=96, prefill_chunk=8, verify_len=4),
                           progress=False)


def test_fuzz_the_c_api(cpp_build, fuzz_art):
    """300 inputs, a fixed seed: none crashes, hangs, or answers outside specrt.h's contract (the script checks
    statuses, one-line messages, and what tokenize / detokenize wrote)."""
    env = dict(os.environ)
    lib = cpp_build / "libspecrt.so"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_c_api.py"), str(fuzz_art), "--count", "300",
                        "--seed", "1", "--lib", str(lib), "--timeout", "120", "--json"],
                       capture_output=True, text=True, timeout=1500, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["inputs"] == 300
    returns = summary["returns"]
    # every kind of input ran, and the valid artifact's engines took requests and stepped
    assert set(summary["kinds"]) == {"manifest", "options", "requests"}
    for call in ("open:ok", "open:artifact", "open:request", "add_request:ok", "add_request:request", "add_text:ok",
                 "add_chat:ok", "tokenize:ok", "detokenize:ok", "step:ok"):
        assert returns.get(call, 0) > 0, (call, returns)


def test_texts_are_capped_before_tokenizing_and_long_runs_tokenize_in_linear_time(cpp_build, fuzz_art):
    """specrt_tokenize / specrt_add_text: a text longer than the artifact's positions could hold whatever it
    tokenizes to is one error before any tokenizing (2,000,000 characters without a space took minutes); a long run
    under the cap tokenizes in time linear in its length."""
    import ctypes as C
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("fuzz_c_api", ROOT / "scripts" / "fuzz_c_api.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    api = fuzz.load(cpp_build / "libspecrt.so")
    engine = C.c_void_p()
    assert api.specrt_engine_open(str(fuzz_art).encode(), None, C.byref(engine)) == 0, api.specrt_last_error()
    try:
        out, n, rid = (C.c_int64 * 100_000)(), C.c_size_t(), C.c_int64()
        start = time.monotonic()
        assert api.specrt_tokenize(engine, b"a" * 2_000_000, 1, out, 100_000, C.byref(n)) == 2
        assert api.specrt_add_text(engine, b"a" * 2_000_000, 1, None, C.byref(rid)) == 2
        assert time.monotonic() - start < 1
        message = api.specrt_last_error().decode()
        assert "the text is 2000000 bytes, more than the artifact's 95 positions could hold" in message, message
    finally:
        api.specrt_engine_close(engine)
    # the tokenizer alone (no cap): a run 8x longer takes well under 64x the time
    times = {}
    for size in (50_000, 400_000):
        line = json.dumps({"text": "ab" * (size // 2), "add_special": False}) + "\n"
        start = time.monotonic()
        r = subprocess.run([str(cpp_build / "tokenize"), str(fuzz_art / "tokenizer" / "tokenizer.json")], input=line,
                           capture_output=True, text=True, timeout=120)
        times[size] = time.monotonic() - start
        assert r.returncode == 0 and json.loads(r.stdout)["ids"], r.stderr
    assert times[400_000] < 24 * times[50_000], times
