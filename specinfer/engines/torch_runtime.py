"""The PyTorch engine: our model in eager PyTorch behind the Runtime interface.

On CPU it is the reference the other engines are checked against; on a GPU it is the engine the
device machine runs end to end.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..export.draft_vocab import read_draft_vocab
from ..model import LlamaModel, load_model
from ..plugins.tree_attention import pack_bits
from .runtime import Runtime, SequenceState


class TorchRuntime(Runtime):
    def __init__(self, model: LlamaModel | str | Path, max_context: int | None = None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        if not isinstance(model, LlamaModel):   # a checkpoint folder, with its draft vocabulary if any
            folder, model = model, load_model(model, dtype)
            self.draft_vocab = read_draft_vocab(folder, model.config.vocab_size)
        self.model = model.to(device).eval()
        self.device, self.dtype = device, next(model.parameters()).dtype
        super().__init__(model.config, max_context or model.config.max_position_embeddings)

    def _allocate(self, capacity: int) -> torch.Tensor:
        c = self.config
        return torch.zeros(c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim,
                           dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def _forward(self, seq: SequenceState, tokens, positions, visible) -> np.ndarray:
        start, t = seq.length + seq.pending, len(tokens)
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))[None].to(self.device)
        kv = seq.kv
        logits, keys, values = self.model(
            as_tensor(tokens), as_tensor(positions), as_tensor(pack_bits(visible)),
            [kv[i, 0, :start][None] for i in range(self.config.num_layers)],
            [kv[i, 1, :start][None] for i in range(self.config.num_layers)],
        )
        for i, (k, v) in enumerate(zip(keys, values)):
            kv[i, 0, start:start + t] = k[0]
            kv[i, 1, start:start + t] = v[0]
        return logits[0].float().cpu().numpy()
