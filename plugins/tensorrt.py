"""TensorRT, where it can run: the one check `specrt build` and the TensorRT backend share."""
from __future__ import annotations

from specrt.errors import SpecrtError


def require_tensorrt():
    """The tensorrt module and a CUDA GPU, or a one-line error that says which is missing."""
    try:
        import tensorrt as trt
    except ImportError:
        raise SpecrtError("specrt build needs TensorRT: pip install 'specrt[gpu]' on a machine with an NVIDIA GPU "
                          "(tensorrt is not importable here)") from None
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        gpu = False
    if not gpu:
        raise SpecrtError(f"specrt build needs an NVIDIA GPU: TensorRT {trt.__version__} imports, but no CUDA device "
                          "is visible")
    return trt
