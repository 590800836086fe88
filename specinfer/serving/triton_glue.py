"""Between Triton's Python backend and the serving models (:mod:`.models`, :mod:`.orchestrator`):
tensors, errors, BLS, metrics.

Every function takes the backend's ``triton_python_backend_utils`` module as ``pb`` (it exists only
inside Triton's stub process), so this module imports without Triton.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import queue
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import RequestError, RequestTooLarge, ServerBusy, ServerStopping, SpecInferError

Tensors = dict[str, np.ndarray]
log = logging.getLogger(__name__)


def parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of a model's config.pbtxt, as plain strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def model_threads(p: dict[str, str]) -> int | None:
    """ONNX Runtime threads for a model in a process of its own behind the ensemble (``llm``,
    ``ssm_<i>``; ``p``: its parameters): the repository's ``threads``, else a pool of its own sized
    to the model (:func:`~specinfer.engines.onnxruntime.threads_beside_others`), not the shared pool."""
    threads = int(p["threads"])
    if not threads and p["engine"] == "onnxruntime":
        from ..engines.onnxruntime import threads_beside_others

        threads = threads_beside_others(p["model_dir"])
    return threads or None


def metrics_seconds(p: dict[str, str]) -> float:
    """The model's seconds between two pushes of its metrics (absent in older repositories)."""
    return float(p.get("metrics_seconds", METRICS_SECONDS))


def is_decoupled(pb, args: dict) -> bool:
    return pb.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


def read(request, names: list[str], batched: bool = False) -> Tensors:
    """The request's inputs among ``names`` (absent optional inputs are left out); ``batched``: the
    model batches, and a request is a batch of one, whose leading dimension comes off."""
    out = {}
    # One pass over the inputs: pb.get_input_tensor_by_name walks them all for each name asked.
    given = {t.name(): t for t in request.inputs()}
    for name in names:
        t = given.get(name)
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
        return response(pb, fn(read(request, names, batched)), batched)
    except Exception as e:  # noqa: BLE001 - every failure becomes this request's error, not the server's
        return error(pb, e, model)


def handle_batch(pb, requests, names: list[str], fn: Callable[[list[Tensors]], list], model: str, metric) -> list:
    """Run ``fn`` on the inputs of a batch of requests (each a batch of one) at once, its time in
    ``metric``; each request's response, or its error response (see :func:`error`): a request that
    fails fails alone."""
    answers, inputs = [None] * len(requests), []
    for i, r in enumerate(requests):
        try:
            inputs.append((i, read(r, names, batched=True)))
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            answers[i] = e
    start = time.perf_counter()
    for (i, _), out in zip(inputs, fn([t for _, t in inputs])):
        answers[i] = out
    metric.observe(time.perf_counter() - start)
    return [error(pb, a, model) if isinstance(a, BaseException) else response(pb, a, batched=True) for a in answers]


def _request(pb, model: str, inputs: Tensors):
    """A BLS request of ``inputs`` to ``model``, asking for all its outputs."""
    return pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()],
                               requested_output_names=[])


def bls(pb, model: str, inputs: Tensors) -> Tensors:
    """Call another model of the repository (Business Logic Scripting) and return its outputs. The
    repository's inner models batch (``max_batch_size`` >= 1; the llm model's batcher puts many
    requests in one ``execute``): each request is a batch of one, so a leading dimension of 1 goes
    on every input and comes off every output."""
    result = _request(pb, model, {k: np.asarray(v)[None] for k, v in inputs.items()}).exec()
    if result.has_error():
        # The called model's INVALID_ARG comes from the client's input (a tree spec, a sampling
        # parameter): it stays the client's error. Its other errors are the server's.
        err = result.error()
        kind = RequestError if err.code() == pb.TritonError.INVALID_ARG else SpecInferError
        raise kind(f"{model}: {err.message()}")
    return {t.name(): t.as_numpy()[0] for t in result.output_tensors()}


RELAYED_ERRORS = (RequestTooLarge, ServerBusy, ServerStopping)   # what relay() knows by its message


