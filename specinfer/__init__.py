"""specinfer: tree-based speculative inference of LLMs (SpecInfer), from checkpoint to server.

Data flows one way: checkpoint -> ONNX (``specinfer.export``) -> engine (``specinfer.engines``)
-> speculation and verification (``speculate``, ``verify``, ``generate``) -> server -> client.
"""
from .errors import SpecInferError
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Pipeline", "SamplingParams", "SpecInferError", "generate_ids", "__version__"]


def __getattr__(name):  # keep `import specinfer` light: numpy only until something is used
    if name == "Pipeline":
        from .pipeline import Pipeline
        return Pipeline
    if name == "generate_ids":
        from .generate import generate_ids
        return generate_ids
    raise AttributeError(name)
