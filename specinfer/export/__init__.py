"""Checkpoint -> ONNX with one TreeAttention node per layer (needs the `export` extra: torch)."""
from .onnx_export import ExportResult, export_model, input_names, output_names

__all__ = ["ExportResult", "export_model", "input_names", "output_names"]
