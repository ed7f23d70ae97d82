"""specrt's own ops. specrt::ConfidenceTruncate (DSpark's calibrated prefix survival and verify lengths):
confidence_truncate.py holds its schema, numpy reference and ONNX local function; trt_confidence_truncate.py its
OpenAI-Triton kernel and TensorRT plugin."""
