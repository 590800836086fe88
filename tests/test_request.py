"""Reading a generation request: every field checked against its range, long texts refused before
they are tokenized, and each failure answered with the right Triton error code (no server)."""
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import VOCAB, make_tokenizer
from specinfer.errors import RequestError, SpecInferError
from specinfer.serving import triton_glue as glue
from specinfer.serving.orchestrator import merge_responses
from specinfer.serving.request import MAX_SEED, longest_token_bytes, read_request, sampling_from
from specinfer.text import load_tokenizer

CONTEXT = 256


def ids(*values):
    return np.asarray(values, dtype=np.int64)


def one(value, dtype):
    return np.array([value], dtype=dtype)


def text(s) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=object)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder)
    return load_tokenizer(folder)


class Counting:
    """A tokenizer that counts its encode calls."""

    def __init__(self, inner):
        self.inner, self.encodes = inner, 0

    def get_vocab(self, with_added_tokens: bool = True):
        return self.inner.get_vocab(with_added_tokens=with_added_tokens)

    def encode(self, s):
        self.encodes += 1
        return self.inner.encode(s)


PROMPT = {"input_ids": ids(1, 2)}


@pytest.mark.parametrize("extra, message", [
    ({"max_tokens": one(0, np.int32)}, "'max_tokens' must be in 1..256"),
    ({"max_tokens": one(257, np.int32)}, "'max_tokens' must be in 1..256"),
    ({"max_tokens": one(4294967304, np.int64)}, "'max_tokens' must be in 1..256"),
    ({"temperature": one(-1, np.float32)}, "temperature must be >= 0 and finite, got -1.0"),
    ({"temperature": one(np.inf, np.float32)}, "temperature must be >= 0 and finite, got inf"),  # a JSON 1e39
    ({"temperature": one(np.nan, np.float32)}, "temperature must be >= 0 and finite, got nan"),
    ({"top_k": one(-1, np.int32)}, "'top_k' must be in 0..320"),
    ({"top_k": one(VOCAB + 1, np.int32)}, "'top_k' must be in 0..320"),
    ({"top_p": one(0, np.float32)}, "top_p must be in (0, 1]"),
    ({"top_p": one(1.5, np.float32)}, "top_p must be in (0, 1]"),
    ({"top_p": one(np.nan, np.float32)}, "top_p must be in (0, 1]"),
    ({"end_id": one(-1, np.int32)}, "'end_id' must be in 0..319"),
    ({"end_id": one(VOCAB, np.int32)}, "'end_id' must be in 0..319"),
    ({"random_seed": one(2**64 - 1, np.uint64)}, f"'random_seed' must be in 0..{MAX_SEED}, got {2**64 - 1}"),
    ({"random_seed": one(-1, np.int64)}, f"'random_seed' must be in 0..{MAX_SEED}, got -1"),
    ({"stop_words": np.array([b"w"] * 17, object)}, "'stop_words' holds 17 words; at most 16"),
    ({"stop_words": np.array([b"ok", b"x" * 257], object)}, "'stop_words' word 1 is 257 bytes; at most 256"),
    ({"tree": text("1," * 64 + "1")}, "'tree' may have at most 64 depths"),
    ({"tree": text("1,257")}, "widths in 1..256, got 2 depths, widest 257"),
    ({"tree": text("1" * 300)}, "'tree' is 300 bytes; at most 256"),
    ({"tree": np.array([b"1", b"2"], object)}, "'tree' must hold one string"),
    ({"tree": text("1,0")}, "tree widths must all be >= 1"),
    ({"input_ids": ids(1, -1)}, "'input_ids' must be token ids in 0..319, got -1"),
    ({"input_ids": ids(1, VOCAB)}, "'input_ids' must be token ids in 0..319, got 320"),
])
def test_every_field_is_checked_against_its_range(extra, message):
    with pytest.raises(RequestError) as e:
        read_request(PROMPT | extra, CONTEXT, vocab_size=VOCAB)
    assert message in str(e.value)


