"""CUDA graphs for fixed-shape calls: each call is captured once after a warm-up and then replayed on the same
static buffers (nano-vllm's `capture_cudagraph`, one graph per shape bucket). Off CUDA, or where capture fails,
the same object runs the call eagerly on the same buffers, so callers never branch.

    call = GraphedCall(fn, capture=device.type == "cuda", stats=stats)   # fn: static inputs -> outputs
    out = call()   # first call: warm-up, capture, replay; later calls: replay (or eager)

`fn` must read only tensors that outlive the call (static inputs, weights, the KV cache) and must not synchronise
with the host; its warm-up runs must leave the state as a single run would (a forward call is idempotent: every
cache write rewrites the same rows; a round that advances its state gives `warm`, which undoes it). Its outputs
are the graph's static outputs, overwritten by each replay.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class GraphStats:
    """How a runner's calls ran: graphs captured, replays, eager runs, captures that failed (run eagerly)."""

    captures: int = 0
    replays: int = 0
    eager: int = 0
    failed: int = 0
    failure: str = ""  # the first failed capture's reason

    def as_dict(self) -> dict[str, int | str]:
        return {"captures": self.captures, "replays": self.replays, "eager": self.eager, "failed": self.failed,
                "failure": self.failure}


class GraphedCall:
    """One shape bucket's call: captured into a CUDA graph on its first run (after `warmup` eager runs on a side
    stream, which also lets the caching allocator settle), replayed afterwards."""

    def __init__(self, fn: Callable[[], dict[str, Tensor]], *, capture: bool, stats: GraphStats, warmup: int = 2,
                 warm: Callable[[], object] | None = None) -> None:
        """`warm`: what the warm-up runs instead of `fn` (a call that is not idempotent undoes its effects there)."""
        self.fn, self.capture, self.stats, self.warmup = fn, capture, stats, warmup
        self.warm = warm or fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: dict[str, Tensor] | None = None

    def __call__(self) -> dict[str, Tensor]:
        if self.graph is not None:
            self.graph.replay()
            self.stats.replays += 1
            return self.outputs
        if self.capture:
            self._capture()
            if self.graph is not None:
                return self()
        self.stats.eager += 1
        return self.fn()

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.warm()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = self.fn()
        except RuntimeError as e:  # an op that cannot be captured: this call runs eagerly from now on
            self.capture = False
            self.stats.failed += 1
            self.stats.failure = self.stats.failure or str(e).splitlines()[0]
            torch.cuda.synchronize()
            return
        self.graph, self.outputs = graph, outputs
        self.stats.captures += 1