def relay(pb, model: str, inputs: Tensors, merge: Callable[[list[Tensors]], Tensors]) -> Tensors:
    """A unary request's answer from a decoupled ``model`` of the repository (BLS): the request as
    it came (``stream`` false: the model answers once), its responses' outputs as one (``merge``).
    Triton's HTTP and gRPC infer refuse decoupled models, and a Triton ensemble around one is
    decoupled too, so a Python model relays.

    Triton 2.51's BLS cannot cancel a call: a relayed request whose client goes away runs on to its
    end (``max_tokens`` bounds it). And it gives every error of a decoupled model as INTERNAL: the
    caller checks the request first (its errors stay the client's), and the refusals that come
    later, of a request too large for the KV budget, of a busy or stopping server, are known here
    by their messages' prefixes (they stay INVALID_ARG and UNAVAILABLE)."""
    outputs = []
    for result in _request(pb, model, inputs).exec(decoupled=True):
        if result.has_error():
            message = result.error().message()
            raise next((kind for kind in RELAYED_ERRORS if message.startswith(kind.PREFIX)), SpecInferError)(message)
        if result.output_tensors():   # (the final flag may come alone)
            outputs.append({t.name(): t.as_numpy() for t in result.output_tensors()})
    if not outputs:
        raise SpecInferError(f"{model} answered nothing")
    return merge(outputs)


