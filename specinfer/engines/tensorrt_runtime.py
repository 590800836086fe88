"""The TensorRT engine: an engine folder (``specinfer build``) behind the Runtime interface.

The KV cache is device-resident: one CUDA buffer (a torch tensor) per sequence,
``[layer, K|V, slot, kv_head, head_dim]``. Each step binds, by address, the cached prefix
``kv[l, k, :start]`` (contiguous) as the engine's ``past_*`` inputs and the next free slots
``kv[l, k, start:start+T]`` as its ``new_*`` outputs, so TensorRT reads the cache in place and writes
the new tokens' KV straight into their slots: no step copies the cache, and nothing but the token
ids, positions, mask and logits cross PCIe. The optimization profile (tree or prefill) is chosen per
step from the shapes. A commit moves only the accepted nodes' KV with the Triton commit kernel (a
torch gather/scatter when OpenAI Triton is absent).

Untested here: TensorRT and a GPU are absent from our machines; its tests carry the ``trt`` marker.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import SpecInferError
from ..export.draft_vocab import read_draft_vocab
from ..plugins.tree_attention import pack_bits
from .runtime import Runtime, SequenceState
from .tensorrt_build import pick_profile, read_engine_manifest, require_tensorrt


class TrtRuntime(Runtime):
    """Runtime over a TensorRT engine folder, on one CUDA device."""

    def __init__(self, engine_dir: str | Path, max_context: int | None = None, device: str = "cuda"):
        self.dir = Path(engine_dir)
        self.manifest = read_engine_manifest(self.dir)
        trt = require_tensorrt()
        import torch

        config = ModelConfig.from_dict(self.manifest["config"])
        limit = self.manifest["max_context"]
        super().__init__(config, min(max_context or limit, limit))
        self.draft_vocab = read_draft_vocab(self.dir, config.vocab_size)   # copied by the build
        self.torch = torch
        self.device = torch.device(device)
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[self.manifest["dtype"]]
        self.logger = trt.Logger(trt.Logger.WARNING)
        engine_bytes = (self.dir / self.manifest["engine"]).read_bytes()
        with torch.cuda.device(self.device):
            self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(engine_bytes)
            if self.engine is None:
                raise SpecInferError(f"TensorRT could not load {self.dir / self.manifest['engine']} (built by another "
                                     "TensorRT version or for another GPU? build it again on this machine)")
            self.context = self.engine.create_execution_context()
            self.stream = torch.cuda.Stream(self.device)
        self.profiles = self.manifest["profiles"]
        self._profile: int | None = None
        self._run = threading.Lock()  # one execution context: one step at a time
        self._kv_names = [(f"past_key.{i}", f"past_value.{i}", f"new_key.{i}", f"new_value.{i}")
                          for i in range(config.num_layers)]
        try:
            from ..plugins import triton_kernels

            self._commit = triton_kernels.commit_kv if triton_kernels.available() else None
        except ImportError:
            self._commit = None

    def _allocate(self, capacity: int):
        c = self.config
        # Allocate and zero on self.stream, the only stream that ever touches the buffer (_forward,
        # _move): the fill is then ordered before the first step with no cross-stream wait, and the
        # caching allocator ties the block to that stream, so its reuse after release is ordered too.
        # (On the default stream, the engine could read the buffer before the fill ran.)
        with self.torch.cuda.stream(self.stream):
            return self.torch.zeros(c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim, dtype=self.dtype,
                                    device=self.device)

    def _forward(self, seq: SequenceState, tokens, positions, visible) -> np.ndarray:
        torch, c = self.torch, self.config
        tree_mask = pack_bits(visible)
        start, t, (n, w) = seq.length + seq.pending, len(tokens), tree_mask.shape
        past_shape = (1, start, c.num_kv_heads, c.head_dim)
        shapes = {"input_ids": (1, t), "position_ids": (1, t), "tree_mask": (1, n, w),
                  **{names[j]: past_shape for names in self._kv_names for j in (0, 1)}}
        profile = pick_profile(self.profiles, shapes)
        with self._run, torch.cuda.stream(self.stream):
            handle = self.stream.cuda_stream
            if profile != self._profile:
                self.context.set_optimization_profile_async(profile, handle)
                self._profile = profile
            feeds = {"input_ids": torch.from_numpy(tokens[None]), "position_ids": torch.from_numpy(positions[None]),
                     "tree_mask": torch.from_numpy(np.ascontiguousarray(tree_mask[None]))}
            feeds = {k: v.to(self.device, non_blocking=True) for k, v in feeds.items()}
            for name, tensor in feeds.items():
                self.context.set_input_shape(name, tuple(tensor.shape))
                self.context.set_tensor_address(name, tensor.data_ptr())
            kv = seq.kv
            for layer, (pk, pv, nk, nv) in enumerate(self._kv_names):
                for kind, past, new in ((0, pk, nk), (1, pv, nv)):
                    # kv[layer, kind] is [capacity, Hkv, D], contiguous: its first `start` slots are the
                    # past and the next t slots receive the new KV. Bound by address, never copied.
                    self.context.set_input_shape(past, past_shape)
                    self.context.set_tensor_address(past, kv[layer, kind].data_ptr())
                    self.context.set_tensor_address(new, kv[layer, kind, start].data_ptr())
            logits = torch.empty((1, t, c.vocab_size), dtype=torch.float32, device=self.device)
            self.context.set_tensor_address("logits", logits.data_ptr())
            if not self.context.execute_async_v3(handle):
                raise SpecInferError(f"TensorRT failed to run a step of {t} tokens over {start} cached ones")
            out = logits[0].to("cpu", non_blocking=True)
            self.stream.synchronize()
        return out.numpy()

    def _move(self, seq: SequenceState, src: np.ndarray, dst: np.ndarray) -> None:
        with self._run, self.torch.cuda.stream(self.stream):
            if self._commit is not None:
                self._commit(seq.kv, src, dst)
            else:  # advanced indexing gathers before it scatters: safe for overlapping moves
                src_t, dst_t = (self.torch.as_tensor(a, device=self.device) for a in (src, dst))
                seq.kv[:, :, dst_t] = seq.kv[:, :, src_t]
            self.stream.synchronize()
