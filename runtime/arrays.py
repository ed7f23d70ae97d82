"""The namespace of the round's arrays (the Python array API standard): numpy's own for numpy arrays where numpy
implements the standard in its main namespace (>= 2.1: without a compatibility layer's cost per call, which the host
round pays on every slot), array-api-compat's otherwise (numpy 1.26, which Triton's Python backend stub needs, and
torch tensors on the torch backend's device)."""
from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import array_namespace
from array_api_compat import device as _device

Array = Any  # a numpy array or a torch tensor

_NUMPY = np if np.lib.NumpyVersion(np.__version__) >= "2.1.0" else array_namespace(np.zeros(0))


def namespace(*arrays: Array):
    return _NUMPY if all(isinstance(a, np.ndarray) for a in arrays) else array_namespace(*arrays)


def device(a: Array):
    return "cpu" if isinstance(a, np.ndarray) else _device(a)
