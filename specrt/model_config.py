"""Target model configuration: one frozen dataclass for every supported decoder family."""
from __future__ import annotations

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
        return {"architectures": [arch], "model_type": self.family, "vocab_size": self.vocab_size,
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
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
