"""Shared fixtures: tiny random Hugging Face models of every supported family, built in the test."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "llama3_scaled", "mistral", "llama_bias")

# A pool per ONNX Runtime session in the test process and the processes it starts: tests open sessions of their own,
# which ONNX Runtime refuses once a process has the global pool the `specrt` command defaults to (the command run
# in-process by CliRunner would give it one). The default is tested in processes of its own (test_hybrid.py).
os.environ["SPECRT_ORT_SHARED_POOL"] = "0"


def build_tiny_hf_model(out_dir: Path, kind: str, *, tie: bool | None = None, seed: int = 0,
                        vocab_size: int = 256, num_layers: int = 2) -> Path:
    """Save a random tiny transformers model of `kind` to `out_dir` (config.json + safetensors)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if kind in ("llama", "llama_bias"):  # llama_bias: attention_bias on q/k/v/o (and mlp_bias off)
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=True if tie is None else tie,
                             rope_theta=10000.0, attention_bias=kind == "llama_bias")
        cls = tf.LlamaForCausalLM
    elif kind == "llama3_scaled":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False if tie is None else tie,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(**common, tie_word_embeddings=False if tie is None else tie,
                               sliding_window=None)
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True if tie is None else tie,
                             rope_theta=1000000.0)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False if tie is None else tie,
                             rope_theta=1000000.0)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so those code paths are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(kind, tie=None, seed=0) -> Path of a saved HF model directory."""
    cache: dict[tuple, Path] = {}

    def make(kind: str, *, tie: bool | None = None, seed: int = 0, **kw) -> Path:
        key = (kind, tie, seed, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{kind}")
            cache[key] = build_tiny_hf_model(d, kind, tie=tie, seed=seed, **kw)
        return cache[key]

    return make


def shared_dir(tmp_path_factory) -> Path:
    """A folder every worker of this test run sees (pytest-xdist: the one above the workers' own), so what a session
    fixture makes once is made once per run, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, name: str, make) -> Path:
    """`make(path)` run by the first worker to ask (the others wait for it, then share the result); returns path."""
    import fcntl

    root = shared_dir(tmp_path_factory)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            if out.exists():  # a worker that failed half-way
                import shutil

                shutil.rmtree(out)
            make(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def served_art(tmp_path_factory, request) -> Path:
    """`specrt export smollm2` (the default model with its shipped heads) at batch 4, 512 positions: what the
    server tests serve (made once per run, read by every worker). On specrt's CPU kernels (libspecrt_ops, built
    by conftest's cpp_build) as the README's build gives a user: their rows are computed alone, so a server's batch
    gives each request the tokens a direct run gives it. ONNX Runtime's stock kernels do not promise that (on an
    AVX2-only CPU a 1-row MatMulNBits call and the same row among several differ in the last bits), so they serve
    here only where nothing can be built."""
    from click.testing import CliRunner

    from specrt.cli import main

    try:
        request.getfixturevalue("cpp_build")
        kernels = "specrt"
    except pytest.skip.Exception:
        kernels = "stock"

    def export(out: Path) -> None:
        r = CliRunner().invoke(main, ["export", "smollm2", "--out", str(out), "--batch", "4", "--max-seq-len", "512",
                                      "--kernels", kernels, "--quiet"])
        assert r.exit_code == 0, r.output

    return made_once(tmp_path_factory, f"smollm2_served_{kernels}", export)


# The C++ runtime, the custom-op library and their test programs (runtime/cpp), built once per session by the build
# `pip install` runs (scripts/native_build.py: CMake against ONNX Runtime's headers, fetched once from Debian's archive).
# SPECRT_CPP_SANITIZE=1: with AddressSanitizer and UndefinedBehaviorSanitizer, into build/cpp-asan (docs/cpp.md).
# SPECRT_CPP_BUILD=DIR: the programs of a build made already, as they are (how ctest runs its differential checks).
CPP_SANITIZE = os.environ.get("SPECRT_CPP_SANITIZE") == "1"
CPP_GIVEN = os.environ.get("SPECRT_CPP_BUILD")
CPP_BUILD = Path(CPP_GIVEN) if CPP_GIVEN else Path(__file__).parents[1] / "build" / ("cpp-asan" if CPP_SANITIZE else "cpp")


def _native_build():
    import importlib.util

    spec = importlib.util.spec_from_file_location("specrt_native_build",
                                                  Path(__file__).parents[1] / "scripts" / "native_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def cpp_build() -> Path:
    import subprocess

    if CPP_GIVEN:
        return CPP_BUILD
    native = _native_build()
    try:
        native.build(CPP_BUILD, sanitize=CPP_SANITIZE)
    except native.Unbuildable as e:
        pytest.skip(f"the C++ runtime cannot be built here: {e}")
    except subprocess.CalledProcessError as e:
        pytest.fail(f"building runtime/cpp failed:\n{(e.stdout + e.stderr)[-3000:]}")
    return CPP_BUILD


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """specrt's wheel, built from this checkout as `pip wheel .` builds it (once per run: parallel workers share the
    folder above their own temporary ones)."""
    from venvs import build_wheel

    return build_wheel(shared_dir(tmp_path_factory) / "specrt-wheel")
