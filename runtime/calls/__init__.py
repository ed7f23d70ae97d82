"""Call contracts: how each graph family's calls are filled from slot state, one module per family.

    target   prefill (one slot's chunk), decode and packed verify: `prefill`, `grid`, `packed_rows`
    dspark   propose from raw target features (DSpark, DFlash): `propose`
    mtp      propose from (final hidden, next token) pairs: `propose`
    head     what every head's call shares (sampling inputs, the truncation op's settings): `settings`

The artifact names each call's inputs (`specrt/artifact.py`); these modules say what goes in them. Every function
writes a call's bound input buffers in place from arrays of the same namespace as the buffers (numpy for ONNX
Runtime and the torch backend's host buffers, torch tensors for the torch backend's device inputs: the array API
standard, through array-api-compat), and none loops over slots, so the host loop, the device round, profiling,
comparison and distillation's feature capture fill calls with the same lines (and the C++ runtime ports them).
"""
from __future__ import annotations

from types import ModuleType

from specrt.errors import SpecrtError
from specrt.runtime.calls import dspark, head, mtp, target
from specrt.runtime.calls.head import ContextRows

__all__ = ["ContextRows", "dspark", "for_head", "head", "mtp", "target"]

HEAD_CALLS: dict[str, ModuleType] = {"dspark": dspark, "dflash": dspark, "mtp": mtp}  # by manifest head kind


def for_head(kind: str) -> ModuleType:
    """The contract module of a draft head kind (the manifest's `heads[name].kind`)."""
    if kind not in HEAD_CALLS:
        raise SpecrtError(f"unknown draft head kind {kind!r} (this specrt knows: {', '.join(HEAD_CALLS)})")
    return HEAD_CALLS[kind]
