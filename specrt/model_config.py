"""Target model configuration: one frozen dataclass for every supported decoder family."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from specrt.errors import SpecrtError

# HF `architectures[0]` -> our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the exporter and runtime need to know about a decoder-only target."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # a GGUF's rope_freqs tensor (llama.cpp's form of Llama 3.1+'s scaling): each inverse frequency divided by its
    # factor; head_dim / 2 of them. A Hugging Face config stores the scaling's parameters instead (rope_scaling)
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.family not in set(SUPPORTED_ARCHITECTURES.values()):
            raise SpecrtError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise SpecrtError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise SpecrtError(f"model config: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise SpecrtError(f"model config: head_dim must be even for rope, got {self.head_dim}")
        f = self.rope_freq_factors
        if f is not None and (len(f) != self.head_dim // 2 or not all(math.isfinite(x) and x > 0 for x in f)):
            raise SpecrtError(f"model config: rope_freq_factors must be {self.head_dim // 2} positive numbers "
                              f"(head_dim / 2), got {len(f)}")

    @property
    def o_proj_bias(self) -> bool:
        """HF Llama/Mistral/Qwen3 put a bias on o_proj too when attention_bias is set; Qwen2 never does."""
        return self.attention_bias and self.family != "qwen2"

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def inv_freq(self) -> list[float]:
        """Rope inverse frequencies, with llama3 scaling applied when configured."""
        d = self.head_dim
        freqs = [1.0 / (self.rope_theta ** (2 * i / d)) for i in range(d // 2)]
        if self.rope_freq_factors is not None:  # llama.cpp's theta / factor
            return [f / k for f, k in zip(freqs, self.rope_freq_factors)]
        s = self.rope_scaling
        if s is None:
            return freqs
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / s.factor)
            else:
                smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor)
                out.append((1 - smooth) * f / s.factor + smooth * f)
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config.json dict describing this model (round-trips through `from_hf`)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.family]
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(asdict(self.rope_scaling), rope_type="llama3")
        extra = {"rope_freq_factors": list(self.rope_freq_factors)} if self.rope_freq_factors else {}
        return {**extra, "architectures": [arch], "model_type": self.family, "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope, "attention_bias": self.attention_bias,
                "tie_word_embeddings": self.tie_word_embeddings,
                "max_position_embeddings": self.max_position_embeddings, "bos_token_id": self.bos_token_id,
                "eos_token_id": list(self.eos_token_ids) or None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(float(x) for x in d["rope_freq_factors"])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; unsupported architectures are a user error."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecrtError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if hf.get("use_sliding_window") or (arch == "MistralForCausalLM" and hf.get("sliding_window")):
            raise SpecrtError(f"{arch} with sliding-window attention is not supported")
        family = SUPPORTED_ARCHITECTURES[arch]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        elif rope_type not in ("default", None):
            raise SpecrtError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            # specrt's own key (a GGUF's rope_freqs kept through a head's config.json); transformers ignores it
            rope_freq_factors=tuple(float(x) for x in hf["rope_freq_factors"]) if hf.get("rope_freq_factors") else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


# ---- draft heads -------------------------------------------------------------------------------------

DSPARK_ARCHITECTURES: dict[str, str] = {"Qwen3DSparkModel": "Qwen3ForCausalLM",
                                        "LlamaDSparkModel": "LlamaForCausalLM"}
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True, slots=True)
class DSparkConfig:
    """A DSpark draft head: its decoder layers (`layers.num_layers` draft layers) plus the DSpark keys."""

    layers: ModelConfig
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int = 0  # 0 = no Markov head (DFlash)
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    architecture: str = "Qwen3DSparkModel"
    num_target_layers: int | None = None
    # specrt's key: STS temperatures of the confidence head per draft position (empty = uncalibrated, all 1)
    confidence_temperatures: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        ids = list(self.target_layer_ids)
        temps = self.confidence_temperatures
        if temps and (len(temps) != self.block_size or min(temps) <= 0 or not self.enable_confidence_head):
            raise SpecrtError(f"confidence_temperatures {list(temps)} must be {self.block_size} positive values "
                              "of a head with a confidence head")
        if self.block_size < 1:
            raise SpecrtError(f"block_size must be >= 1, got {self.block_size}")
        if not ids or any(i < -1 for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
            raise SpecrtError(f"target_layer_ids {ids} must be non-empty, >= -1 and strictly increasing")
        if self.markov_rank < 0:
            raise SpecrtError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise SpecrtError(f"markov_head_type {self.markov_head_type!r} is not one of "
                              f"{', '.join(MARKOV_HEAD_TYPES)}")
        if self.confidence_head_with_markov and not (self.enable_confidence_head and self.markov_rank):
            raise SpecrtError("confidence_head_with_markov needs enable_confidence_head and markov_rank > 0")
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            raise SpecrtError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"(vocab_size {self.layers.vocab_size})")

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features the draft consumes (len(target_layer_ids) * d)."""
        return len(self.target_layer_ids) * self.layers.hidden_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DSparkConfig":
        """Build from a DeepSpec `config.json` dict (DSpark or DFlash)."""
        archs = hf.get("architectures") or [None]
        if archs[0] not in DSPARK_ARCHITECTURES:
            raise SpecrtError(f"unsupported draft architecture {archs[0]!r}; "
                              f"accepted: {', '.join(DSPARK_ARCHITECTURES)}")
        missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id") if k not in hf]
        rank = int(hf.get("markov_rank") or 0)
        confidence = bool(hf.get("enable_confidence_head", False))
        missing += ["markov_head_type"] if rank and "markov_head_type" not in hf else []
        missing += ["confidence_head_with_markov"] if confidence and "confidence_head_with_markov" not in hf else []
        if missing:
            raise SpecrtError(f"draft config lacks {', '.join(missing)}")
        layers_hf = dict(copy.deepcopy(hf), architectures=[DSPARK_ARCHITECTURES[archs[0]]])
        return cls(layers=ModelConfig.from_hf(layers_hf), block_size=int(hf["block_size"]),
                   target_layer_ids=tuple(int(i) for i in hf["target_layer_ids"]),
                   mask_token_id=int(hf["mask_token_id"]), markov_rank=rank,
                   markov_head_type=str(hf.get("markov_head_type", "vanilla")), enable_confidence_head=confidence,
                   confidence_head_with_markov=confidence and bool(hf["confidence_head_with_markov"]),
                   architecture=archs[0], num_target_layers=hf.get("num_target_layers"),
                   confidence_temperatures=tuple(float(t) for t in hf.get("confidence_temperatures") or ()))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSparkConfig":
        d = dict(d, layers=ModelConfig.from_dict(d["layers"]), target_layer_ids=tuple(d["target_layer_ids"]),
                 confidence_temperatures=tuple(d.get("confidence_temperatures") or ()))
        return cls(**d)

    def check_target(self, target: ModelConfig) -> None:
        """Raise SpecrtError unless this head fits `target` (widths, vocab, feature layers)."""
        n = target.num_layers
        for key in ("hidden_size", "vocab_size", "head_dim"):
            mine, theirs = getattr(self.layers, key), getattr(target, key)
            if mine != theirs:
                raise SpecrtError(f"draft {key} {mine} does not match the target's {key} {theirs}")
        if self.num_target_layers is not None and self.num_target_layers != n:
            raise SpecrtError(f"draft was trained on a {self.num_target_layers}-layer target, this target has {n}")
        bad = [i for i in self.target_layer_ids if not -1 <= i <= n - 2]
        if bad:
            raise SpecrtError(f"target_layer_ids {list(self.target_layer_ids)}: {bad} outside -1..{n - 2} for the "
                              f"{n}-layer target (-1 = embedding output; the last layer {n - 1} is not allowed)")


EMBED = "embed_tokens.weight"
HEAD = "shared_head.head.weight"


@dataclass(frozen=True, slots=True)
class MTPConfig:
    """One MTP block: a decoder layer of the target's family stored as `model.layers.{layer_index}`."""

    layer: ModelConfig  # the target's config (the block's shapes, rope, norms)
    layer_index: int  # N in model.layers.{N}.*
    has_own_head: bool  # shared_head.head stored (else the target's lm_head)
    has_own_embed: bool  # embed_tokens stored (else the target's embedding)

    def __post_init__(self) -> None:
        if self.layer_index < 0:
            raise SpecrtError(f"MTP layer index must be >= 0, got {self.layer_index}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MTPConfig":
        return cls(**{**d, "layer": ModelConfig.from_dict(d["layer"])})
