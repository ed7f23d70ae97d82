"""The artifact format and the graph I/O contract shared by the exporter and every runtime backend.

An artifact is a directory:

    manifest.json     format version, model config, export settings, graph I/O specs, checksums
    weights.bin       every initializer of every graph, stored once (ONNX external data)
    <graph>.onnx      fixed-shape graphs (target prefill chunk, decode, verify; draft graphs)
    tokenizer/        tokenizer.json (+ config), when the source model has one

Target graph contract (B slots, T tokens per slot, R logit rows per slot, S = S_MAX cache positions):

    inputs   input_ids[B,T] i64, position_ids[B,T] i64, write_index[B] i64 (cache length per slot),
             logit_rows[B,R] i64 (which of the T rows get logits), past.{i}.key / past.{i}.value [B,Hkv,S,D]
    outputs  logits[B,R,V], features[B,T,F] (only when a draft head needs them),
             present.{i}.key / present.{i}.value with the same shape as past, so one buffer is bound as both

The attention mask is built inside the graph from write_index: query t of slot b sees cache position s
iff s <= write_index[b] + t. Rollback is only a smaller write_index on the next call.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specrt.errors import SpecrtError

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.bin"
TOKENIZER_DIR = "tokenizer"

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
WRITE_INDEX = "write_index"
LOGIT_ROWS = "logit_rows"
LOGITS = "logits"
FEATURES = "features"

DTYPES = ("float32", "float16")


def past_names(layer: int) -> tuple[str, str]:
    return f"past.{layer}.key", f"past.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A graph input or output. `axes` names its leading dims that a backend may treat as symbolic
    (B slots, T/C tokens, R rows); the remaining dims are fixed by the graph body."""

    name: str
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]
    axes: tuple[str, ...] = ()

    def resolve(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The shape with the named axes replaced by `sizes`."""
        return tuple(sizes[a] for a in self.axes) + self.shape[len(self.axes):]


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """One exported graph: its file, the dims it was fixed to, and its I/O signature."""

    name: str
    file: str
    family: str  # graphs of one family share weights and differ only in B/T/R
    dims: dict[str, int]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GraphSpec":
        return cls(name=d["name"], file=d["file"], family=d["family"], dims=dict(d["dims"]),
                   inputs=tuple(_tensor(t) for t in d["inputs"]), outputs=tuple(_tensor(t) for t in d["outputs"]))


def _tensor(t: dict[str, Any]) -> TensorSpec:
    return TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), tuple(t.get("axes", ())))


def target_signature(*, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                     batch: int, tokens: int, rows: int, max_seq: int, dtype: str,
                     feature_dim: int = 0) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The target graph's inputs and outputs for fixed B/T/R/S (see the module docstring)."""
    inputs = [TensorSpec(INPUT_IDS, "int64", (batch, tokens), ("B", "T")),
              TensorSpec(POSITION_IDS, "int64", (batch, tokens), ("B", "T")),
              TensorSpec(WRITE_INDEX, "int64", (batch,), ("B",)),
              TensorSpec(LOGIT_ROWS, "int64", (batch, rows), ("B", "R"))]
    outputs = [TensorSpec(LOGITS, dtype, (batch, rows, vocab_size), ("B", "R"))]
    if feature_dim:
        outputs.append(TensorSpec(FEATURES, dtype, (batch, tokens, feature_dim), ("B", "T")))
    return cache_signature(inputs, outputs, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, batch=batch, max_seq=max_seq, dtype=dtype)


def cache_signature(inputs: list[TensorSpec], outputs: list[TensorSpec], *, num_layers: int, num_kv_heads: int,
                    head_dim: int, batch: int, max_seq: int, dtype: str
                    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Append the per-layer past (inputs) and present (outputs) KV tensors, [B,Hkv,S,D] each."""
    cache = (batch, num_kv_heads, max_seq, head_dim)
    for i in range(num_layers):
        inputs += [TensorSpec(n, dtype, cache, ("B",)) for n in past_names(i)]
        outputs += [TensorSpec(n, dtype, cache, ("B",)) for n in present_names(i)]
    return tuple(inputs), tuple(outputs)


@dataclass(frozen=True, slots=True)
class ExportSettings:
    batch: int
    max_seq: int
    prefill_chunk: int
    verify_len: int
    dtype: str = "float32"
    attention: str = "standard"

    def __post_init__(self) -> None:
        for name in ("batch", "max_seq", "prefill_chunk", "verify_len"):
            if getattr(self, name) < 1:
                raise SpecrtError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise SpecrtError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention not in ("standard",):
            raise SpecrtError(f"attention lowering must be 'standard', got {self.attention!r}")
        if max(self.prefill_chunk, self.verify_len) >= self.max_seq:
            raise SpecrtError(f"max sequence length {self.max_seq} must exceed the prefill chunk "
                              f"({self.prefill_chunk}) and verify length ({self.verify_len})")


@dataclass
class Manifest:
    model: dict[str, Any]
    export: ExportSettings
    graphs: dict[str, GraphSpec]
    tokenizer: dict[str, Any] | None
    sources: list[dict[str, Any]]
    name: str = ""
    format_version: int = FORMAT_VERSION
    specrt_version: str = ""
    weights: dict[str, Any] = field(default_factory=dict)
    features: list[Any] = field(default_factory=list)  # target feature sources: layer ids, "final"
    heads: dict[str, dict[str, Any]] = field(default_factory=dict)  # draft heads by name

    @property
    def gamma(self) -> int:
        """Draft tokens verified per round at most (verify graphs take gamma + 1 tokens)."""
        return self.export.verify_len - 1

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=1)

    def save(self, art_dir: Path) -> None:
        (art_dir / MANIFEST).write_text(self.to_json())


def load_manifest(art_dir: str | Path) -> Manifest:
    """Read and validate an artifact's manifest; any problem is a one-line SpecrtError."""
    art = Path(art_dir)
    if not art.exists():
        raise SpecrtError(f"artifact not found: {art}")
    path = art / MANIFEST
    if not path.is_file():
        raise SpecrtError(f"{art} is not a specrt artifact (no {MANIFEST}); create one with `specrt export`")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecrtError(f"{path} is not valid JSON: {e}") from None
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise SpecrtError(f"{art} has artifact format version {version}, this specrt reads version "
                          f"{FORMAT_VERSION}; re-export it with this specrt")
    try:
        m = Manifest(model=d["model"], export=ExportSettings(**d["export"]),
                     graphs={k: GraphSpec.from_dict(g) for k, g in d["graphs"].items()},
                     tokenizer=d.get("tokenizer"), sources=d.get("sources", []), name=d.get("name", ""),
                     format_version=version, specrt_version=d.get("specrt_version", ""),
                     weights=d.get("weights", {}), features=d.get("features", []), heads=d.get("heads", {}))
    except (KeyError, TypeError) as e:
        raise SpecrtError(f"{path} is malformed: {e}") from None
    for g in m.graphs.values():
        if not (art / g.file).is_file():
            raise SpecrtError(f"artifact {art} is incomplete: graph file {g.file} is missing")
    return m


# ---- draft graphs --------------------------------------------------------------------------------
#
# DSpark (family "dspark"): one call writes C new context rows into the draft's own KV cache and
# drafts a block of K tokens for the anchor at position ctx_len (context = positions 0..ctx_len-1).
#   inputs   ctx_features[B,C,F] (raw target-layer outputs, concatenated), ctx_positions[B,C] i64,
#            ctx_write_index[B] i64 (draft cache length before this write), ctx_len[B] i64 (valid
#            context after it; rows at or past ctx_len are padding), anchor_ids[B] i64,
#            temperature[B] f32 (0 = greedy argmax), noise[B,K] f32 (uniform [0,1), one per draft slot),
#            past.{i}.key/value[B,Hkv,S,D]
#   outputs  draft_tokens[B,K] i64, draft_logits[B,K,V] (Markov-corrected), draft_probs[B,K,V] f32
#            (the distribution each token was drawn from: softmax(draft_logits / T), T=1 where T=0),
#            confidence_logits[B,K] (only with a confidence head), present.{i}.*
#
# MTP (family "mtp"): one call writes C rows (token x_{t+1}, target hidden h_t at position t) through
# the MTP block into its cache, then chains G draft steps from row last_row.
#   inputs   tokens[B,C] i64, hidden[B,C,d] (final-normed target hidden), positions[B,C] i64 (t;
#            cache slot = position), last_row[B] i64, temperature[B] f32, noise[B,G] f32, past.0.*
#   outputs  draft_tokens[B,G] i64, draft_logits[B,G,V], draft_probs[B,G,V] f32, present.0.*

CTX_FEATURES = "ctx_features"
CTX_POSITIONS = "ctx_positions"
CTX_WRITE_INDEX = "ctx_write_index"
CTX_LEN = "ctx_len"
ANCHOR_IDS = "anchor_ids"
TEMPERATURE = "temperature"
NOISE = "noise"
DRAFT_TOKENS = "draft_tokens"
DRAFT_LOGITS = "draft_logits"
DRAFT_PROBS = "draft_probs"
CONFIDENCE_LOGITS = "confidence_logits"
MTP_TOKENS = "tokens"
MTP_HIDDEN = "hidden"
MTP_POSITIONS = "positions"
MTP_LAST_ROW = "last_row"


def dspark_signature(*, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int, vocab_size: int,
                     num_features: int, batch: int, ctx_rows: int, block: int, max_seq: int, dtype: str,
                     confidence: bool) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The DSpark draft graph's inputs and outputs (see the comment above)."""
    b, c = ("B",), ("B", "C")
    inputs = [TensorSpec(CTX_FEATURES, dtype, (batch, ctx_rows, num_features * hidden_size), c),
              TensorSpec(CTX_POSITIONS, "int64", (batch, ctx_rows), c),
              TensorSpec(CTX_WRITE_INDEX, "int64", (batch,), b),
              TensorSpec(CTX_LEN, "int64", (batch,), b),
              TensorSpec(ANCHOR_IDS, "int64", (batch,), b),
              TensorSpec(TEMPERATURE, "float32", (batch,), b),
              TensorSpec(NOISE, "float32", (batch, block), b)]
    outputs = [TensorSpec(DRAFT_TOKENS, "int64", (batch, block), b),
               TensorSpec(DRAFT_LOGITS, dtype, (batch, block, vocab_size), b),
               TensorSpec(DRAFT_PROBS, "float32", (batch, block, vocab_size), b)]
    if confidence:
        outputs.append(TensorSpec(CONFIDENCE_LOGITS, dtype, (batch, block), b))
    return cache_signature(inputs, outputs, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           batch=batch, max_seq=max_seq, dtype=dtype)


def mtp_signature(*, num_kv_heads: int, head_dim: int, hidden_size: int, vocab_size: int, batch: int,
                  rows: int, steps: int, max_seq: int, dtype: str
                  ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The MTP draft graph's inputs and outputs (see the comment above)."""
    b, c = ("B",), ("B", "C")
    inputs = [TensorSpec(MTP_TOKENS, "int64", (batch, rows), c),
              TensorSpec(MTP_HIDDEN, dtype, (batch, rows, hidden_size), c),
              TensorSpec(MTP_POSITIONS, "int64", (batch, rows), c),
              TensorSpec(MTP_LAST_ROW, "int64", (batch,), b),
              TensorSpec(TEMPERATURE, "float32", (batch,), b),
              TensorSpec(NOISE, "float32", (batch, steps), b)]
    outputs = [TensorSpec(DRAFT_TOKENS, "int64", (batch, steps), b),
               TensorSpec(DRAFT_LOGITS, dtype, (batch, steps, vocab_size), b),
               TensorSpec(DRAFT_PROBS, "float32", (batch, steps, vocab_size), b)]
    return cache_signature(inputs, outputs, num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           batch=batch, max_seq=max_seq, dtype=dtype)
