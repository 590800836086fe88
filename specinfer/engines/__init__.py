"""Engines: the Runtime interface and what implements it (ONNX Runtime, PyTorch; TensorRT later)."""
from .runtime import Runtime

__all__ = ["Runtime"]
