"""The one small interface every backend implements (Polygraphy's runner verbs, for fixed-shape graphs).

    runner = load_runner("ort", art_dir, manifest, "target")   # a backend's loader: one graph family
    runner.allocate(slots)                                     # KV cache for `slots` request slots, once
    bucket = runner.spec.bucket("decode", B=3)                 # round a call up to an exported shape
    feeds = runner.inputs(slot, bucket)                        # bound host input buffers: fill in place
    out = runner.run(slot, bucket)                             # outputs valid until the next run

A call runs slots [slot, slot + bucket["B"]) of the cache. The engine, the drafters and distillation's
feature capture see only these verbs; no backend type is named outside `backends/`.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from specrt import artifact as io


class Runner(Protocol):
    """Runs one graph family (the target, or a draft head) over a KV cache it owns."""

    spec: io.GraphSpec
    slots: int

    def allocate(self, slots: int) -> None:
        """Allocate the (zeroed) KV cache for `slots` request slots; a no-op when already that size."""

    def inputs(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        """The host input buffers of slots [slot, slot + B) at `bucket`'s sizes, to fill in place."""

    def run(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        """Run on the buffers `inputs(slot, bucket)` returned; outputs stay valid until the next run. `greedy`: a
        draft family's greedy variant (spec.greedy_file) where it has one: argmax drafts, no io.GREEDY_DROPS
        outputs; the same cache."""


class TreeRunner(Runner, Protocol):
    """A target runner that can keep a draft tree's accepted path (runtime/tree.py): the ONNX Runtime and TensorRT
    runners."""

    def move_rows(self, moves: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Copy cache positions src to dst of slot `slot`, for each (slot, src, dst), in every layer."""


class DeviceRunner(Runner, Protocol):
    """A runner whose calls can also be driven on its device without host copies (the torch backend): what the
    device round (runtime/device_round.py) uses."""

    device: Any  # where its inputs, outputs and cache live (a torch.device)

    def module_inputs(self, slot: int, bucket: io.Bucket) -> dict[str, Any]:
        """The call's static device input tensors, to fill in place (runtime/calls fills them as it fills `inputs`)."""

    def forward(self, slot: int, bucket: io.Bucket, *, graphed: bool = True) -> dict[str, Any]:
        """Run the call on its device inputs as they are; device outputs, no host copy, no synchronisation.
        `graphed=False`: eagerly (inside another capture)."""


def bucket_of(spec: io.GraphSpec, feeds: dict[str, np.ndarray]) -> io.Bucket:
    """The named-axis sizes that host input arrays imply (they must agree with each other)."""
    sizes: io.Bucket = {}
    for t in spec.host_inputs():
        if t.name not in feeds:
            if t.name == io.TREE_MASK:  # optional: a chain's (its axes are input_ids')
                continue
            raise ValueError(f"{spec.name}: missing input {t.name}")
        shape = feeds[t.name].shape
        if len(shape) != len(t.shape):
            raise ValueError(f"{t.name}: rank {len(shape)}, expected {len(t.shape)}")
        for dim, n in zip(t.shape, shape):
            if isinstance(dim, str) and sizes.setdefault(dim, n) != n:
                raise ValueError(f"{t.name}: axis {dim} is {n}, other inputs say {sizes[dim]}")
    return sizes


def infer(runner: Runner, slot: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copy whole input arrays into the bound buffers and run (for tools and tests; the loop fills in place). A
    target call given no io.TREE_MASK is a chain's (the mask all zeros)."""
    if io.TREE_MASK not in feeds and any(t.name == io.TREE_MASK for t in runner.spec.inputs):
        b, t = feeds[io.INPUT_IDS].shape
        feeds = {**feeds, io.TREE_MASK: np.zeros((b, t, t), np.int64)}
    bucket = bucket_of(runner.spec, feeds)
    for name, buf in runner.inputs(slot, bucket).items():
        buf[...] = feeds[name]
    return runner.run(slot, bucket)
