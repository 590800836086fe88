"""The embedded default models, trained here on the Python standard library (see stdlib/README.md):
a byte-level BPE tokenizer, a 12.6M-parameter Llama LLM, boost-tuned SSMs of 0.62M each and SSM 1
distilled for sampling, fp16."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecInferError

EMBEDDED_DIR = Path(__file__).parent / "stdlib"


def _require(path: Path) -> Path:
    if not path.exists():
        raise SpecInferError(f"the embedded models are missing ({path}): reinstall specinfer, or pass --llm")
    return path


def embedded_llm() -> Path:
    """The embedded LLM's checkpoint folder (with the tokenizer)."""
    return _require(EMBEDDED_DIR / "llm")


def embedded_ssms() -> list[Path]:
    """The embedded SSMs' checkpoint folders, in boost-tuning order."""
    _require(EMBEDDED_DIR)
    return sorted(EMBEDDED_DIR.glob("ssm[0-9]*"), key=lambda p: int(p.name[3:]))


def embedded_sampling_ssms() -> list[Path]:
    """The SSMs that draft for sampled requests: SSM 1 distilled on the LLM's distributions
    (``specinfer distill``), whose draws the LLM accepts more often than the boost-tuned SSMs'
    (which draft for greedy requests, where they agree with the LLM's argmax more)."""
    return [_require(EMBEDDED_DIR / "distilled_ssm1")]


def embedded_prompts() -> list[str]:
    """The held-out benchmark prompts: code from stdlib files kept out of training, ending in a ``def``."""
    return json.loads(_require(EMBEDDED_DIR / "prompts.json").read_text())
