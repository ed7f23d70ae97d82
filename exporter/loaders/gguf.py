"""Load a GGUF file (llama, qwen2, qwen3 archs): metadata -> ModelConfig, dequantized HF weights, and the
file's own blocks of the types specrt's kernels read (for `specrt export --weights gguf`)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.exporter.loaders import LazyWeights, LoadedTarget, check_weights, expected_shapes
from specrt.blocks import KERNEL_TYPES, Blocks, GGUFRows
from specrt.exporter.onnx.quant import from_gguf, permute_rows

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# GGUF per-block tensor name -> HF name inside model.layers.{i}.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF tensor name, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Llama Q/K permute (HF half-split rope -> GGML interleaved rope).

    llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(shape).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(x: float) -> float:
    """A float32 metadata value as its shortest decimal (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _open_reader(path: Path):
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """GGUFReader slicing a plain ndarray view of its memory map: numpy.memmap's Python-level __getitem__
        and __array_finalize__ were ~80% of parsing a 49k-token vocabulary's metadata (item by item)."""

        @property
        def data(self) -> np.ndarray:
            return self._array

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._array = mapped.view(np.ndarray)  # same pages, no copy

    try:
        reader = Reader(path)
    except (ValueError, IndexError, KeyError, OSError, OverflowError) as e:
        raise SpecrtError(f"{path} is corrupt or truncated: {e or type(e).__name__}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise SpecrtError(f"{path} is corrupt or truncated: tensor {t.name} extends past the "
                              f"end of the file ({size} bytes)")
    return reader


def _meta(reader: Any) -> dict[str, Any]:
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in ("tokens", "scores",
                                                                            "token_type", "merges"):
            out[key] = len(f.data)  # big arrays: only their length is needed here
            continue
        out[key] = f.contents()
    return out


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int,
                     path: Path, rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (`{arch}.block_count`, ... , tokenizer.ggml.*)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise SpecrtError(f"{path}: unsupported GGUF architecture {arch!r}; "
                          f"supported: {', '.join(SUPPORTED_ARCHS)}")

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise SpecrtError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return v

    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise SpecrtError(f"{path}: GGUF rope scaling ({scaling}) is not supported; "
                          "export from the Hugging Face directory instead")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise SpecrtError(f"{path}: partial rotary embeddings (rope dim {rope_dim} < head dim "
                          f"{head_dim}) are not supported")
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        family=arch,
        vocab_size=vocab_rows,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        # Llama 3.1+: llama.cpp's converter stores the llama3 scaling as per-frequency divisors
        rope_freq_factors=None if rope_freqs is None else tuple(float(x) for x in rope_freqs.reshape(-1)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(get("context_length", 4096)),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )


class _Dequantize:
    """One tensor's float32 weight in HF layout: its blocks' (gguf-py's arithmetic, bit-identical) or the file's
    tensor dequantized, Llama's q/k permute undone (`heads`)."""

    def __init__(self, path: Path, tensor: Any, shape: tuple[int, ...], blocks: Any, heads: int) -> None:
        self.path, self.tensor, self.shape, self.blocks, self.heads = path, tensor, shape, blocks, heads

    def __call__(self) -> np.ndarray:
        from gguf.quants import dequantize

        if self.blocks is not None:  # already in HF row order
            return np.ascontiguousarray(self.blocks.dequantize(), dtype=np.float32)
        t = self.tensor
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(self.shape)
        except (NotImplementedError, ValueError) as e:
            raise SpecrtError(f"{self.path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from None
        if self.heads:
            w = unpermute_qk(w, self.heads)
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = np.array(w, dtype=np.float32, order="C")  # F32 tensors are views of the mmap
        return w


def load_gguf(path: Path) -> LoadedTarget:
    """Load and dequantize a GGUF file into float32 HF-layout weights."""
    from gguf.quants import dequantize

    from specrt.exporter.loaders.tokenizer import TokenizerSource

    reader = _open_reader(path)
    try:
        meta = _meta(reader)
    except Exception as e:  # malformed field payloads surface as assorted numpy errors
        raise SpecrtError(f"{path} is corrupt or truncated: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise SpecrtError(f"{path}: missing tensor token_embd.weight")
    vocab_rows = int(tensors["token_embd.weight"].shape[-1])
    freqs = tensors.get("rope_freqs.weight")
    cfg = config_from_gguf(meta, set(tensors), vocab_rows, path,
                           None if freqs is None else np.asarray(freqs.data, dtype=np.float32))
    by_hf = {hf_name(n): t for n, t in tensors.items() if hf_name(n) is not None}
    # GGUF shapes are [ne0 (in), ne1 (out)]; numpy/HF layout is the reverse.
    check_weights(cfg, {k: tuple(int(s) for s in reversed(t.shape)) for k, t in by_hf.items()},
                  path)
    blocks: dict[str, Blocks | GGUFRows] = {}
    types: dict[str, str] = {}
    floats = {}  # HF name -> how to make its float32 weight (when asked for: an export that keeps the file's blocks
    for name in expected_shapes(cfg):  # reads only the few it needs in float, the embedding and the head)
        t = by_hf[name]
        shape = tuple(int(s) for s in reversed(t.shape))
        kind = types[name] = t.tensor_type.name
        heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
        permuted = cfg.family == "llama" and (".q_proj." in name or ".k_proj." in name)
        if len(shape) == 2 and kind in KERNEL_TYPES:  # the file's blocks, as they are
            b = from_gguf(t.data, kind) or GGUFRows(kind, np.asarray(t.data, np.uint8).reshape(shape[0], -1))
            if permuted:  # a row permutation, so it moves whole block rows
                b = permute_rows(b, lambda rows, heads=heads: unpermute_qk(rows, heads))
            blocks[name] = b
        floats[name] = _Dequantize(path, t, shape, blocks.get(name), heads if permuted else 0)
    weights = LazyWeights(floats)
    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        tokenizer = TokenizerSource.from_gguf(path, eos_token_ids=cfg.eos_token_ids)
    return LoadedTarget(name=path.stem, config=cfg, weights=weights, source_files=[path],
                        tokenizer=tokenizer, blocks=blocks, tensor_types=types)
