"""PyTorch backend: a graph family run by the exporter's own torch modules, eagerly on CPU, in CUDA graphs on a GPU.

The numerical reference for the ONNX graphs, behind the same `Runner` verbs as ONNX Runtime. Weights come
from the artifact alone: the family's ONNX file names its initializers and where they sit in the
memory-mapped weights.bin; the exporter's stacking (q/k/v, k/v, gate/up) is undone into the names the
modules' `from_weights` take. Block-quantized weights (`specrt export --weights`) are dequantized into the float
weights the graph multiplies by (exact at accuracy level 0; level 4 also rounds the activations to int8).
Each layer's KV cache is one [slots, Hkv, S, D] tensor pair allocated once; a
call over slots [s, s+n) points the modules' caches at views [s:s+n], so the scatter writes land in place.
Per (slot, bucket), host input buffers (numpy, shared with torch) and the cache views are made once.

On CUDA (`device="cuda"`) the weights and the cache live on the GPU; each (slot, bucket) call also has static
device inputs, is captured into a CUDA graph after a warm-up (runtime/backends/graphs.py) and replayed, and its
outputs are copied into pinned host buffers: one host synchronisation per call. `dtype` runs the modules in
another precision than the artifact's (bfloat16 on a GPU); inputs and outputs keep the graph's dtypes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.model_config import DSparkConfig
from specrt.model_config import EMBED, HEAD, MTPConfig
from specrt.models.dspark import DSparkDraft
from specrt.plugins.confidence_truncate import truncate_torch
from specrt.models.llama import cache_mask, rope_cos_sin, KVCache, Transformer
from specrt.models.mtp import MTP, SlotKVCache
from specrt.blocks import dequantize_tensors
from specrt.runtime.backends.graphs import GraphedCall, GraphStats

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
DTYPES = ("float32", "float16", "bfloat16")  # what `dtype` may ask for
TARGET_EMBED = "model.embed_tokens.weight"


def graph_tensors(art_dir: Path, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every external initializer of a graph file, as a view into its memory-mapped weight file."""
    files: dict[str, np.memmap] = {}
    out = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue  # inline constants (shapes, rope tables) are the graph's own
        ext = {e.key: e.value for e in t.external_data}
        loc, offset, length = ext["location"], int(ext.get("offset", 0)), int(ext["length"])
        if loc not in files:
            try:  # copy-on-write: writable for torch.from_numpy, the file is never touched
                files[loc] = np.memmap(art_dir / loc, dtype=np.uint8, mode="c")
            except (OSError, ValueError) as e:
                raise SpecrtError(f"cannot read {art_dir / loc}: {getattr(e, 'strerror', None) or e}") from None
        if offset + length > files[loc].size:
            raise SpecrtError(f"{art_dir / loc} is truncated: {t.name} ends past its end; re-export the artifact")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        out[t.name] = files[loc][offset:offset + length].view(dtype).reshape(tuple(t.dims))
    return out


def _unstack(w: dict[str, np.ndarray], stacked: str, parts: dict[str, int]) -> None:
    """In place: split `{a}.{stacked}.{weight,bias}` row-wise into `{a}.{part}.*` (inverts the export's concat)."""
    a, name = stacked.rsplit(".", 1)
    for kind in ("weight", "bias"):
        if f"{stacked}.{kind}" in w:
            pieces = np.split(w.pop(f"{stacked}.{kind}"), np.cumsum(list(parts.values()))[:-1])
            w.update({f"{a}.{p}.{kind}": x for p, x in zip(parts, pieces)})


