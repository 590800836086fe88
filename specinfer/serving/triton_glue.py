"""Between Triton's Python backend and the serving models (:mod:`.models`, :mod:`.orchestrator`):
tensors, errors, BLS, metrics.

Every function takes the backend's ``triton_python_backend_utils`` module as ``pb`` (it exists only
inside Triton's stub process), so this module imports without Triton.
"""
from __future__ import annotations

import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import RequestError, ServerBusy, ServerStopping, SpecInferError

Tensors = dict[str, np.ndarray]


def parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of a model's config.pbtxt, as plain strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def is_decoupled(pb, args: dict) -> bool:
    return pb.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


def read(pb, request, names: list[str], batched: bool = False) -> Tensors:
    """The request's inputs among ``names`` (absent optional inputs are left out); ``batched``: the
    model batches, and a request is a batch of one, whose leading dimension comes off."""
    out = {}
    for name in names:
        t = pb.get_input_tensor_by_name(request, name)
        if t is not None:
            a = t.as_numpy()
            if batched:
                if a.ndim == 0 or a.shape[0] != 1:
                    raise RequestError(f"'{name}': a request to this model is a batch of one, got shape {list(a.shape)}")
                a = a[0]
            out[name] = a
    return out


def response(pb, tensors: Tensors, batched: bool = False):
    return pb.InferenceResponse([pb.Tensor(k, np.ascontiguousarray(v)[None] if batched else np.ascontiguousarray(v))
                                 for k, v in tensors.items()])


def error(pb, exc: BaseException, model: str | None = None):
    """A request's failure as an error response; the server keeps serving. The client's mistake (a
    RequestError) is INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT) with its message; a busy or
    stopping server is UNAVAILABLE (a client may retry); anything else is INTERNAL and logged: a
    SpecInferError keeps its one-line message, other exceptions say only where they happened
    (``model``), their text and traceback go to the server log alone."""
    if isinstance(exc, RequestError):
        return pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG))
    if isinstance(exc, (ServerStopping, ServerBusy)):
        return pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.UNAVAILABLE))
    if isinstance(exc, SpecInferError):
        message = str(exc)
        pb.Logger.log_error(message)
    else:
        message = f"internal error{f' in {model}' if model else ''}; see the server log"
        pb.Logger.log_error(f"{message}\n{''.join(traceback.format_exception(exc))}")
    return pb.InferenceResponse(error=pb.TritonError(message, pb.TritonError.INTERNAL))


def handle(pb, request, names: list[str], fn: Callable[[Tensors], Tensors], model: str | None = None,
           batched: bool = False):
    """Run ``fn`` on a request's inputs; a response, or an error response (see :func:`error`).
    ``batched``: see :func:`read`."""
    try:
        return response(pb, fn(read(pb, request, names, batched)), batched)
    except Exception as e:  # noqa: BLE001 - every failure becomes this request's error, not the server's
        return error(pb, e, model)


def handle_batch(pb, requests, names: list[str], fn: Callable[[list[Tensors]], list], model: str, metric) -> list:
    """Run ``fn`` on the inputs of a batch of requests (each a batch of one) at once, its time in
    ``metric``; each request's response, or its error response (see :func:`error`): a request that
    fails fails alone."""
    answers, inputs = [None] * len(requests), []
    for i, r in enumerate(requests):
        try:
            inputs.append((i, read(pb, r, names, batched=True)))
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            answers[i] = e
    start = time.perf_counter()
    for (i, _), out in zip(inputs, fn([t for _, t in inputs])):
        answers[i] = out
    metric.observe(time.perf_counter() - start)
    return [error(pb, a, model) if isinstance(a, BaseException) else response(pb, a, batched=True) for a in answers]