def test_values_at_the_ends_of_their_ranges_are_accepted():
    request = read_request(PROMPT | {
        "max_tokens": one(CONTEXT, np.int32), "temperature": one(3.0e38, np.float32), "top_k": one(VOCAB, np.int32),
        "top_p": one(1.0, np.float32), "end_id": one(VOCAB - 1, np.int32), "random_seed": one(MAX_SEED, np.uint64),
        "stop_words": np.array([b"x" * 256] * 16, object), "tree": text(",".join(["256"] * 64)),
        "input_ids": ids(0, VOCAB - 1)}, CONTEXT, vocab_size=VOCAB)
    assert (request.max_tokens, request.params.top_k, request.end_id, request.params.seed) == \
        (CONTEXT, VOCAB, VOCAB - 1, MAX_SEED)
    assert len(request.stop_words) == 16 and request.prompt == [0, VOCAB - 1]


def test_without_a_vocabulary_only_the_lower_ends_are_checked():
    request = read_request(PROMPT | {"end_id": one(10**6, np.int32), "top_k": one(10**6, np.int32)}, CONTEXT)
    assert (request.end_id, request.params.top_k) == (10**6, 10**6)
    with pytest.raises(RequestError, match="'top_k' must be >= 0"):
        read_request(PROMPT | {"top_k": one(-1, np.int32)}, CONTEXT)


@pytest.mark.parametrize("extra, message", [
    ({"random_seed": one(2**64 - 1, np.uint64)}, "'random_seed' must be in 0.."),
    ({"temperature": one(np.inf, np.float32)}, "temperature must be >= 0 and finite"),
    ({"top_k": one(VOCAB + 1, np.int32)}, "'top_k' must be in 0..320"),
])
def test_the_internal_models_check_sampling_parameters_the_same_way(extra, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(")):
        sampling_from(extra, VOCAB)


@pytest.mark.parametrize("inputs, message", [
    ({}, "missing input 'text_input'"),
    ({"text_input": text("")}, "'text_input' is empty"),
    ({"text_input": text(b"ab\xc3")}, "'text_input' is not valid UTF-8"),
    ({"text_input": np.array([b"a", b"b"], object)}, "'text_input' must hold one string"),
    ({"text_input": text("x " * 600)}, "the prompt has"),
])
def test_text_input_errors_name_it(tokenizer, inputs, message):
    with pytest.raises(RequestError, match=message):
        read_request(inputs, CONTEXT, tokenizer=tokenizer, vocab_size=VOCAB)


def test_text_input_is_tokenized(tokenizer):
    request = read_request({"text_input": text("def f(x):")}, CONTEXT, tokenizer=tokenizer, vocab_size=VOCAB)
    assert request.prompt == tokenizer.encode("def f(x):").ids
    # without text_input, the ids the client sent
    assert read_request(PROMPT, CONTEXT, tokenizer=tokenizer).prompt == [1, 2]


def test_a_text_too_long_to_fit_is_refused_before_it_is_tokenized(tokenizer):
    counting = Counting(tokenizer)
    limit = CONTEXT * longest_token_bytes(tokenizer)
    huge = "x" * 10_000_000
    with pytest.raises(RequestError) as e:
        read_request({"text_input": text(huge)}, CONTEXT, tokenizer=counting)
    assert str(e.value) == (f"'text_input' is 10000000 bytes; at most {limit} bytes can fit the context "
                            f"of {CONTEXT} tokens")
    assert counting.encodes == 0
    # A text at the cap is tokenized (it cannot fit either: the prompt-length check says so).
    with pytest.raises(RequestError, match=f"the prompt has .* tokens; the context holds {CONTEXT}"):
        read_request({"text_input": text("é" * (limit // 2))}, CONTEXT, tokenizer=counting)
    assert counting.encodes == 1


def test_the_byte_cap_never_refuses_a_text_that_fits(tokenizer):
    """Each token stands for at most L bytes, so a text of B bytes has at least B / L tokens."""
    longest = longest_token_bytes(tokenizer)
    assert longest == max(len(t.encode()) for t in tokenizer.get_vocab(with_added_tokens=True))
    for s in ["    def wrap(self, text):\n" * 20, "naïve café – π ≈ 3.14 🐍" * 10, "<s></s><pad>" * 30,
              " " * 500]:
        assert len(tokenizer.encode(s).ids) * longest >= len(s.encode())


def test_the_longest_token_is_measured_once_per_tokenizer(tokenizer):
    class Vocab(Counting):
        def get_vocab(self, with_added_tokens: bool = True):
            self.encodes += 1
            return super().get_vocab(with_added_tokens)
    t = Vocab(tokenizer)
    assert longest_token_bytes(t) == longest_token_bytes(t) == longest_token_bytes(tokenizer)
    assert t.encodes == 1


def test_existing_callers_still_catch_spec_infer_error():
    with pytest.raises(SpecInferError):
        read_request({}, CONTEXT)


# --- error codes -------------------------------------------------------------------------------------
class TritonError:
    """What the Python backend's TritonError offers: a message and a code (INTERNAL by default)."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE = range(5)

    def __init__(self, message: str, code: int = INTERNAL):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class Request(dict):
    """A request of the stub: its input tensors by name."""

    def inputs(self):
        return list(self.values())


class Response:
    def __init__(self, output_tensors=(), error=None):
        self.tensors, self._error = list(output_tensors), error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self):
        return self._error

    def output_tensors(self):
        return self.tensors


class Recorded:
    """A metric that records what it is given, and from which thread."""

    def __init__(self):
        self.values: list = []

    def observe(self, value):
        self.values.append((value, threading.current_thread().name))

    set = increment = observe


class MetricFamily:
    GAUGE, COUNTER, HISTOGRAM = range(3)

    def __init__(self, name, description, kind):
        pass

    def Metric(self, labels, buckets=None):  # noqa: N802 - the backend's name
        return Recorded()


def fake_pb(answer: Response | None = None):
    """A stand-in for triton_python_backend_utils: responses, errors, a logger, BLS answering ``answer``."""
    logged: list[str] = []
    sent: list[dict] = []   # the BLS requests' arguments
    return SimpleNamespace(
        TritonError=TritonError, Tensor=Tensor, InferenceResponse=Response, logged=logged, sent=sent,
        Logger=SimpleNamespace(log_error=logged.append, log_warn=logged.append), TRITONSERVER_RESPONSE_COMPLETE_FINAL=2,
        MetricFamily=MetricFamily,
        InferenceRequest=lambda **kwargs: sent.append(kwargs) or SimpleNamespace(exec=lambda: answer))


def test_a_client_mistake_is_invalid_arg_with_its_message():
    pb = fake_pb()
    out = glue.error(pb, RequestError("top_p must be in (0, 1], got 2.0"), "ensemble")
    assert (out.error().code(), out.error().message()) == (TritonError.INVALID_ARG, "top_p must be in (0, 1], got 2.0")
    assert pb.logged == []


def test_a_server_problem_is_internal_and_logged():
    pb = fake_pb()
    out = glue.error(pb, SpecInferError("the dynamic tree needs the LLM's verification cost table"), "ssm_0")
    assert out.error().code() == TritonError.INTERNAL and "verification cost table" in out.error().message()
    assert pb.logged


def test_a_raw_exception_is_internal_without_its_python_text():
    pb = fake_pb()
    try:
        raise KeyError("/secret/path/model.onnx")
    except KeyError as e:
        out = glue.error(pb, e, "llm")
    assert out.error().code() == TritonError.INTERNAL
    assert out.error().message() == "internal error in llm; see the server log"
    assert "KeyError" in pb.logged[0] and "/secret/path/model.onnx" in pb.logged[0] and "Traceback" in pb.logged[0]


def test_handle_answers_each_request_with_the_right_code():
    pb = fake_pb()
    request = Request(top_p=Tensor("top_p", one(2.0, np.float32)))
    bad = glue.handle(pb, request, ["top_p", "temperature"], lambda t: {"top_k": one(sampling_from(t).top_k, np.int32)})
    assert bad.error().code() == TritonError.INVALID_ARG and "top_p must be in (0, 1]" in bad.error().message()
    broken = glue.handle(pb, request, ["top_p"], lambda t: 1 / 0, "tree_builder")
    assert broken.error().message() == "internal error in tree_builder; see the server log"
    good = glue.handle(pb, Request(top_p=Tensor("top_p", one(0.5, np.float32))), ["top_p"], lambda t: {"y": t["top_p"] * 2})
    assert not good.has_error() and good.tensors[0].name() == "y"


def test_handle_batch_fails_a_request_alone_and_times_the_batch():
    """A batched model's execute: each request a batch of one; one whose input is malformed or
    whose work fails gets its error, the others their outputs; the batch's time is observed once."""
    pb, seconds = fake_pb(), Recorded()
    requests = [Request(x=Tensor("x", np.array(x))) for x in ([[1, 2]], [[1], [2]], [[0]], [[5]])]   # 2nd: not a batch of one

    def work(batch):
        return [RequestError("x must not start with 0") if t["x"][0] == 0 else {"y": t["x"] * 2} for t in batch]
    out = glue.handle_batch(pb, requests, ["x"], work, "ssm_0", seconds)
    assert [r.tensors[0].as_numpy().tolist() for r in (out[0], out[3])] == [[[2, 4]], [[10]]]
    assert "a batch of one" in out[1].error().message() and out[2].error().code() == TritonError.INVALID_ARG
    assert len(seconds.values) == 1 and seconds.values[0][0] >= 0


@pytest.mark.parametrize("code, error_class", [(TritonError.INVALID_ARG, RequestError),
                                               (TritonError.INTERNAL, SpecInferError),
                                               (TritonError.UNAVAILABLE, SpecInferError)])
def test_bls_keeps_the_category_of_an_internal_models_error(code, error_class):
    pb = fake_pb(Response(error=TritonError("tree widths must all be >= 1", code)))
    with pytest.raises(SpecInferError) as e:
        glue.bls(pb, "ssm_0", {"tree": text("1,0")})
    assert type(e.value) is error_class and str(e.value) == "ssm_0: tree widths must all be >= 1"
    # ... and the orchestrator answers the client with the same category
    assert glue.error(pb, e.value).error().code() == (TritonError.INVALID_ARG if error_class is RequestError
                                                       else TritonError.INTERNAL)


def relaying_pb(answers: list):
    """fake_pb whose BLS calls are decoupled ones, answered by ``answers`` (a list of responses)."""
    pb = fake_pb()
    pb.InferenceRequest = lambda **kwargs: pb.sent.append(kwargs) or SimpleNamespace(
        exec=lambda decoupled=False: iter(answers) if decoupled else pytest.fail("a decoupled model needs decoupled=True"))
    return pb


def test_relay_answers_a_unary_request_with_the_decoupled_models_responses():
    """ensemble_sync of the fused layout: the request goes to the decoupled ensemble as it came (no
    batch dimension: the orchestrators do not batch), and what comes back is one answer."""
    pb = relaying_pb([Response([Tensor("text_output", text("def")), Tensor("output_ids", ids(1, 2))]),
                      Response([Tensor("text_output", text(" f")), Tensor("output_ids", ids(3))]),
                      Response()])   # the final flag alone
    out = glue.relay(pb, "ensemble", {"text_input": text("x"), "max_tokens": one(4, np.int32)}, merge_responses)
    assert out["text_output"].tolist() == [b"def f"] and out["output_ids"].tolist() == [1, 2, 3]
    assert pb.sent[-1]["model_name"] == "ensemble"
    assert {t.name(): t.as_numpy().shape for t in pb.sent[-1]["inputs"]} == {"text_input": (1,), "max_tokens": (1,)}
    with pytest.raises(SpecInferError, match="ensemble answered nothing"):
        glue.relay(relaying_pb([Response()]), "ensemble", {"text_input": text("x")}, merge_responses)


@pytest.mark.parametrize("message, code", [
    ("the request needs 3.0 MiB of KV cache (9 tokens: prompt, max_tokens and a tree); the server's KV budget "
     "is 1.0 MiB: ask for fewer tokens", TritonError.INVALID_ARG),
    ("the server is busy: no KV memory came free in 30 s; try again later", TritonError.UNAVAILABLE),
    ("the server is stopping: the request ended early", TritonError.UNAVAILABLE),
    ("internal error in ensemble; see the server log", TritonError.INTERNAL)])
def test_relay_keeps_what_a_relayed_error_is(message, code):
    """Triton 2.51 hands a decoupled model's error to BLS as INTERNAL whatever its code: the relay
    knows the refusals that come after its own check of the request by their messages."""
    pb = relaying_pb([Response(error=TritonError(message, TritonError.INTERNAL))])
    with pytest.raises(SpecInferError) as e:
        glue.relay(pb, "ensemble", {"text_input": text("x")}, merge_responses)
    out = glue.error(pb, e.value, "ensemble_sync").error()
    assert (out.code(), out.message()) == (code, message)


def test_bls_sends_and_reads_batches_of_one():
    """The inner models batch (max_batch_size >= 1): a BLS request is a batch of one."""
    pb = fake_pb(Response([Tensor("bonus", np.array([[3]], np.int64))]))
    assert glue.bls(pb, "llm", {"op": text("step")})["bonus"].tolist() == [3]
    assert [t.as_numpy().shape for t in pb.sent[-1]["inputs"]] == [(1, 1)]
    request = Request(op=Tensor("op", np.array([[b"step"]], object)), tokens=Tensor("tokens", np.array([[1, 2]], np.int64)))
    assert {k: v.tolist() for k, v in glue.read(request, ["op", "tokens"], batched=True).items()} == \
        {"op": [b"step"], "tokens": [1, 2]}
    with pytest.raises(RequestError, match="'tokens': a request to this model is a batch of one, got shape \\[2, 1\\]"):
        glue.read(Request(tokens=Tensor("tokens", np.array([[1], [2]], np.int64))), ["tokens"], batched=True)
    assert glue.response(pb, {"bonus": np.array([3])}, batched=True).tensors[0].as_numpy().shape == (1, 1)


# --- streamed responses ------------------------------------------------------------------------------
class StreamedRequest:
    """A request whose response sender records what it is sent (or fails: the client is gone), and
    whose client may cancel."""

    def __init__(self, fail: bool = False):
        self.sent: list[tuple[Response, int]] = []
        self.cancel, self.fail = False, fail
        self.asked = 0   # is_cancelled calls: each a round trip to the server process

    def get_response_sender(self):
        return SimpleNamespace(send=self._send)

    def _send(self, response, flags=0):
        if self.fail:
            raise RuntimeError("the stream is closed")
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancel


def piece(txt: str, token_ids: list[int], steps: str = "") -> dict:
    return {"text_output": text(txt), "output_ids": np.asarray(token_ids, np.int64),
            "accepted_tokens_per_step": text(steps)}


def until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def outputs(response: Response) -> dict:
    return {t.name(): t.as_numpy().tolist() for t in response.tensors}


def test_pieces_that_wait_out_the_interval_go_out_as_one_and_the_final_at_once():
    pb, request = fake_pb(), StreamedRequest()
    stream = glue.ResponseStream(pb, request, merge_responses, "ensemble", interval=30.0)
    stream.send(piece("de", [1]))             # nothing sent yet: out at once
    until(lambda: len(request.sent) == 1)
    stream.send(piece("f ", [2]))
    stream.send(piece("x(", [3, 4]))
    time.sleep(0.2)
    assert len(request.sent) == 1             # within the interval: they wait
    stream.send(piece(")", [5], steps="1,2,2"), final=True)
    until(lambda: len(request.sent) == 2)     # the final does not wait for the interval
    (first, flags0), (rest, flags1) = request.sent
    assert outputs(first) == {"text_output": [b"de"], "output_ids": [1], "accepted_tokens_per_step": [b""]}
    assert outputs(rest) == {"text_output": [b"f x()"], "output_ids": [2, 3, 4, 5], "accepted_tokens_per_step": [b"1,2,2"]}
    assert (flags0, flags1) == (0, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def test_an_error_goes_out_alone_after_the_pieces_before_it():
    pb, request = fake_pb(), StreamedRequest()
    stream = glue.ResponseStream(pb, request, merge_responses, "ensemble", interval=30.0)
    stream.send(piece("a", [1]))
    until(lambda: len(request.sent) == 1)
    stream.send(piece("b", [2]))
    stream.fail(RequestError("stop_words: too many"))
    until(lambda: len(request.sent) == 3)
    (_, _), (data, flags1), (err, flags2) = request.sent
    assert outputs(data)["output_ids"] == [2] and flags1 == 0 and not data.has_error()
    assert err.error().code() == TritonError.INVALID_ARG and err.error().message() == "stop_words: too many"
    assert flags2 == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def test_a_cancel_is_seen_between_sends_and_a_failed_send_ends_the_request():
    pb, request = fake_pb(), StreamedRequest()
    stream = glue.ResponseStream(pb, request, merge_responses, "ensemble", poll_seconds=0.01)
    time.sleep(0.05)
    assert not stream.cancelled
    request.cancel = True                     # no response is due: the cancel is still asked for
    until(lambda: stream.cancelled)
    gone = StreamedRequest(fail=True)
    stream = glue.ResponseStream(pb, gone, merge_responses, "ensemble")
    stream.send(piece("a", [1]))
    until(lambda: stream.cancelled)
    assert "a response could not be sent" in pb.logged[-1]


def test_a_cancel_is_asked_every_poll_seconds_not_after_every_send():
    pb, request = fake_pb(), StreamedRequest()
    stream = glue.ResponseStream(pb, request, merge_responses, "ensemble", interval=0.0, poll_seconds=2.0)
    for i in range(20):                       # each sent alone, well within the 2 s
        stream.send(piece("a", [i]))
        until(lambda: sum(len(outputs(r)["output_ids"]) for r, _ in request.sent) == i + 1)
    assert len(request.sent) == 20 and request.asked <= 1
    until(lambda: request.asked > 0)          # due: asked without a response to send


def test_workers_keep_their_threads_run_tasks_at_once_and_end_when_idle():
    """A task runs at once on an idle thread or a new one; threads outlive their tasks (and a
    failing task), and end once idle for idle_seconds."""
    workers = glue.Workers(idle_seconds=0.3, name="t")
    ran = []

    def task(i):
        ran.append((i, threading.get_ident()))
    for i in range(5):   # one after another: one thread does them all
        workers.submit(task, i)
        until(lambda: len(ran) == i + 1)
    assert [i for i, _ in ran] == list(range(5)) and len({t for _, t in ran}) == 1 and workers.threads == 1
    gate, started = threading.Event(), []

    def blocked(i):   # three at once: each has a thread of its own, none waits for another
        started.append(threading.get_ident())
        gate.wait(10)
    for i in range(3):
        workers.submit(blocked, i)
    until(lambda: len(started) == 3)
    assert len(set(started)) == 3 and workers.threads == 3
    gate.set()
    until(lambda: workers._idle == 3)
    workers.submit(lambda: 1 / 0)   # logged; its thread goes on
    until(lambda: workers._idle == 3)
    workers.submit(task, 5)
    until(lambda: len(ran) == 6)
    assert ran[-1][1] in set(started) | {ran[0][1]} and workers.threads == 3
    until(lambda: workers.threads == 0, 10)   # idle for 0.3 s: every thread ended
    workers.submit(task, 6)   # and a new one starts for the next task
    until(lambda: len(ran) == 7)
    assert workers.threads == 1


def pushed(series) -> float:
    """What Triton's metric of ``series`` holds: its last set (a gauge) or its increments' sum."""
    calls = series.metric.values
    return (calls[-1][0] if calls else 0.0) if series.gauge else sum(v for v, _ in calls)


def test_metrics_reach_triton_from_the_pusher_alone_as_a_histograms_series():
    """Metrics written from many threads are kept in process; the pusher hands Triton a histogram's
    cumulative buckets, sum and count as counters, the gauges' last values, and nothing unchanged."""
    metrics = glue.Metrics(fake_pb(), "ensemble_fused", push_seconds=0.01)
    model = SimpleNamespace(sequences=["a", "b"], kv_bytes=lambda: 4096)
    writers = [threading.Thread(target=metrics.accepted.observe, args=(v,)) for v in (1, 3, 3, 7, 20)]
    writers.append(threading.Thread(target=metrics.update, args=(model,)))
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    model.sequences = []   # changed after the update read it: not what the gauge reports
    until(lambda: pushed(metrics.accepted.series[-1]) == 5 and pushed(metrics._kv_bytes) == 4096)
    assert [pushed(s) for s in metrics.accepted.series] == [1, 1, 3, 3, 3, 3, 4, 4, 4, 4, 5, 34, 5]
    assert [pushed(s) for s in (metrics._active, metrics._kv_bytes, metrics.step_seconds.series[-1])] == [2, 4096, 0]
    calls = [c for s in metrics._series for c in s.metric.values]
    assert {thread for _, thread in calls} == {"metrics"}
    metrics.push()   # nothing new: no round trip
    assert len([c for s in metrics._series for c in s.metric.values]) == len(calls)
    metrics.update(model)
    metrics.reclaimed(2)
    until(lambda: pushed(metrics._active) == 0 and pushed(metrics._reclaimed) == 2)