def _unstack_layer(w: dict[str, np.ndarray], prefix: str, cfg: ModelConfig, *, q_apart: bool = False) -> None:
    """Undo `stack_layer_weights` (qkv_proj, gate_up_proj) or DSpark's kv_proj (`q_apart`)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if q_apart:
        _unstack(w, f"{prefix}.self_attn.kv_proj", {"k_proj": kv, "v_proj": kv})
    else:
        _unstack(w, f"{prefix}.self_attn.qkv_proj", {"q_proj": q, "k_proj": kv, "v_proj": kv})
    _unstack(w, f"{prefix}.mlp.gate_up_proj", {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size})


def _own(w: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k.removeprefix(prefix): v for k, v in w.items() if k.startswith(prefix)}


def _shared(own: dict[str, np.ndarray], w: dict[str, np.ndarray], target: ModelConfig, *, embed: str,
            head: str) -> None:
    """In place: a head's embedding / lm_head that the export stored under the target's names, not its own."""
    if embed not in own:
        own[embed] = w[TARGET_EMBED]
    if head not in own:
        own[head] = w[TARGET_EMBED if target.tie_word_embeddings else "lm_head.weight"]


def _fp32_rope(module: nn.Module) -> None:
    """`.to(float16)` casts the inv_freq buffer too; the graphs keep rope frequencies in fp32."""
    module.inv_freq = module.inv_freq.float()


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.dtype)


class _TargetFamily:
    """Transformer; logits of the rows logit_rows picks, features = captured sources in manifest order."""

    def __init__(self, m: io.Manifest, w: dict[str, np.ndarray], dtype: torch.dtype) -> None:
        cfg = m.model
        for i in range(cfg.num_layers):
            _unstack_layer(w, f"model.layers.{i}", cfg)
        self.model = Transformer.from_weights(cfg, w, dtype)
        _fp32_rope(self.model)
        self.attention = [layer.self_attn for layer in self.model.model.layers]
        self.features = m.features
        self.max_seq = m.graphs[io.TARGET].max_seq

    def forward(self, x: dict[str, Tensor]) -> dict[str, Tensor]:
        # Transformer.forward's loop, but the head only on the picked rows (a prefill chunk needs one)
        m, ids, write_index = self.model.model, x[io.INPUT_IDS], x[io.WRITE_INDEX]
        h = m.embed_tokens(ids)
        cos, sin = rope_cos_sin(self.model.inv_freq, x[io.POSITION_IDS], h.dtype)
        mask = cache_mask(write_index, ids.shape[1], self.max_seq)
        captured: dict[int | str, Tensor] = {-1: h}
        for i, layer in enumerate(m.layers):
            h = captured[i] = layer(h, cos, sin, mask, write_index)
        h = captured["final"] = m.norm(h)
        # The graph computes only the token_rows cells; here the whole grid runs, and a cell not computed
        # there is invisible to every computed one (it lies past them in its slot), so their results agree.
        cells = x[io.TOKEN_ROWS]
        out = {io.LOGITS: self.model.lm_head(h.flatten(0, 1)[cells][x[io.LOGIT_ROWS]])}
        if self.features:
            f = torch.cat([captured[f] for f in self.features], dim=-1)
            # index_fill_, not `computed[cells] = True`: that copies a host scalar, which a CUDA graph cannot capture
            computed = torch.zeros(f.shape[0] * f.shape[1], dtype=torch.bool, device=f.device)
            computed.index_fill_(0, cells, True)
            out[io.FEATURES] = f.masked_fill(~computed.view(*f.shape[:2], 1), 0)  # zero, as the graph's
        return out

    def to(self, device: torch.device) -> None:
        self.model.to(device)


class _DSparkFamily:
    """DSparkDraft, with its context projection in fp32 whatever the dtype (as the graph: fp16 overflows)."""

    def __init__(self, m: io.Manifest, name: str, w: dict[str, np.ndarray], dtype: torch.dtype) -> None:
        cfg = DSparkConfig.from_dict(m.heads[name].config)
        vocab_ids = np.asarray(m.heads[name].vocab_ids, np.int64) if m.heads[name].vocab_ids else None
        own = _own(w, "dspark.")
        for i in range(cfg.layers.num_layers):
            _unstack_layer(own, f"layers.{i}", cfg.layers, q_apart=True)
        _shared(own, w, m.model, embed="embed_tokens.weight", head="lm_head.weight")  # the target's when equal
        self.model = model = DSparkDraft.from_weights(cfg, own, dtype, vocab_ids)
        self.temperatures = torch.tensor(cfg.confidence_temperatures or [1.0] * cfg.block_size, dtype=torch.float32)
        _fp32_rope(model)
        if dtype != torch.float32:
            model.fc = nn.Sequential(_Cast(torch.float32), model.fc.float())
            model.hidden_norm = nn.Sequential(model.hidden_norm.float(), _Cast(dtype))
        model.max_seq = m.graphs[name].max_seq
        self.attention = [layer.self_attn for layer in model.layers]

    def forward(self, x: dict[str, Tensor]) -> dict[str, Tensor]:
        d = self.model(x[io.CTX_FEATURES], x[io.CTX_POSITIONS], x[io.CTX_WRITE_INDEX], x[io.CTX_LEN],
                       x[io.ANCHOR_IDS], x[io.TEMPERATURE], x[io.NOISE])
        top = torch.softmax(d.logits[:, 0].float(), -1).topk(min(io.FIRST_TOP, d.logits.shape[-1]), -1)
        ids = top.indices if self.model.vocab_ids is None else self.model.vocab_ids[top.indices]
        out = {io.DRAFT_TOKENS: d.tokens, io.DRAFT_LOGITS: d.logits, io.DRAFT_PROBS: d.probs,
               io.CONFIDENCE_LOGITS: d.confidence_logits, io.DRAFT_FIRST_TOP: ids, io.DRAFT_FIRST_PROBS: top.values}
        if d.confidence_logits is not None:  # specrt::ConfidenceTruncate, on the device
            out[io.SURVIVAL], out[io.VERIFY_LENGTHS] = truncate_torch(
                d.confidence_logits, self.temperatures, x[io.TRUNCATE_THRESHOLD], x[io.TRUNCATE_BUDGET])
        return out

    def to(self, device: torch.device) -> None:
        self.model.to(device)
        self.temperatures = self.temperatures.to(device)


class _MTPFamily:
    """MTP block chained `steps` times; embedding / head are the target's tensors unless stored as own."""

    def __init__(self, m: io.Manifest, name: str, w: dict[str, np.ndarray], dtype: torch.dtype) -> None:
        head = m.heads[name]
        cfg = MTPConfig.from_dict(head.config)
        _unstack_layer(w, "mtp", cfg.layer)
        own = _own(w, "mtp.")
        _shared(own, w, m.model, embed=EMBED, head=HEAD)
        cfg = dataclasses.replace(cfg, has_own_embed=True, has_own_head=True)  # both are in `own` now
        vocab_ids = np.asarray(head.vocab_ids, np.int64) if head.vocab_ids else None
        self.model = model = MTP.from_weights(cfg, own, {}, feedback=head.feedback or "post", dtype=dtype,
                                              vocab_ids=vocab_ids)
        _fp32_rope(model)
        model.max_seq = m.graphs[name].max_seq
        self.attention = [model.self_attn]

    def forward(self, x: dict[str, Tensor]) -> dict[str, Tensor]:
        hidden = x[io.MTP_HIDDEN].to(self.model.eh_proj.weight.dtype)  # another dtype than the graph's
        d = self.model(x[io.MTP_TOKENS], hidden, x[io.MTP_POSITIONS], x[io.MTP_LAST_ROW], x[io.TEMPERATURE],
                       x[io.NOISE])
        return {io.DRAFT_TOKENS: d.tokens, io.DRAFT_LOGITS: d.logits, io.DRAFT_PROBS: d.probs}

    def to(self, device: torch.device) -> None:
        self.model.to(device)


