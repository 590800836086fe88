"""From a folder to a Runtime: an export is opened as it is; a checkpoint is exported first (cached);
a TensorRT engine folder (``specinfer build``) always opens on TensorRT."""
from __future__ import annotations

import sys
from pathlib import Path

from ..cache import export_folder
from ..errors import SpecInferError
from .runtime import Runtime

ENGINES = ("onnxruntime", "torch", "torch-gpu", "tensorrt")
TENSORRT_FORMAT = "specinfer-tensorrt/1"  # = tensorrt_build.FORMAT, without importing it


def is_engine_folder(model_dir: str | Path) -> bool:
    path = Path(model_dir) / "manifest.json"
    if not path.is_file():
        return False
    import json

    try:
        return json.loads(path.read_text()).get("format") == TENSORRT_FORMAT
    except ValueError:
        return False


def onnx_folder(model_dir: str | Path, max_context: int | None = None) -> Path:
    """``model_dir`` itself if it is an export, else a cached export of the checkpoint in it."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SpecInferError(f"model folder not found: {model_dir}")
    if (model_dir / "manifest.json").is_file():
        return model_dir
    if not (model_dir / "config.json").is_file():
        raise SpecInferError(f"{model_dir} is neither a checkpoint (config.json) nor an export (manifest.json)")
    # Keyed by content: a changed checkpoint is exported again, a copy of the same one is not.
    from ..export.onnx_export import EXPORT_FORMAT

    out = export_folder(model_dir, max_context, EXPORT_FORMAT)
    if (out / "manifest.json").is_file():
        return out
    try:
        from ..export import export_model
    except ImportError:
        raise SpecInferError(f"{model_dir} is a checkpoint: export it first (`specinfer export {model_dir} -o DIR`, "
                             "which needs `pip install specinfer[export]`)") from None
    # Said before the progress bar: the wait is once per checkpoint, not every run.
    print(f"specinfer: exporting {model_dir.name} to ONNX once, into the cache ({out.parent}); later runs reuse it",
          file=sys.stderr, flush=True)
    export_model(model_dir, out, max_context=max_context, force=True)   # the cache's folder: ours to overwrite
    return out


def load_runtime(model_dir: str | Path, engine: str = "onnxruntime", max_context: int | None = None,
                 threads: int | None = None, kv_dtype: str = "float32", matmul_dtype: str = "float32") -> Runtime:
    """Open a model folder (an export, or a checkpoint) on the chosen engine, its KV caches of
    ``kv_dtype`` (float16: ONNX Runtime on the native kernels only) and its matrix products in
    ``matmul_dtype`` (bfloat16, int8: the same, on a CPU with AVX512-BF16; with AVX2)."""
    if engine not in ENGINES:
        raise SpecInferError(f"unknown engine '{engine}' (choose from {', '.join(ENGINES)})")
    if kv_dtype != "float32" and engine != "onnxruntime":
        raise SpecInferError(f"{kv_dtype} KV caches run on the onnxruntime engine only, not {engine}")
    if matmul_dtype != "float32" and engine != "onnxruntime":
        raise SpecInferError(f"{matmul_dtype} matrix products run on the onnxruntime engine only, not {engine} "
                             f"(a TensorRT engine computes in its export's dtype)")
    if is_engine_folder(model_dir):
        if engine not in ("onnxruntime", "tensorrt"):  # onnxruntime is every caller's default
            raise SpecInferError(f"{model_dir} is a TensorRT engine folder: it runs on the tensorrt engine only")
        from .tensorrt_runtime import TrtRuntime

        return TrtRuntime(model_dir, max_context=max_context)
    if engine == "tensorrt":
        raise SpecInferError(f"the tensorrt engine needs an engine folder built by `specinfer build`; "
                             f"{model_dir} is not one")
    if engine == "torch-gpu":
        from .torch_gpu_runtime import TorchGpuRuntime

        if not (Path(model_dir) / "config.json").is_file():
            raise SpecInferError(f"the torch-gpu engine needs a checkpoint folder (config.json) in {model_dir}")
        return TorchGpuRuntime(model_dir, max_context=max_context)
    if engine == "onnxruntime":
        from .onnxruntime import OrtRuntime

        return OrtRuntime(onnx_folder(model_dir, max_context), threads=threads, max_context=max_context,
                          kv_dtype=kv_dtype, matmul_dtype=matmul_dtype)
    if engine == "torch":
        from .torch_runtime import TorchRuntime

        if not (Path(model_dir) / "config.json").is_file():
            raise SpecInferError(f"the torch engine needs a checkpoint folder (config.json) in {model_dir}")
        return TorchRuntime(model_dir, max_context=max_context)
    raise SpecInferError(f"unknown engine '{engine}' (choose from {', '.join(ENGINES)})")
