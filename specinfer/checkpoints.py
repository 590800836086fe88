"""Making and deriving Hugging Face checkpoint folders (no network, no transformers needed)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .errors import SpecInferError


def truncate_layers(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """A checkpoint made of the first ``num_layers`` decoder layers of ``src`` (same embeddings, norm
    and head): a speculative model that agrees with its source often, for tests and demos."""
    from safetensors.numpy import load_file, save_file

    from .export.draft_vocab import DRAFT_VOCAB

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise SpecInferError(f"cannot keep {num_layers} of {config['num_hidden_layers']} layers")
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                 DRAFT_VOCAB):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst
