"""Generated requests against the real server, over every request field and both protocols.

The rule: every request is answered, with a result or with a client error (HTTP 4xx, gRPC
INVALID_ARGUMENT) whose message is ours (no internal error, no Python exception), and the server
stays up. Valid values are kept small (max_tokens <= 4) so that a hundred requests take seconds.
"""
import json
from collections import Counter
import urllib.error
import urllib.request

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = 120
INTS = st.one_of(st.integers(-3, 10), st.integers(-2**70, 2**70), st.sampled_from([2**31, 2**32 + 8, 2**63, 2**64 - 1]))
FLOATS = st.one_of(st.floats(-2, 3), st.floats(allow_nan=False), st.sampled_from([1e39, -1e39, 1e-45]))
ANY_JSON = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=8),
                     st.lists(st.text(max_size=4), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
# Each field: a valid value (three times in four) or anything JSON can carry; text_input always
# sent (absent, the request is refused before the others are looked at).
VALID = {
    "text_input": st.sampled_from(["def f(x):", "import os\n", "x = [", "# a"]),
    "max_tokens": st.integers(1, 4),
    "stream": st.booleans(),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_k": st.integers(0, 5),
    "top_p": st.sampled_from([1.0, 0.9]),
    "random_seed": st.integers(0, 2**63 - 1),
    "end_id": st.integers(0, 300),
    "stop_words": st.lists(st.text(min_size=1, max_size=6), max_size=3),
    "exclude_input_in_output": st.booleans(),
    "tree": st.sampled_from(["dynamic", "2,1", "1,1,1"]),
    "rule": st.sampled_from(["mss", "traversal", "naive"]),
}
FIELDS = {  # what else a client may send: out of range, wrong, or odd
    "text_input": st.one_of(st.text(max_size=40), st.sampled_from(["", "x " * 400])),
    "max_tokens": INTS,
    "stream": st.booleans(),
    "temperature": FLOATS,
    "top_k": INTS,
    "top_p": FLOATS,
    "random_seed": INTS,
    "end_id": INTS,
    "stop_words": st.one_of(st.lists(st.text(max_size=6), max_size=20), st.text(max_size=6)),
    "exclude_input_in_output": st.booleans(),
    "tree": st.one_of(st.sampled_from(["0", "1,x", "9" * 30]), st.text(max_size=8)),
    "rule": st.text(max_size=12),
}
_field = lambda k: st.one_of(VALID[k], FIELDS[k], ANY_JSON)
# Valid requests, and requests where any field may be anything: both outcomes are reached.
REQUESTS = st.one_of(
    st.fixed_dictionaries({"text_input": VALID["text_input"]},
                          optional={k: VALID[k] for k in VALID if k != "text_input"}),
    st.fixed_dictionaries({}, optional={k: _field(k) for k in FIELDS}))
SLOW = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _alive(server) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def _ours(message: str) -> bool:
    """A client error that names a problem: not an internal error, not a raw Python exception."""
    return bool(message) and "internal error" not in message and "Traceback" not in message \
        and not any(f"{e}:" in message for e in ("IndexError", "OverflowError", "KeyError", "TypeError", "ValueError"))


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_generated_http_requests_get_a_result_or_a_named_client_error(triton_server, endpoint):
    seen = {"ok": 0, "refused": 0}

    @SLOW
    @given(body=REQUESTS)
    def one(body):
        data = json.dumps(body).encode()   # non-finite floats become NaN/Infinity: not JSON, refused too
        request = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/ensemble/{endpoint}", data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        if status == 200:
            events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")] \
                if endpoint == "generate_stream" else [json.loads(text)]
            errors = [e["error"] for e in events if "error" in e]
            # a stream may carry its error as an event: the same rule holds for it
            assert all(_ours(e) for e in errors), errors
            assert errors or "text_output" in events[-1], text[:300]
            seen["refused" if errors else "ok"] += 1
        else:
            assert 400 <= status < 500, (status, body, text[:300])
            # /generate_stream answers an error before its first event as an event too
            error = json.loads(text[5:] if text.startswith("data:") else text)["error"]
            assert _ours(error), text[:300]
            seen["refused"] += 1
        assert _alive(triton_server), body
    one()
    assert seen["ok"] > 5 and seen["refused"] > 5, seen   # the strategies reach both outcomes


GRPC_KINDS = {"BYTES": object, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
              "BOOL": np.bool_}
DECLARED = {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_k": "INT32",
            "top_p": "FP32", "random_seed": "UINT64", "end_id": "INT32", "stop_words": "BYTES",
            "exclude_input_in_output": "BOOL", "tree": "BYTES", "rule": "BYTES"}


@st.composite
def grpc_tensors(draw):
    """Each field absent, or a tensor: of its declared type and shape in half the requests (so that
    many reach our checks and some succeed), else mostly so, and of any type and shape otherwise."""
    tensors = {}
    all_declared = draw(st.booleans())
    for name in FIELDS:
        if not draw(st.sampled_from([True, True, True, False] if name == "text_input" else [True, False, False])):
            continue
        declared = all_declared or draw(st.sampled_from([True, True, True, False]))
        kind = DECLARED[name] if declared else draw(st.sampled_from(list(GRPC_KINDS)))
        shape = [1] if declared and name != "stop_words" else draw(st.sampled_from([[1], [2], [0], [1, 1]]))
        n = int(np.prod(shape))
        if kind == "BYTES":
            value = np.array([draw(st.binary(max_size=12)) if not declared else str(draw(_field(name))).encode()
                              for _ in range(n)], dtype=object)
        elif kind == "BOOL":
            value = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_)
        elif kind == "FP32":
            floats = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(width=32))
            value = np.array(draw(st.lists(floats, min_size=n, max_size=n)), dtype=np.float32)
        else:
            info = np.iinfo(GRPC_KINDS[kind])
            valid = VALID[name] if declared and isinstance(draw(VALID[name]), int) else st.integers(1, 4)
            value = np.array(draw(st.lists(st.one_of(valid, valid, st.integers(int(info.min), int(info.max))),
                                           min_size=n, max_size=n)), dtype=GRPC_KINDS[kind])
        tensors[name] = (kind, value.reshape(shape))
    return tensors


