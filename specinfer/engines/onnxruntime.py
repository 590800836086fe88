"""The ONNX Runtime engine: an exported folder (``specinfer export``) behind the Runtime interface.

It runs the export's ONNX Runtime lowering (``model.ort.onnx``, see
:mod:`specinfer.export.ort_lowering`): GroupQueryAttention with the token tree as an attention
bias, rotary inside, fused projections. A sequence's KV cache is one host buffer
``kv[layer, K|V, kv_head, slot, head_dim]`` of fixed capacity. Its per-layer slices are bound once,
when the sequence starts, as both the graph's ``past_*`` inputs and its ``present_*`` outputs
(onnxruntime's public IOBinding, by address): the attention kernel sees the same memory on both
sides, reads the cache in place and writes only the new tokens' rows, so no step copies the cache
and a step rebinds only its few small inputs and the logits.

CPU only: ONNX Runtime's CUDA GroupQueryAttention takes neither ``attention_bias`` nor
``position_ids``; the GPU engines are ``torch-gpu`` and ``tensorrt``.
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
LOWEST = np.finfo(np.float32).min
SMALL_MODEL_PARAMETERS = 4_000_000


def read_manifest(onnx_dir: str | Path) -> dict:
    onnx_dir = Path(onnx_dir)
    path = onnx_dir / MANIFEST
    if not path.is_file():
        raise SpecInferError(f"no {MANIFEST} in {onnx_dir}: is it a folder written by `specinfer export`?")
    return json.loads(path.read_text())


def session_options(threads: int):
    """CPU session options for models that take turns on few cores."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Shapes change every call (the tree, the bias): a memory pattern planned for one shape is never
    # reused, and planning it each call cost a small model up to a third of its step.
    options.enable_mem_pattern = False
    # Several sessions (LLM, SSMs) take turns on few cores: threads that spin-wait after their
    # work would steal the cores from the session that runs next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def default_threads(config: ModelConfig) -> int:
    """Intra-op threads for a model: one for a small one, whose kernels are too short to split
    across cores (an SSM step took half the time on one thread as on two), else every core."""
    c = config
    params = c.vocab_size * c.hidden_size + c.num_layers * c.hidden_size * (
        (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim + 3 * c.intermediate_size)
    return 1 if params < SMALL_MODEL_PARAMETERS else (os.cpu_count() or 1)


class OrtRuntime(Runtime):
    """Runtime over an exported folder's ONNX Runtime lowering, on the CPU."""

    def __init__(self, onnx_dir: str | Path, threads: int | None = None, max_context: int | None = None):
        import onnxruntime as ort

        from ..export.ort_lowering import ORT_ONNX, output_names

        self.dir = Path(onnx_dir)
        self.manifest = read_manifest(self.dir)
        lowered = self.manifest.get("ort_onnx")
        if lowered is None or not (self.dir / lowered).is_file():
            raise SpecInferError(f"{self.dir} has no ONNX Runtime lowering ({ORT_ONNX}): it was exported by an older "
                                 f"specinfer; export the checkpoint again")
        config = ModelConfig.from_dict(self.manifest["config"])
        limit = self.manifest["max_context"]
        super().__init__(config, min(max_context or limit, limit))
        self.threads = threads or default_threads(config)
        options = session_options(self.threads)
        self.session = ort.InferenceSession(str(self.dir / lowered), options, providers=["CPUExecutionProvider"])
        names = output_names(config.num_layers)[1:]
        self._kv_names = [(f"past_key.{i}", f"past_value.{i}", names[2 * i], names[2 * i + 1])
                          for i in range(config.num_layers)]
        self.draft_depth = self.manifest.get("draft_depth", 0)
        self._draft_session = None   # opened at the first draft: a target LLM never drafts
        self._options = options

    def _allocate(self, capacity: int) -> np.ndarray:
        c = self.config
        head_dim = self.manifest.get("ort_head_dim", c.head_dim)   # padded to a multiple of 16
        return np.zeros((c.num_layers, 2, c.num_kv_heads, capacity, head_dim), dtype=np.float32)

    def _bind_cache(self, session, seq: SequenceState, presents: list[list[str]]):
        """A binding of ``session`` with the sequence's cache bound as its past and as every one of
        ``presents`` (per layer, its key and value output names): made once per sequence."""
        binding = session.io_binding()
        kv = seq.kv
        shape = (1,) + kv.shape[2:]
        for layer, (pk, pv, *_) in enumerate(self._kv_names):
            for kind, past in ((0, pk), (1, pv)):
                address = kv[layer, kind].ctypes.data
                binding.bind_input(past, "cpu", 0, np.float32, shape, address)
                for present in presents[layer][kind::2]:
                    binding.bind_output(present, "cpu", 0, np.float32, shape, address)
        return binding

    def draft_chain(self, seq_id, tokens, depth: int) -> tuple[list[int], list[float]]:
        """One session run of the export's drafter (``draft.ort.onnx``) when it fits; else one
        Runtime call per token (the base class)."""
        seq = self._get(seq_id)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        c, d = len(tokens), self.draft_depth
        if seq.pending or not 1 <= depth <= d or seq.length + c + d - 1 > seq.capacity:
            return super().draft_chain(seq_id, tokens, depth)
        self._check_tokens(tokens)
        if "draft" not in seq.bindings:
            from ..export.ort_lowering import drafter_present_names

            if self._draft_session is None:
                import onnxruntime as ort

                self._draft_session = ort.InferenceSession(str(self.dir / self.manifest["draft_onnx"]),
                                                           self._options, providers=["CPUExecutionProvider"])
            steps = drafter_present_names(self.config.num_layers, d)
            per_layer = [[n for step in steps for n in step[2 * i:2 * i + 2]] for i in range(self.config.num_layers)]
            seq.bindings["draft"] = self._bind_cache(self._draft_session, seq, per_layer)
        binding = seq.bindings["draft"]
        end = seq.length + c
        binding.bind_cpu_input("input_ids", tokens[None])
        binding.bind_cpu_input("seqlens_k", np.array([end - 1], dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(end, dtype=np.int32))
        drafted, mass = np.empty((1, d), dtype=np.int64), np.empty((1, d, 1), dtype=np.float32)
        binding.bind_output("draft_tokens", "cpu", 0, np.int64, drafted.shape, drafted.ctypes.data)
        binding.bind_output("draft_mass", "cpu", 0, np.float32, mass.shape, mass.ctypes.data)
        self._draft_session.run_with_iobinding(binding)
        n = c + d - 1                 # scored: the tokens and every draft token but the last
        seq.parents, seq.depths = list(range(-1, n - 1)), list(range(n))
        return drafted[0, :depth].tolist(), (1.0 / mass[0, :depth, 0]).tolist()

    def _forward(self, seq: SequenceState, tokens, positions, visible) -> np.ndarray:
        start = seq.length + seq.pending          # the new tokens' first slot
        if "score" not in seq.bindings:
            seq.bindings["score"] = self._bind_cache(self.session, seq, [names[2:] for names in self._kv_names])
        binding = seq.bindings["score"]
        if start == 0 and len(tokens) > 1 and (positions != np.arange(len(tokens))).any():
            # On an empty cache the kernel takes the call for a prompt and numbers it 0..T-1
            # itself, ignoring position_ids: a tree there goes in as its first node, then the rest.
            first = self._run(binding, 0, tokens[:1], positions[:1], visible[:1, :1])
            return np.concatenate([first, self._run(binding, 1, tokens[1:], positions[1:], visible)])
        return self._run(binding, start, tokens, positions, visible)

    def _run(self, binding, start: int, tokens, positions, visible) -> np.ndarray:
        t, n = len(tokens), len(visible)
        # Prefix columns are visible to every new token; the tree columns follow the ancestor bits.
        bias = np.zeros((1, 1, t, start + t), dtype=np.float32)
        bias[0, 0, :, start + t - n:] = np.where(visible[n - t:], 0.0, LOWEST)
        feeds = {"input_ids": tokens[None], "position_ids": positions[None], "attention_bias": bias,
                 "seqlens_k": np.array([start + t - 1], dtype=np.int32),
                 "total_sequence_length": np.array(start + t, dtype=np.int32)}
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        logits = np.empty((1, t, self.config.vocab_size), dtype=np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits[0]

    def _move(self, seq: SequenceState, src: np.ndarray, dst: np.ndarray) -> None:
        # Advanced indexing gathers every source before it writes: overlapping moves are safe.
        seq.kv[:, :, :, dst] = seq.kv[:, :, :, src]