def bls(pb, model: str, inputs: Tensors) -> Tensors:
    """Call another model of the repository (Business Logic Scripting) and return its outputs. The
    repository's inner models batch (``max_batch_size`` >= 1; the llm model's batcher puts many
    requests in one ``execute``): each request is a batch of one, so a leading dimension of 1 goes
    on every input and comes off every output."""
    request = pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(k, np.ascontiguousarray(v)[None]) for k, v in inputs.items()],
                                  requested_output_names=[])
    result = request.exec()
    if result.has_error():
        # The called model's INVALID_ARG comes from the client's input (a tree spec, a sampling
        # parameter): it stays the client's error. Its other errors are the server's.
        err = result.error()
        kind = RequestError if err.code() == pb.TritonError.INVALID_ARG else SpecInferError
        raise kind(f"{model}: {err.message()}")
    return {t.name(): t.as_numpy()[0] for t in result.output_tensors()}


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
            F("specinfer_reclaimed_sequences_total", "Sequences released because they were idle too long", F.COUNTER),
        ]
        self.active = self._families[0].Metric(labels=labels)
        self.kv_bytes = self._families[1].Metric(labels=labels)
        self.step_seconds = self._families[2].Metric(labels=labels, buckets=self.TIME_BUCKETS)
        self.accepted = self._families[3].Metric(labels=labels, buckets=self.ACCEPT_BUCKETS)
        self.reclaimed = self._families[4].Metric(labels=labels)
        # The stub's metric calls are not safe from several threads at once (seen: a histogram's
        # observe answered as if it were a gauge's): threads that share this object hold the lock.
        self.lock = threading.Lock()

    def update(self, model) -> None:
        """Gauges from a serving model's state (DraftModel or VerifyModel; or the fused
        orchestrator, whose ``sequences`` and ``kv_bytes`` cover its models)."""
        self.active.set(len(model.sequences))
        self.kv_bytes.set(model.kv_bytes())


# --- the serving process's own state: the orchestrator's key, stopping, idle sequences ---------------
KEY_FILE = "caller.key"   # in the repository: the orchestrator's key to the stateful models


def caller_key(args: dict) -> str:
    """The key the orchestrator sends and the stateful models check (written by ``specinfer repo``,
    readable by its owner only; clients never see it)."""
    return (Path(args["model_repository"]).parent / KEY_FILE).read_text().strip()


def stopping() -> bool:
    """Whether the server is stopping: ``specinfer serve`` creates the file named in
    ``SPECINFER_STOP_FILE`` before it stops tritonserver, so that running streams end with a clear
    error at once, not when the server's grace period cuts them."""
    path = os.environ.get("SPECINFER_STOP_FILE")
    return bool(path) and os.path.exists(path)


def reclaim_idle(model, lock: threading.Lock, idle_seconds: float, metrics: "Metrics") -> threading.Thread:
    """Start a thread that releases the sequences of ``model`` idle for more than ``idle_seconds``
    (their orchestrator died or lost them), counted in ``specinfer_reclaimed_sequences_total``.
    ``lock`` is the one ``execute`` holds, so a release never runs beside a step."""
    def loop():
        while True:
            time.sleep(max(1.0, idle_seconds / 4))
            with lock:
                n = model.reclaim(idle_seconds)
                metrics.update(model)
                if n:
                    metrics.reclaimed.increment(n)
    thread = threading.Thread(target=loop, daemon=True, name="reclaim-idle")
    thread.start()
    return thread


class MeteredSpeculator:
    """A speculator whose steps feed a model's metrics (the fused orchestrator runs its models in
    process, and reports what the ``llm`` model reports): step time and accepted tokens each step,
    and the gauges of ``models`` (their sequences and KV) when a sequence starts or ends, the only
    times they change."""

    def __init__(self, speculator, metrics: "Metrics", models):
        self.inner, self.metrics, self.models = speculator, metrics, models
        self.max_context = speculator.max_context

    def start(self, prefix: list[int]) -> None:
        try:
            self.inner.start(prefix)
        finally:
            self._update_gauges()

    def step(self, root: int, budget: int) -> tuple[list[int], int]:
        start = time.perf_counter()
        path, bonus = self.inner.step(root, budget)
        with self.metrics.lock:
            self.metrics.step_seconds.observe(time.perf_counter() - start)
            self.metrics.accepted.observe(len(path))   # accepted speculation + bonus
        return path, bonus

    def release(self) -> None:
        try:
            self.inner.release()
        finally:
            self._update_gauges()

    def _update_gauges(self) -> None:
        with self.metrics.lock:
            self.metrics.update(self.models)
