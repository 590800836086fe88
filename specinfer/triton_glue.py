"""Between Triton's Python backend and :mod:`specinfer.serving`: tensors, errors, BLS, metrics.

Every function takes the backend's ``triton_python_backend_utils`` module as ``pb`` (it exists only
inside Triton's stub process), so this module imports without Triton.
"""
from __future__ import annotations

import json
import time
import traceback
from typing import Callable

import numpy as np

from .errors import SpecInferError

Tensors = dict[str, np.ndarray]


def parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of a model's config.pbtxt, as plain strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def is_decoupled(pb, args: dict) -> bool:
    return pb.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


def read(pb, request, names: list[str]) -> Tensors:
    """The request's inputs among ``names`` (absent optional inputs are left out)."""
    out = {}
    for name in names:
        t = pb.get_input_tensor_by_name(request, name)
        if t is not None:
            out[name] = t.as_numpy()
    return out


def response(pb, tensors: Tensors):
    return pb.InferenceResponse([pb.Tensor(k, np.ascontiguousarray(v)) for k, v in tensors.items()])


def error(pb, exc: BaseException):
    """A request's failure as an error response that names the problem; the server keeps serving."""
    if isinstance(exc, SpecInferError):
        message = str(exc)
    else:
        message = f"internal error: {type(exc).__name__}: {exc}"
        pb.Logger.log_error(traceback.format_exc())
    return pb.InferenceResponse(error=pb.TritonError(message))


def handle(pb, request, names: list[str], fn: Callable[[Tensors], Tensors]):
    """Run ``fn`` on a request's inputs; a response, or an error response."""
    try:
        return response(pb, fn(read(pb, request, names)))
    except Exception as e:  # noqa: BLE001 - every failure becomes this request's error, not the server's
        return error(pb, e)


def bls(pb, model: str, inputs: Tensors) -> Tensors:
    """Call another model of the repository (Business Logic Scripting) and return its outputs."""
    request = pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()],
                                  requested_output_names=[])
    result = request.exec()
    if result.has_error():
        raise SpecInferError(f"{model}: {result.error().message()}")
    return {t.name(): t.as_numpy() for t in result.output_tensors()}


class Metrics:
    """The custom Prometheus metrics one model exports on Triton's metrics port."""

    ACCEPT_BUCKETS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
    TIME_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]

    def __init__(self, pb, model_name: str):
        labels = {"model": model_name}
        F = pb.MetricFamily
        self._families = [
            F("specinfer_active_sequences", "Sequences whose state this model holds", F.GAUGE),
            F("specinfer_kv_bytes", "Bytes of KV cache this model holds", F.GAUGE),
            F("specinfer_step_seconds", "Time of one draft (ssm models) or verification (llm) step", F.HISTOGRAM),
            F("specinfer_accepted_tokens_per_step", "Tokens one verification step emits (accepted + bonus)", F.HISTOGRAM),
        ]
        self.active = self._families[0].Metric(labels=labels)
        self.kv_bytes = self._families[1].Metric(labels=labels)
        self.step_seconds = self._families[2].Metric(labels=labels, buckets=self.TIME_BUCKETS)
        self.accepted = self._families[3].Metric(labels=labels, buckets=self.ACCEPT_BUCKETS)

    def update(self, model) -> None:
        """Gauges from a serving model's state (DraftModel or VerifyModel)."""
        self.active.set(len(model.sequences))
        self.kv_bytes.set(model.kv_bytes())


def timed(fn: Callable[[], Tensors], metric) -> Tensors:
    start = time.perf_counter()
    out = fn()
    metric.observe(time.perf_counter() - start)
    return out