class Workers:
    """Daemon threads that run tasks (a request's loop, its response stream), each kept after its
    task for the next one, and ending once idle for ``idle_seconds``. Starting a thread costs a
    request here: ``Thread.start`` waits until the new thread holds the interpreter's lock, which
    the scheduler's thread and the other requests' hold in turn (0.5-3 ms measured, twice a
    request). With threads kept, one served stream's first token came 2-3 ms sooner, and 1-token
    requests went from 115 to 135 a second (alternated servers, four rounds)."""

    def __init__(self, idle_seconds: float = 60.0, name: str = "worker"):
        self.idle_seconds, self.name = idle_seconds, name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0        # threads waiting for a task that no submitted task has claimed yet
        self.threads = 0      # threads alive

    def submit(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on a thread of its own: an idle one, or a new one if none is."""
        with self._lock:
            start = self._idle == 0
            if start:
                self.threads += 1
            else:
                self._idle -= 1   # claimed: that thread takes this task (or another's, which claimed another)
            self._tasks.put((fn, args))
        if start:
            threading.Thread(target=self._work, daemon=True, name=self.name).start()

    def _work(self) -> None:
        while True:
            try:
                fn, args = self._tasks.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:
                    if self._tasks.empty() and self._idle > 0:   # no task waits for this thread
                        self._idle -= 1
                        self.threads -= 1
                        return
                continue
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a task's failure must not end the thread that others share
                log.exception("a task of %s failed", self.name)
            with self._lock:
                self._idle += 1


# The threads that run the orchestrators' requests and their response streams, in this process.
WORKERS = Workers(name="request")


# Seconds: at most one streamed response per request this often. Each response is work for
# tritonserver and the client on the same cores: 16 streams served made 6% and 17% more tokens/s at
# 0.05 than at 0.02 in two series, within this VM's noise (docs/batching.md, "The default interval is 50 ms").
STREAM_INTERVAL = 0.05

# Seconds between a streamed request's questions whether its client cancelled (each a round trip):
# a cancel stops the request's steps within this (a fused step of one sequence takes 1-3 ms).
POLL_SECONDS = 0.02
FUSED_SWITCH_INTERVAL = 0.001   # seconds: sys.setswitchinterval in the fused orchestrator's process
# The LLM's scheduler (the fused orchestrator's, the ensemble's ``llm`` model's) runs every batch
# size up to this many sequences at load, so that no burst of up to 16 requests waits for the LLM's
# sessions to open (scheduler.warm_batches).
# Embedded LLM, int8 products, after the heap's free pages went back: +58 MB and 1.1 s at load
# (warmed up to 32: +99 MB, 1.9 s; the sizes past 16 open at their first batch instead).
WARM_BATCHES = 16


class ResponseStream:
    """A request's responses, sent in order from a thread of their own.

    Each send, and each check for a client's cancel, is a round trip to the server process. Made
    between steps, they kept a request from its next step: at 16 streams in ``ensemble_fused`` the
    scheduler's batches held 9-10 of them instead of 15.5 in process. So the generation loop only
    queues its responses here, and what queued goes out as one response (``merge``) at most every
    ``interval`` seconds (a final or error response at once): fewer, larger pieces, each costing
    the server and the client their processing. Whether the client cancelled is asked every
    ``poll_seconds``, whether or not a response went out; :attr:`cancelled` is the last answer (or
    a failed send)."""

    def __init__(self, pb, request, merge: Callable[[list[Tensors]], Tensors], model: str | None = None,
                 interval: float = STREAM_INTERVAL, poll_seconds: float = POLL_SECONDS):
        self.pb, self.request, self.merge, self.model = pb, request, merge, model
        self.interval, self.poll_seconds = interval, poll_seconds
        self.sender = request.get_response_sender()
        self.cancelled = False
        self._queue: list[tuple[Tensors | None, BaseException | None, bool]] = []   # (outputs, error, final)
        self._sent = 0.0                   # when the last response went out
        self._asked = time.monotonic()     # when the client's cancel was last asked about
        self._ready = threading.Condition()
        WORKERS.submit(self._loop)

    def send(self, tensors: Tensors, final: bool = False) -> None:
        self._put((tensors, None, final))

    def fail(self, exc: BaseException) -> None:
        """End the request with an error response, after the responses queued before it."""
        self._put((None, exc, True))

    def _put(self, item) -> None:
        with self._ready:
            self._queue.append(item)
            self._ready.notify()

    def _take(self) -> list:
        """The responses due now, up to the first final one (an error alone); none when it is time
        to ask for a cancel instead."""
        with self._ready:
            poll = self._asked + self.poll_seconds
            while True:
                now, due = time.monotonic(), self._sent + self.interval
                if self._queue and (now >= due or self._queue[-1][2]):
                    break
                if now >= poll:
                    return []
                self._ready.wait(min(poll, due) - now if self._queue else poll - now)
            n = next(i + 1 for i, item in enumerate(self._queue) if item[2] or i == len(self._queue) - 1)
            if self._queue[n - 1][1] is not None and n > 1:
                n -= 1
            items, self._queue = self._queue[:n], self._queue[n:]
            return items

    def _loop(self) -> None:
        pb = self.pb
        while True:
            items = self._take()
            if items:
                _, exc, final = items[-1]
                try:
                    out = error(pb, exc, self.model) if exc is not None else response(pb, self.merge([t for t, _, _ in items]))
                    self.sender.send(out, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
                except Exception as e:  # noqa: BLE001 - the client is gone: its loop ends at its next step
                    pb.Logger.log_warn(f"{self.model}: a response could not be sent ({e}); ending the request")
                    self.cancelled, final = True, True
                self._sent = time.monotonic()
                if final:
                    return
            if time.monotonic() - self._asked >= self.poll_seconds:
                self.cancelled = self.cancelled or self.request.is_cancelled()
                self._asked = time.monotonic()


# Seconds between two hand-overs of a model's metrics to the server process (each changed series
# is a round trip between the processes). Written from a request's path, as they were (two a
# step), they cost one stream of the fused orchestrator 6.5% of its tokens/s: 1318 against 1404
# without metrics (alternated servers, 64-token requests, six rounds). Pushed every 0.1 s: 1258
# against 1178 then, 1298 without; every 1 s: 1232 against 1178, 1234 without. A scrape is
# seldom more often than every few seconds.
METRICS_SECONDS = 1.0


class _Series:
    """One series kept in this process, and the value last handed to its Triton metric."""

    __slots__ = ("metric", "gauge", "value", "pushed")

    def __init__(self, metric, gauge: bool = False):
        self.metric, self.gauge, self.value, self.pushed = metric, gauge, 0.0, 0.0


class Histogram:
    """A Prometheus histogram kept in this process: its series (``_bucket`` by ``le``,
    cumulative; ``_sum``; ``_count``) are counters in Triton's metrics, which a push increments by
    what was observed since the last."""

    def __init__(self, metrics: "Metrics", name: str, description: str, labels: dict, buckets: list[float]):
        self._metrics, self.buckets = metrics, list(buckets)
        family = metrics.family(f"{name}_bucket", description)
        les = [repr(float(b)) for b in self.buckets] + ["+Inf"]
        self.series = [_Series(family.Metric(labels=labels | {"le": le})) for le in les] + \
            [_Series(metrics.family(f"{name}_{part}", description).Metric(labels=labels)) for part in ("sum", "count")]

    def observe(self, value: float) -> None:
        with self._metrics.lock:
            for series in self.series[bisect.bisect_left(self.buckets, value):len(self.buckets) + 1]:
                series.value += 1
            self.series[-2].value += value
            self.series[-1].value += 1
        self._metrics.changed()


class Metrics:
    """The custom Prometheus metrics one model exports on Triton's metrics port, kept in this
    process and handed to the server process by a thread of their own, at most every
    ``push_seconds`` (each changed series a round trip): writing one costs a lock, wherever it
    is written from. A scrape may see them that much late."""

    ACCEPT_BUCKETS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
    TIME_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]

    def __init__(self, pb, model_name: str, push_seconds: float = METRICS_SECONDS):
        self._pb, self.push_seconds = pb, push_seconds
        self._families: list = []   # kept: a Metric whose family is gone fails (the backend frees it)
        self.lock = threading.Lock()   # the values; the stub's metric calls are made by the pusher alone
        labels = {"model": model_name}
        self._active = self._series_of("specinfer_active_sequences", "Sequences whose state this model holds",
                                       labels, gauge=True)
        self._kv_bytes = self._series_of("specinfer_kv_bytes", "Bytes of KV cache this model holds", labels, gauge=True)
        self._reclaimed = self._series_of("specinfer_reclaimed_sequences_total",
                                          "Sequences released because they were idle too long", labels)
        self.step_seconds = Histogram(self, "specinfer_step_seconds",
                                      "Time of one draft (ssm models) or verification (llm) step", labels, self.TIME_BUCKETS)
        self.accepted = Histogram(self, "specinfer_accepted_tokens_per_step",
                                  "Tokens one verification step emits (accepted + bonus)", labels, self.ACCEPT_BUCKETS)
        self._series = [self._active, self._kv_bytes, self._reclaimed] + self.step_seconds.series + self.accepted.series
        self._changed = threading.Event()
        self._pusher: threading.Thread | None = None

    def family(self, name: str, description: str, gauge: bool = False):
        """A new metric family in Triton's metrics, a counter unless ``gauge``."""
        F = self._pb.MetricFamily
        self._families.append(F(name, description, F.GAUGE if gauge else F.COUNTER))
        return self._families[-1]

    def _series_of(self, name: str, description: str, labels: dict, gauge: bool = False) -> _Series:
        """The one series of a new family."""
        return _Series(self.family(name, description, gauge).Metric(labels=labels), gauge)

    def update(self, model) -> None:
        """Gauges from a serving model's state (DraftModel or VerifyModel; or the fused
        orchestrator, whose ``sequences`` and ``kv_bytes`` cover its models), read now."""
        active, kv_bytes = len(model.sequences), model.kv_bytes()
        with self.lock:
            self._active.value, self._kv_bytes.value = active, kv_bytes
        self.changed()

    def reclaimed(self, n: int) -> None:
        with self.lock:
            self._reclaimed.value += n
        self.changed()

    def changed(self) -> None:
        """Note a change for the pusher (started by the first one)."""
        if self._pusher is None:
            with self.lock:
                if self._pusher is None:
                    self._pusher = threading.Thread(target=self._push_loop, daemon=True, name="metrics")
                    self._pusher.start()
        self._changed.set()

    def _push_loop(self) -> None:
        while True:
            self._changed.wait()
            self._changed.clear()
            try:
                self.push()
            except Exception as e:  # noqa: BLE001 - a metric that cannot be pushed must not end the pushing
                self._pb.Logger.log_warn(f"metrics could not be pushed: {e}")
            time.sleep(self.push_seconds)

    def push(self) -> None:
        """Hand every series that changed since the last push to Triton's metrics."""
        with self.lock:
            due = [(s, s.value, s.value - s.pushed) for s in self._series if s.value != s.pushed]
            for series, value, _ in due:
                series.pushed = value
        for series, value, delta in due:   # round trips: not under the lock the writers take
            if series.gauge:
                series.metric.set(value)
            else:
                series.metric.increment(delta)


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
                    metrics.reclaimed(n)
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
        # The step's own drafting and verification, as its stats count them: a scheduler's step
        # may have run ahead, before it was asked for, so the wall time of this call is no measure.
        stats = self.inner.stats
        before = stats.ssm_seconds + stats.llm_seconds
        path, bonus = self.inner.step(root, budget)
        self.metrics.step_seconds.observe(stats.ssm_seconds + stats.llm_seconds - before)
        self.metrics.accepted.observe(len(path))   # accepted speculation + bonus
        return path, bonus

    def release(self) -> None:
        try:
            self.inner.release()
        finally:
            self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.update(self.models)
