"""Our PyTorch model on a CUDA GPU with the OpenAI Triton kernels, behind the Runtime interface.

The model is :class:`TorchRuntime`'s (same code, same cache layout); on CUDA its
``specinfer::tree_attention`` op runs the Triton tree-attention kernel, which reads the cached
prefix where it lies, and a commit runs the Triton commit kernel, which moves only the accepted
nodes' K and V of every layer. The CPU :class:`TorchRuntime` is unchanged.

Untested here: no GPU on our machines (its tests carry the ``gpu`` marker); the kernels themselves
are tested here in Triton's interpreter.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import SpecInferError
from ..model import LlamaModel
from ..plugins import triton_kernels
from .runtime import SequenceState
from .torch_runtime import TorchRuntime


class TorchGpuRuntime(TorchRuntime):
    def __init__(self, model: LlamaModel | str | Path, max_context: int | None = None, device: str = "cuda",
                 dtype: torch.dtype = torch.float16):
        if not torch.cuda.is_available():
            raise SpecInferError("the torch-gpu engine needs a CUDA GPU (none is visible); use --engine torch on CPU")
        if not triton_kernels.available():
            raise SpecInferError("the torch-gpu engine needs OpenAI Triton: pip install 'specinfer[kernels]'")
        triton_kernels.use_for_cuda()
        super().__init__(model, max_context=max_context, device=device, dtype=dtype)

    def _move(self, seq: SequenceState, src: np.ndarray, dst: np.ndarray) -> None:
        triton_kernels.commit_kv(seq.kv, src, dst)