def test_generated_grpc_requests_get_a_result_or_invalid_argument(triton_server):
    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    seen = {"ok": 0, "refused": 0}
    messages = Counter()

    @SLOW
    @given(tensors=grpc_tensors())
    def one(tensors):
        inputs = []
        for name, (kind, value) in tensors.items():
            t = grpcclient.InferInput(name, list(value.shape), kind)
            t.set_data_from_numpy(value)
            inputs.append(t)
        try:
            result = client.infer("ensemble_sync", inputs, client_timeout=120)
            assert result.as_numpy("text_output") is not None
            seen["ok"] += 1
        except InferenceServerException as e:
            assert e.status() == str(grpc.StatusCode.INVALID_ARGUMENT), (e.status(), e.message(), tensors)
            assert _ours(e.message()), e.message()
            seen["refused"] += 1
            messages[e.message()[:120]] += 1
        assert _alive(triton_server)
    one()
    assert seen["ok"] > 5 and seen["refused"] > 5, (seen, messages.most_common(5))


def test_the_strategies_cover_every_request_field():
    """Every input of the client-facing models is generated (a new input must be added here)."""
    from specinfer.serving.repository import templates_dir
    config = (templates_dir() / "orchestrator" / "config.pbtxt.in").read_text()
    inputs = {line.split('"')[1] for line in config.splitlines() if line.strip().startswith("{ name:")} - {
        "text_output", "output_ids", "accepted_tokens_per_step", "total_draft_tokens", "total_accepted_draft_tokens"}
    assert inputs == set(FIELDS)
