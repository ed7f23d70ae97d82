"""Load a DeepSeek-style MTP head (one extra decoder layer N of the target's family) from safetensors.

Two checkpoint forms, both named `model.layers.{N}.<name>` with N = the target's num_hidden_layers:
  (a) inside the target's HF directory (DeepSeek-V3 style: config.json has `num_nextn_predict_layers`);
  (b) standalone: config.json = the target's HF config + `"num_nextn_predict_layers": 1` and
      `"architectures": ["<TargetArch>MTP"]` (e.g. "LlamaForCausalLMMTP"), and a model.safetensors
      holding only layer N. The "MTP" suffix keeps HF tools from mistaking it for a full model.
`embed_tokens` and `shared_head.head` are optional; when absent they alias the target's embedding / lm_head.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrt.errors import SpecrtError
from specrt.model_config import EMBED, HEAD, SUPPORTED_ARCHITECTURES, ModelConfig, MTPConfig
from specrt.exporter.loaders import expected_shapes
from specrt.exporter.loaders.hf import _open, _read_json, weight_files

ARCH_SUFFIX = "MTP"  # standalone form: architectures = [<target arch> + "MTP"]
@dataclass
class LoadedMTP:
    config: MTPConfig
    weights: dict[str, np.ndarray]  # float32, names without the `model.layers.{N}.` prefix
    source_files: list[Path] = field(default_factory=list)


def mtp_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) tensor shapes of an MTP block for target `cfg`, unprefixed names."""
    d, v = cfg.hidden_size, cfg.vocab_size
    block = expected_shapes(dataclasses.replace(cfg, num_layers=1, tie_word_embeddings=True))
    required = {k.removeprefix("model.layers.0."): s for k, s in block.items() if k.startswith("model.layers.0.")}
    required.update({"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d),
                     "shared_head.norm.weight": (d,)})
    return required, {EMBED: (v, d), HEAD: (v, d)}


def _check_config(hf: dict[str, Any], target: ModelConfig, source: Path) -> int:
    """Validate an MTP/target config.json against the target; return the layer index N."""
    arch = ((hf.get("architectures") or [None])[0] or "").removesuffix(ARCH_SUFFIX)
    if arch and SUPPORTED_ARCHITECTURES.get(arch) != target.family:
        raise SpecrtError(f"{source}: MTP architecture {arch!r} does not match the target family {target.family!r}")
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if key in hf and int(hf[key]) != want:
            raise SpecrtError(f"{source}: MTP {key} {hf[key]} does not match the target's {key} {want}")
    if int(hf.get("num_nextn_predict_layers", 1)) < 1:
        raise SpecrtError(f"{source}: num_nextn_predict_layers is 0, the checkpoint has no MTP layer")
    return int(hf.get("num_hidden_layers", target.num_layers))


def _check_shapes(shapes: dict[str, tuple[int, ...]], target: ModelConfig, source: Path) -> None:
    """Hidden / vocab mismatches first (naming both values), then every tensor's name and shape."""
    required, optional = mtp_shapes(target)
    if "enorm.weight" in shapes and shapes["enorm.weight"] != (target.hidden_size,):
        raise SpecrtError(f"{source}: MTP hidden size {shapes['enorm.weight'][0]} does not match the "
                          f"target's hidden size {target.hidden_size}")
    for name in optional:
        if name in shapes and shapes[name][0] != target.vocab_size:
            raise SpecrtError(f"{source}: MTP vocab size {shapes[name][0]} ({name}) does not match the "
                              f"target's vocab size {target.vocab_size}")
    for name, want in {**required, **{k: s for k, s in optional.items() if k in shapes}}.items():
        if name not in shapes:
            raise SpecrtError(f"{source}: missing MTP tensor {name} (expected shape {list(want)})")
        if shapes[name] != want:
            raise SpecrtError(f"{source}: MTP tensor {name} has shape {list(shapes[name])}, expected {list(want)}")


