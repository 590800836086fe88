"""The ONNX Runtime engine: an exported folder (``specinfer export``) behind the Runtime interface.

The KV cache lives in one host buffer per sequence. Each step binds the cached prefix as the graph's
``past_*`` inputs and the next free slots as its ``new_*`` outputs through ONNX Runtime's IOBinding,
by pointer, so no step copies the cache: ONNX Runtime reads the prefix in place and writes the new
tokens' KV straight into their slots. The CPU provider is the default; the CUDA provider is chosen
when onnxruntime-gpu sees a GPU (untested here: no GPU on our CI machines), in which case the
bound host buffers are copied to and from the device on each step.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import SpecInferError
from .runtime import Runtime, SequenceState

MANIFEST = "manifest.json"
_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}


def read_manifest(onnx_dir: str | Path) -> dict:
    onnx_dir = Path(onnx_dir)
    path = onnx_dir / MANIFEST
    if not path.is_file():
        raise SpecInferError(f"no {MANIFEST} in {onnx_dir}: is it a folder written by `specinfer export`?")
    return json.loads(path.read_text())


def default_providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if "CUDAExecutionProvider" in available \
        else ["CPUExecutionProvider"]


class OrtRuntime(Runtime):
    """Runtime over an exported ONNX model, on ONNX Runtime."""

    def __init__(self, onnx_dir: str | Path, providers: list[str] | None = None,
                 threads: int | None = None, max_context: int | None = None):
        import onnx
        import onnxruntime as ort
        from onnxruntime.capi import _pybind_state

        from ..plugins.onnx_function import share_attention_mask

        self.dir = Path(onnx_dir)
        self.manifest = read_manifest(self.dir)
        if self.manifest["dtype"] not in _NP_DTYPES:
            raise SpecInferError(f"ONNX Runtime here runs fp32 or fp16 exports, not {self.manifest['dtype']}")
        config = ModelConfig.from_dict(self.manifest["config"])
        limit = self.manifest["max_context"]
        super().__init__(config, min(max_context or limit, limit))
        self.dtype = _NP_DTYPES[self.manifest["dtype"]]
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        # Shapes change every call (the cache grows): a memory pattern planned for one shape is never
        # reused, and planning it each call cost a small model up to a third of its step.
        options.enable_mem_pattern = False
        # Several sessions (LLM, SSMs) take turns on few cores: threads that spin-wait after their
        # work would steal the cores from the session that runs next.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.providers = providers or default_providers()
        model = share_attention_mask(onnx.load(str(self.dir / self.manifest["onnx"])))
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=self.providers)
        self._C = _pybind_state
        self._cpu = ort.OrtDevice.make("cpu", 0)._get_c_device()
        n = config.num_layers
        self._kv_names = [(f"past_key.{i}", f"past_value.{i}", f"new_key.{i}", f"new_value.{i}") for i in range(n)]

    def _allocate(self, capacity: int) -> np.ndarray:
        c = self.config
        return np.zeros((c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim), dtype=self.dtype)

    def _forward(self, seq: SequenceState, tokens, positions, tree_mask) -> np.ndarray:
        c, t = self.config, len(tokens)
        start = seq.length + seq.pending
        kv = seq.kv
        # The C binding directly: onnxruntime's Python IOBinding wrapper costs ~10 us per bound
        # tensor, which for a small SSM was a third of a step.
        binding = self._C.SessionIOBinding(self.session._sess)
        cpu, dt = self._cpu, self.dtype
        inputs = [np.ascontiguousarray(a)[None] for a in (tokens, positions, tree_mask)]  # alive until run
        for name, array in zip(("input_ids", "position_ids", "tree_mask"), inputs):
            binding.bind_input(name, cpu, array.dtype, array.shape, array.ctypes.data)
        past_shape = (1, start, c.num_kv_heads, c.head_dim)
        new_shape = (1, t, c.num_kv_heads, c.head_dim)
        for layer, (pk, pv, nk, nv) in enumerate(self._kv_names):
            for kind, past_name, new_name in ((0, pk, nk), (1, pv, nv)):
                # kv[layer, kind, a:b] is contiguous: bind it by address, no copy either way.
                binding.bind_input(past_name, cpu, dt, past_shape, kv[layer, kind].ctypes.data)
                binding.bind_output(new_name, cpu, dt, new_shape, kv[layer, kind, start:].ctypes.data)
        logits = np.empty((1, t, c.vocab_size), dtype=np.float32)
        binding.bind_output("logits", cpu, np.float32, logits.shape, logits.ctypes.data)
        self.session._sess.run_with_iobinding(binding, None)
        return logits[0]
