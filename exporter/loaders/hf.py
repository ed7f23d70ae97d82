"""Load a Hugging Face model directory: config.json + (sharded) safetensors -> float32 numpy."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.exporter.loaders import LoadedTarget, check_weights, expected_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecrtError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecrtError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise SpecrtError(f"{path}: expected a JSON object")
    return data


INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_problem(e: Exception, hf: dict[str, Any]) -> str:
    """What a KeyError / TypeError / ValueError raised while reading the config.json dict `hf` says about it."""
    for key in INT_KEYS:  # the sizes every decoder needs, named when they are the problem
        if key not in hf:
            return f"missing key {key!r}"
        if isinstance(hf[key], bool) or not isinstance(hf[key], int):
            return f"{key} must be an integer, got {hf[key]!r}"
    if isinstance(e, KeyError):
        return f"missing key {e.args[0]!r}"
    return f"invalid value ({e})"


def weight_files(model_dir: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, index files) of a HF directory; SpecrtError when there are none."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SpecrtError(f"{index}: no weight_map")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise SpecrtError(f"{index} lists {f.name}, which is missing")
        return files, [index]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE], []
    files = sorted(f for f in model_dir.glob("*.safetensors") if f.is_file())
    if files:
        return files, []
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise SpecrtError(f"{model_dir}: only safetensors checkpoints are supported "
                          "(found PyTorch .bin/.pt files; re-save with safe_serialization=True)")
    raise SpecrtError(f"{model_dir}: no model.safetensors or {INDEX_FILE} found")


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:  # safe_open reports every failure to open (permissions too) as "No such file or directory"
        open(path, "rb").close()
    except OSError as e:
        raise SpecrtError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise SpecrtError(f"{path} is corrupt or truncated: {e}") from None
    except OSError as e:
        raise SpecrtError(f"{path}: cannot read: {e}") from None


def read_safetensors(files: list[Path], cfg: ModelConfig, source: Path) -> dict[str, np.ndarray]:
    """Read the tensors `cfg` expects from `files`, validating names and shapes first."""
    located: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with _open(path) as f:
            for key in f.keys():
                located[key] = path
                shapes[key] = tuple(f.get_slice(key).get_shape())
    wanted = expected_shapes(cfg)
    check_weights(cfg, shapes, source)
    weights: dict[str, np.ndarray] = {}
    for path in files:
        names = [n for n in wanted if located[n] == path]
        if not names:
            continue
        with _open(path) as f:
            for name in names:
                try:
                    t = f.get_tensor(name)
                except Exception as e:  # safetensors raises plain errors on bad data offsets
                    raise SpecrtError(f"{path} is corrupt or truncated: {e}") from None
                weights[name] = t.float().numpy()
    return weights


def _merge_eos(cfg: ModelConfig, model_dir: Path) -> tuple[ModelConfig, list[Path]]:
    """Add generation_config.json's eos ids (what `generate` stops on) to the config's."""
    gen = model_dir / "generation_config.json"
    if not gen.is_file():
        return cfg, []
    eos = _read_json(gen).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    ids = list(cfg.eos_token_ids) + [int(i) for i in extra if int(i) not in cfg.eos_token_ids]
    return dataclasses.replace(cfg, eos_token_ids=tuple(ids)), [gen]


def load_hf_dir(model_dir: Path) -> LoadedTarget:
    """Load config, weights and tokenizer source from a Hugging Face model directory."""
    from specrt.exporter.loaders.tokenizer import TokenizerSource

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise SpecrtError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    hf = _read_json(config_path)
    try:
        cfg = ModelConfig.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise SpecrtError(f"{config_path}: {config_problem(e, hf)}") from None
    cfg, extra_files = _merge_eos(cfg, model_dir)
    files, index_files = weight_files(model_dir)
    weights = read_safetensors(files, cfg, model_dir)
    tokenizer = TokenizerSource.from_hf_dir(model_dir, eos_token_ids=cfg.eos_token_ids)
    return LoadedTarget(name=model_dir.resolve().name, config=cfg, weights=weights,
                        source_files=[config_path, *extra_files, *index_files, *files],
                        tokenizer=tokenizer)