def load_mtp(path: str | Path, target: ModelConfig) -> LoadedMTP:
    """Load the MTP block stored in `path` (a target HF dir with layer N, or a standalone MTP dir)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise SpecrtError(f"MTP checkpoint not found: {root} (expected a directory with safetensors)")
    config_path = root / "config.json"
    has_config = config_path.is_file()
    hf = _read_json(config_path) if has_config else {}
    try:
        n = _check_config(hf, target, root) if has_config else target.num_layers
    except (KeyError, TypeError, ValueError) as e:
        raise SpecrtError(f"{config_path}: invalid value ({e})") from None
    prefix = f"model.layers.{n}."
    files, index_files = weight_files(root)
    located: dict[str, tuple[Path, tuple[int, ...]]] = {}  # unprefixed name -> (file, shape); headers only
    for f in files:
        with _open(f) as st:
            for key in st.keys():
                if key.startswith(prefix):
                    located[key.removeprefix(prefix)] = (f, tuple(st.get_slice(key).get_shape()))
    if not located:
        raise SpecrtError(f"{root}: no MTP tensors found (expected {prefix}enorm.weight and the rest of layer {n})")
    _check_shapes({k: s for k, (_, s) in located.items()}, target, root)
    required, optional = mtp_shapes(target)
    wanted = [k for k in (*required, *optional) if k in located]
    weights: dict[str, np.ndarray] = {}
    for f in files:  # read each file once, only the tensors it holds
        names = [k for k in wanted if located[k][0] == f]
        if names:
            with _open(f) as st:
                try:
                    weights.update({k: st.get_tensor(prefix + k).float().numpy() for k in names})
                except Exception as e:  # safetensors raises plain errors on bad data offsets
                    raise SpecrtError(f"{f} is corrupt or truncated: {e}") from None
    cfg = MTPConfig(layer=target, layer_index=n, has_own_head=HEAD in weights, has_own_embed=EMBED in weights)
    used = sorted({located[k][0] for k in wanted})
    return LoadedMTP(cfg, weights, [*([config_path] if has_config else []), *index_files, *used])


def save_mtp_checkpoint(out_dir: str | Path, target_hf_config: dict[str, Any], weights: Mapping[str, Any], *,
                        dtype: str | None = None) -> Path:
    """Write the standalone form: config.json (target config + MTP keys) and model.safetensors of layer N.

    `dtype` ("bfloat16", "float32", ...) casts every tensor; the loader reads any of them back as float32."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = dict(target_hf_config)
    archs = hf.get("architectures") or []
    if not archs:
        raise SpecrtError("target config has no architectures entry; cannot name the MTP architecture")
    hf["architectures"] = [archs[0].removesuffix(ARCH_SUFFIX) + ARCH_SUFFIX]
    hf["num_nextn_predict_layers"] = 1
    prefix = f"model.layers.{int(hf['num_hidden_layers'])}."
    tensors = {}
    for k, v in weights.items():  # torch tensors (distillation) or numpy arrays
        t = v.detach().cpu() if hasattr(v, "detach") else torch.from_numpy(np.ascontiguousarray(v))
        tensors[prefix + k] = (t.to(getattr(torch, dtype)) if dtype else t).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out


def random_mtp_checkpoint(out_dir: str | Path, target_dir: str | Path, *, seed: int = 0,
                          own_head: bool = False) -> Path:
    """A random-init standalone MTP for the (tiny) target in `target_dir`; norms and biases perturbed."""
    hf = _read_json(Path(target_dir) / "config.json")
    required, optional = mtp_shapes(ModelConfig.from_hf(hf))
    shapes = {**required, **({HEAD: optional[HEAD]} if own_head else {})}
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 2:  # [out, in]: unit-variance outputs keep the logits far from uniform
            weights[name] = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
        elif name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:  # biases
            weights[name] = 0.1 * rng.standard_normal(shape, dtype=np.float32)
    return save_mtp_checkpoint(out_dir, hf, weights)
