"""`specrt bench --baseline llama.cpp` (optional extra specrt[llama]) on a tiny random GGUF; its one-line errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.tools import bench as b
from specrt.tools.bench_workers import LOADERS, EngineSpec
from test_cli import EXPORT_FLAGS, assert_one_line_error, cli

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
TEMPLATE = "{% for m in messages %}user: {{ m['content'] }}\nassistant:{% endfor %}"
MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the")]


def byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order (a byte-level BPE vocabulary's base)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[i] for i in range(256)]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A random 2-layer llama GGUF (F32) with a byte-level BPE vocabulary both specrt and llama.cpp load."""
    import gguf

    tokens = ["<pad>", "<s>", "</s>", *byte_tokens(), *("".join(m) for m in MERGES)]
    vocab, head_dim = len(tokens), HIDDEN // HEADS
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(seed)

    def rand(*shape: int, std: float) -> np.ndarray:  # numpy layout (out, in); the writer reverses it for GGUF
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, HIDDEN, std=1.0))
    w.add_tensor("output.weight", rand(vocab, HIDDEN, std=1.0))  # untied (a tied head repeats one token); peaky
    w.add_tensor("output_norm.weight", 1 + rand(HIDDEN, std=0.1))
    for i in range(LAYERS):
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV_HEADS * head_dim, HIDDEN)),
                            ("attn_v", (KV_HEADS * head_dim, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape, std=shape[1] ** -0.5))
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + rand(HIDDEN, std=0.1))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + rand(HIDDEN, std=0.1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prompts_file(path: Path, *texts: str) -> Path:
    path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    return path


# -- without the extra --------------------------------------------------------------------------------------


def test_parse_baselines():
    assert b.parse_baselines(["none"]) == []
    assert b.parse_baselines(["hf", "llama.cpp", "hf"]) == ["hf", "llama.cpp"]
    assert b.parse_baselines(["llama.cpp, hf"]) == ["llama.cpp", "hf"]
    with pytest.raises(SpecrtError, match="unknown baseline 'vllm'"):
        b.parse_baselines(["hf,vllm"])
    with pytest.raises(SpecrtError, match="none cannot be combined"):
        b.parse_baselines(["none", "hf"])


def test_first_difference():
    assert b.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert b.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert b.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped (EOS) where the other went on
    s = b.difference_summary([[1, 2], [7], [1, 2, 3]], [[1, 2], [1], [1, 2, 4]])
    assert s == {"identical_prompts": 1, "prompts": 3, "min_index": 0, "mean_index": 1.0, "per_prompt": [None, 0, 2]}


def test_missing_extra_is_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    p = prompts_file(tmp_path / "p.jsonl", "the cat")
    # fails before the artifact is opened, so a missing artifact does not hide it
    assert_one_line_error(cli("bench", tmp_path / "no-art", "--prompts", p, "--baseline", "hf,llama.cpp"),
                          "--baseline llama.cpp needs llama_cpp: pip install 'specrt[llama]'",
                          "builds llama.cpp from source")
    assert_one_line_error(cli("bench", tmp_path / "no-art", "--prompts", p, "--baseline", "hf,vllm"),
                          "--baseline: unknown baseline 'vllm'")


# -- with llama-cpp-python ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the optional extra specrt[llama]")
    return write_tiny_gguf(tmp_path_factory.mktemp("llama_cpp") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_art(tiny_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama_cpp_art") / "art"
    result = cli("export", tiny_gguf, "--out", out, *EXPORT_FLAGS)
    assert result.exit_code == 0, result.output
    return out


def test_greedy_stops_at_max_new_tokens_and_eos(tiny_gguf):
    generate, describe = LOADERS["llama.cpp"](EngineSpec("llama.cpp", "", source=str(tiny_gguf), threads=1, n_ctx=64))
    ids = [4, 5, 6, 7, 8]
    g = generate(ids, 12, [])
    out = g.tokens
    assert len(out) == 12 and len(g.times) == 12 and 0 < g.times[0] <= g.times[-1]
    assert g.times == sorted(g.times) and g.decode_rate() > 0
    assert generate(ids, 12, []).tokens == out  # a fresh context per prompt: the same tokens again
    stop = out[3]
    cut = generate(ids, 12, [stop]).tokens
    assert cut == out[:out.index(stop) + 1]  # the EOS that ends it is kept, like specrt's output_ids
    assert describe()["threads"] == 1


def test_bench_llama_cpp_next_to_specrt(tiny_art, tmp_path):
    p = prompts_file(tmp_path / "p.jsonl", "the cat sat", "then the dog ran home")
    r = cli("bench", tiny_art, "--prompts", p, "--max-new-tokens", 16, "--baseline", "hf",
            "--baseline", "llama.cpp", "--threads", 1, "--json")
    assert r.exit_code == 0, (r.output, r.stderr)
    report = json.loads(r.stdout)
    assert report["identical"] is True  # specrt ar and hf; llama.cpp is reported, not required to match
    rows = {row["method"]: row for row in report["pooled"]}
    assert list(rows) == ["ar", "hf", "llama.cpp"]
    ll = rows["llama.cpp"]
    assert ll["tokens_per_s"] > 0 and ll["speedup"] > 0 and ll["generated_tokens"] > 0
    assert ll["first_difference"]["prompts"] == 2 and len(ll["first_difference"]["per_prompt"]) == 2
    assert rows["hf"]["first_difference"]["identical_prompts"] == 2
    # F32 weights and peaky logits: llama.cpp's f16 KV cache does not flip this tiny model's argmax
    assert ll["first_difference"]["identical_prompts"] == 2, ll["first_difference"]

    text = cli("bench", tiny_art, "--prompts", p, "--max-new-tokens", 4, "--baseline", "llama.cpp", "--threads", 1)
    assert text.exit_code == 0, (text.output, text.stderr)
    assert "llama.cpp vs ar: identical tokens on" in text.stdout
