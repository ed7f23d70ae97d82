"""specrt's CPU kernels, in one place: the ONNX Runtime custom-op library in C++ (`kernels/cpu/`, built into
libspecrt_ops by setup.py), the schema of each op the exporter emits and the library implements (`ops.py`), and the
numpy references of their documented arithmetic the tests hold them to (`reference.py`)."""
