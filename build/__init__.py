"""Build half: export to ONNX / AOTInductor / TensorRT(-LLM) and engine-set writing."""
