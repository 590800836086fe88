"""The serving layer: specinfer on NVIDIA's Triton Inference Server.

- :mod:`.request`: the wire protocol; a client's request tensors read and checked
  (:func:`read_request`), the limits a request may ask for.
- :mod:`.models`: what each stateful model of the repository does, as plain Python over numpy
  arrays: ``ssm_<i>``/``lookup`` draft (:class:`DraftModel`, :class:`LookupModel`), ``llm`` verifies
  (:class:`VerifyModel`, many requests' steps in one LLM call), each keeping one sequence per request;
  ``tree_builder`` merges the drafts
  (:func:`build_tree`); trees travel as tensors (:func:`tree_to_tensors`).
- :mod:`.orchestrator`: the client-facing model (:class:`Orchestrator`, text in and out) and its
  speculation loop over the other models (:class:`RemoteSpeculator`, :func:`run_request`).
- :mod:`.triton_glue`: between Triton's Python backend and the above (tensors, errors, BLS, metrics).
- :mod:`.repository`: ``specinfer repo`` writes a model repository from ``templates/`` (inside this
  package: each model's ``config.pbtxt.in`` and ``1/model.py``).
- :mod:`.server` and :mod:`.gateway`: ``specinfer serve`` launches ``tritonserver`` on a repository,
  behind an HTTP gateway.

The names below are imported on first use, so that ``import specinfer.serving`` (which every
``model.py`` does inside Triton) loads neither aiohttp nor the engines until they are needed.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "models": ("CALLER_KEY", "OPS", "DraftModel", "LookupModel", "VerifyModel", "build_tree", "tensors_to_tree",
               "tree_to_tensors"),
    "orchestrator": ("Orchestrator", "Piece", "RemoteSpeculator", "run_request", "stats_tensors"),
    "request": ("GenerationRequest", "read_request"),
    "repository": ("templates_dir", "write_repository"),
    "server": ("TritonServer", "find_tritonserver"),
    "gateway": ("Gateway",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