@dataclass
class _Call:
    """What a (slot, bucket) call runs on, made once: host input buffers, the device inputs they are copied to
    (the same tensors on CPU), the cache views, the (graphed) call, and pinned host outputs on CUDA."""

    host: dict[str, np.ndarray]
    feeds: dict[str, Tensor]
    cache: list[tuple[Tensor, Tensor]]
    run: GraphedCall | None = None
    outputs: dict[str, Tensor] | None = None  # host copies of the device outputs (CUDA only)


class TorchRunner:
    """Serves one graph family of an artifact with the exporter's torch modules (the `Runner` verbs)."""

    def __init__(self, art_dir: Path, manifest: io.Manifest, family: str, *, threads: int | None = None,
                 device: str = "cpu", dtype: str | None = None, graphs: bool | None = None) -> None:
        self.spec = graph = manifest.graphs[family]
        self.device = device_of(device)
        if dtype is not None and dtype not in DTYPES:
            raise SpecrtError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        try:
            proto = onnx.load(str(art_dir / graph.file), load_external_data=False)
        except Exception as e:  # protobuf's DecodeError for a corrupt file, OSError, ...
            reason = (getattr(e, "strerror", None) or str(e)).splitlines()[0] if str(e) else type(e).__name__
            raise SpecrtError(f"cannot load {graph.file}: {reason} (corrupt artifact? re-export it)") from None
        io.check_graph_io(graph, {vi.name: tuple(d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim)
                                  for vi in (*proto.graph.input, *proto.graph.output)}, graph.file)
        if threads:
            torch.set_num_threads(threads)
        self.dtype = TORCH_DTYPES[dtype or manifest.export.dtype]
        weights = dequantize_tensors(graph_tensors(art_dir, proto))  # quantized artifacts: what the blocks stand for
        if family == io.TARGET:
            self._family = _TargetFamily(manifest, weights, self.dtype)
        elif manifest.heads[family].kind == "mtp":
            self._family = _MTPFamily(manifest, family, weights, self.dtype)
        else:  # dspark / dflash
            self._family = _DSparkFamily(manifest, family, weights, self.dtype)
        self._family.model.requires_grad_(False)
        self._family.to(self.device)
        cache_cls = SlotKVCache if isinstance(self._family, _MTPFamily) else KVCache
        for attn in self._family.attention:  # empty holders: run() points them at views of the real cache
            attn.kv_cache = cache_cls(0, 0, 0, 0, self.dtype)
        self._outputs = {t.name: TORCH_DTYPES[t.dtype] for t in graph.host_outputs()}
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise SpecrtError("CUDA graphs need a CUDA device")
        self.graph_stats = GraphStats()
        self.syncs = 0  # host synchronisations (one per CUDA call: its outputs' copy)
        self.slots = 0
        self._cache: list[tuple[Tensor, Tensor]] = []
        self._calls: dict[tuple, _Call] = {}

    def allocate(self, slots: int) -> None:
        """Allocate (zeroed) KV tensors for `slots` request slots; drops the calls of an older size."""
        if slots != self.slots or not self._cache:
            self.slots = slots
            past = self.spec.cache_inputs()
            size = {"B": slots, io.CACHE_LEN: self.spec.max_seq}  # a sized cache: all of it (eager torch)
            io.check_memory(io.tensor_bytes(past, size, self.dtype.itemsize),
                            f"the {self.spec.name} KV cache for {slots} slots x {self.spec.max_seq} positions")
            self._calls.clear()
            self._cache = []  # the old cache's memory is free before the new one is taken
            self._cache = [tuple(torch.zeros(t.resolve(size), dtype=self.dtype, device=self.device) for t in kv)
                           for kv in zip(past[::2], past[1::2])]  # (key, value) per layer

    @property
    def cache(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's (key, value) cache [slots, Hkv, S, D] as numpy arrays (views on CPU; for tests and tools)."""
        views = self.device.type == "cpu" and self.dtype != torch.bfloat16  # numpy has no bfloat16
        return [(k.numpy(), v.numpy()) if views else (k.float().cpu().numpy(), v.float().cpu().numpy())
                for k, v in self._cache]

    def module_inputs(self, slot: int, bucket: io.Bucket) -> dict[str, Tensor]:
        """The static device input tensors of a call (what the modules read; device-resident loops fill these)."""
        return self._call(slot, bucket).feeds

    def forward(self, slot: int, bucket: io.Bucket, *, graphed: bool = True) -> dict[str, Tensor]:
        """Run a call on its static device inputs, as they are, and return its device outputs (graph outputs on
        CUDA: overwritten by the next replay). No host copy and no synchronisation. `graphed=False` runs the
        modules eagerly (inside another capture: a device-resident round)."""
        call = self._call(slot, bucket)
        with torch.inference_mode():
            return call.run() if graphed else self._forward(call)

    def _call(self, slot: int, bucket: io.Bucket) -> _Call:
        key = (slot, *sorted(bucket.items()))
        if key not in self._calls:
            n = bucket["B"]
            if slot < 0 or slot + n > self.slots:
                raise ValueError(f"slots [{slot}, {slot + n}) outside the allocated {self.slots}")
            cuda = self.device.type == "cuda"
            host_t = {t.name: torch.zeros(t.resolve(bucket), dtype=TORCH_DTYPES[t.dtype], pin_memory=cuda)
                      for t in self.spec.host_inputs()}
            feeds = {name: a.to(self.device) if cuda else a for name, a in host_t.items()}
            call = _Call({name: a.numpy() for name, a in host_t.items()}, feeds,
                         [(k[slot:slot + n], v[slot:slot + n]) for k, v in self._cache])
            call.run = GraphedCall(lambda: self._forward(call), capture=self.graphs, stats=self.graph_stats)
            self._calls[key] = call
        return self._calls[key]

    def _forward(self, call: _Call) -> dict[str, Tensor]:
        for attn, (k, v) in zip(self._family.attention, call.cache):
            attn.kv_cache.k_cache, attn.kv_cache.v_cache = k, v
        out = self._family.forward(call.feeds)
        return {name: out[name].to(dtype) for name, dtype in self._outputs.items()}

    def inputs(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        """The host input buffers for slots [slot, slot + B): fill them in place, then `run`."""
        return self._call(slot, bucket).host

    def run(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        """Run on the buffers `inputs(slot, bucket)` returned; outputs stay valid until the next call. The modules
        compute every output, so `greedy` (use a greedy variant) changes nothing here."""
        call = self._call(slot, bucket)
        if self.device.type == "cpu":
            with torch.inference_mode():
                return {name: t.numpy() for name, t in call.run().items()}
        for name, a in call.host.items():
            call.feeds[name].copy_(torch.from_numpy(a), non_blocking=True)
        with torch.inference_mode():
            out = call.run()
        if call.outputs is None:
            call.outputs = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in out.items()}
        for name, t in out.items():
            call.outputs[name].copy_(t, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        self.syncs += 1
        return {name: t.numpy() for name, t in call.outputs.items()}


def device_of(name: str) -> torch.device:
    """A torch device by name, or a one-line error when it cannot be used here."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise SpecrtError(f"unknown device {name!r}; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise SpecrtError(f"device {name!r}: the torch backend runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecrtError(f"--device {name}: no CUDA GPU is visible to torch {torch.__version__} "
                              f"(built with CUDA {torch.version.cuda or 'none'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SpecrtError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device
