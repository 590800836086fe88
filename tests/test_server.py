"""A real tritonserver on 127.0.0.1 (started once per session by the `triton_server` fixture)."""
import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from specinfer import Pipeline

PROMPTS = ["def f(x):", "import os\n", "class A:", "for i in range(10):", "x = [", "while True:", "# a", "return"]
N = 24


@pytest.fixture(scope="module")
def expected(served_pair):
    """In-process greedy generation with the same models: what every protocol must return."""
    pipe = Pipeline(served_pair["llm"], ssms=served_pair["ssms"], tree="1,1,3,1,1,1")
    return {p: pipe.generate(p, N) for p in PROMPTS}


def post(server, path, body, timeout=120):
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def generate(server, model="ensemble", **body):
    status, text = post(server, f"/v2/models/{model}/generate", {"max_tokens": N, "exclude_input_in_output": True} | body)
    return status, json.loads(text)


def sse(server, model="ensemble", **body):
    status, text = post(server, f"/v2/models/{model}/generate_stream",
                        {"max_tokens": N, "exclude_input_in_output": True, "stream": True} | body)
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def grpc_stream(server, prompt, model="ensemble", cancel_after=None, on_cancel=lambda: None, **extra):
    """Text pieces of a gRPC bidirectional stream (optionally cancelled after a few responses,
    calling ``on_cancel`` just before)."""
    import tritonclient.grpc as grpcclient
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = {"text_input": np.array([prompt.encode()], dtype=object), "max_tokens": np.array([N], np.int32),
              "stream": np.array([True]), "exclude_input_in_output": np.array([True])} | extra
    tensors = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, list(value.shape), {"O": "BYTES", "i": "INT32", "b": "BOOL", "f": "FP32"}[value.dtype.kind])
        t.set_data_from_numpy(value)
        tensors.append(t)
    client.async_stream_infer(model, tensors, enable_empty_final_response=True)
    pieces = []
    while True:
        result, error = results.get(timeout=120)
        if error is not None:
            raise RuntimeError(str(error))
        out = result.as_numpy("text_output")
        if out is not None:
            pieces.append(out[0].decode())
        if cancel_after is not None and len(pieces) >= cancel_after:
            on_cancel()
            client.stop_stream(cancel_requests=True)
            return pieces
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    return pieces


def metric(server, name, model):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    m = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.parametrize("model", ["ensemble", "ensemble_fused"])
def test_http_generate_and_stream_equal_in_process(triton_server, expected, model):
    for prompt in PROMPTS[:4]:
        status, body = generate(triton_server, model, text_input=prompt)
        assert status == 200, body
        assert body["text_output"] == expected[prompt]
        steps = [int(s) for s in body["accepted_tokens_per_step"].split(",")]
        assert body["total_draft_tokens"] > 0 and sum(steps) <= N
        events = sse(triton_server, model, text_input=prompt)
        assert "".join(e.get("text_output", "") for e in events) == expected[prompt]
        assert not any("error" in e for e in events)


@pytest.mark.parametrize("model", ["ensemble", "ensemble_fused"])
def test_dynamic_tree_with_lookup_equals_in_process(triton_server, expected, model):
    """The dynamic tree, drafted by the SSMs and by the `lookup` draft model (or, fused, in process)."""
    assert (triton_server.repository / "lookup" / "config.pbtxt").is_file()
    for prompt in PROMPTS[:4]:
        status, body = generate(triton_server, model, text_input=prompt, tree="dynamic")
        assert status == 200, body
        assert body["text_output"] == expected[prompt]


def test_http_and_grpc_infer_equal_in_process(triton_server, expected):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    for module, url in ((httpclient, triton_server.http_url), (grpcclient, triton_server.grpc_url)):
        client = module.InferenceServerClient(url)
        for prompt in PROMPTS[:3]:
            inputs = []
            for name, value, kind in (("text_input", np.array([prompt.encode()], dtype=object), "BYTES"),
                                      ("max_tokens", np.array([N], np.int32), "INT32"),
                                      ("exclude_input_in_output", np.array([True]), "BOOL")):
                t = module.InferInput(name, list(value.shape), kind)
                t.set_data_from_numpy(value)
                inputs.append(t)
            result = client.infer("ensemble_sync", inputs)
            assert result.as_numpy("text_output")[0].decode() == expected[prompt]


@pytest.mark.parametrize("model", ["ensemble", "ensemble_fused"])
def test_grpc_streaming_equals_in_process(triton_server, expected, model):
    pieces = grpc_stream(triton_server, PROMPTS[0], model)
    assert len(pieces) > 1 and "".join(pieces) == expected[PROMPTS[0]]


def test_eight_concurrent_streams_are_all_exact(triton_server, expected):
    results, errors = {}, []

    def worker(prompt):
        try:
            results[prompt] = "".join(grpc_stream(triton_server, prompt))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and results == expected


@pytest.mark.parametrize("body, message", [
    ({}, "text_input"),
    ({"text_input": ""}, "'text_input' is empty"),
    ({"text_input": "x " * 600}, "the prompt has"),
    ({"text_input": "hi", "max_tokens": 0}, "'max_tokens' must be in 1..256"),
    ({"text_input": "hi", "max_tokens": 10**9}, "'max_tokens' must be in 1..256"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature must be >= 0"),
    ({"text_input": "hi", "top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"text_input": ["a", "b"]}, "text_input"),
    ({"text_input": "hi", "tree": "1,x"}, "a tree is 'dynamic' or comma-separated widths"),
])
def test_bad_requests_get_errors_and_the_server_keeps_serving(triton_server, expected, body, message):
    status, text = post(triton_server, "/v2/models/ensemble/generate", body)
    assert status >= 400 and message in json.loads(text)["error"]
    status, good = generate(triton_server, text_input=PROMPTS[1])
    assert status == 200 and good["text_output"] == expected[PROMPTS[1]]


def test_wrong_dtype_and_shape_are_named(triton_server, expected):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    client = httpclient.InferenceServerClient(triton_server.http_url)

    def infer(**tensors):
        inputs = []
        for name, (value, kind) in tensors.items():
            t = httpclient.InferInput(name, list(value.shape), kind)
            t.set_data_from_numpy(value)
            inputs.append(t)
        return client.infer("ensemble_sync", inputs)
    text = (np.array([b"hi"], dtype=object), "BYTES")
    with pytest.raises(InferenceServerException, match="max_tokens"):
        infer(text_input=text, max_tokens=(np.array([3.0], np.float32), "FP32"))
    with pytest.raises(InferenceServerException, match="max_tokens"):
        infer(text_input=text, max_tokens=(np.array([[3, 4]], np.int32), "INT32"))
    assert generate(triton_server, text_input=PROMPTS[2])[1]["text_output"] == expected[PROMPTS[2]]


def test_invalid_utf8_and_unknown_model(triton_server, expected):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([b"caf\xc3"], dtype=object))
    with pytest.raises(InferenceServerException, match="not valid UTF-8"):
        client.infer("ensemble_sync", [t])
    with pytest.raises(InferenceServerException, match="nosuchmodel"):
        client.infer("nosuchmodel", [t])
    assert generate(triton_server, text_input=PROMPTS[2])[1]["text_output"] == expected[PROMPTS[2]]


def test_a_long_unary_request_does_not_hold_up_a_short_one(triton_server, expected):
    """ensemble_sync (unary infer) answers each request from a thread of its own."""
    done = []

    def long_request():
        status, _ = post(triton_server, "/v2/models/ensemble_sync/generate", {"text_input": PROMPTS[5], "max_tokens": 200})
        done.append(("long", status))
    runner = threading.Thread(target=long_request)
    runner.start()
    deadline = time.monotonic() + 60
    while not metric(triton_server, "specinfer_active_sequences", "llm") and time.monotonic() < deadline:
        time.sleep(0.01)
    status, body = generate(triton_server, "ensemble_sync", text_input=PROMPTS[1])
    done.append(("short", status))
    runner.join(timeout=300)
    assert done == [("short", 200), ("long", 200)] and body["text_output"] == expected[PROMPTS[1]]


def test_the_metrics_page_is_prometheus_text_and_its_histograms_add_up(triton_server):
    """The metrics port's page as a Prometheus server scrapes it (the text exposition format),
    parsed by the Prometheus client library's parser: every family parses, and each model's
    histogram series are a histogram's: buckets cumulative in ``le`` up to +Inf, the +Inf bucket
    equal to ``_count`` (positive, with a positive ``_sum``, for the model this test's request went
    through); the gauges are never negative."""
    import math

    parser = pytest.importorskip("prometheus_client.parser")
    assert generate(triton_server, "ensemble_fused", text_input=PROMPTS[0])[0] == 200
    deadline, last = time.monotonic() + 10, None
    while True:
        text = urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode()
        samples: dict[str, list] = {}
        for family in parser.text_string_to_metric_families(text):
            for sample in family.samples:   # (the parser names counter samples with _total)
                samples.setdefault(sample.name.removesuffix("_total"), []).append(sample)
        fused = [s for s in samples.get("specinfer_step_seconds_count", []) if s.labels["model"] == "ensemble_fused"]
        # The models push their series from a thread of their own, one series a round trip, so a
        # page scraped during a push may have a histogram's +Inf bucket a step ahead of its _count:
        # the page is read once ours is pushed and two scrapes 0.2 s apart agree.
        ours = [line for line in text.splitlines() if line.startswith("specinfer_")]
        if (fused and fused[0].value > 0 and ours == last) or time.monotonic() > deadline:
            break
        last = ours
        time.sleep(0.2)
    for name in ("specinfer_step_seconds", "specinfer_accepted_tokens_per_step"):
        models = {s.labels["model"] for s in samples[f"{name}_count"]}
        assert "ensemble_fused" in models, models
        for model in models:
            of = lambda series: [s for s in samples[f"{name}{series}"] if s.labels["model"] == model]
            buckets = sorted((float(s.labels["le"]), s.value) for s in of("_bucket"))
            counts = [value for _, value in buckets]
            assert buckets[-1][0] == math.inf and counts == sorted(counts), (model, buckets)
            assert counts[-1] == of("_count")[0].value and of("_sum")[0].value >= 0, model
            if model == "ensemble_fused":   # the model this test's request went through
                assert counts[-1] > 0 and of("_sum")[0].value > 0
    for gauge in ("specinfer_active_sequences", "specinfer_kv_bytes"):
        assert samples[gauge] and all(s.value >= 0 for s in samples[gauge])


def tokens_emitted(server, model):
    """Tokens the model's verification steps have emitted (the sum of its accepted-tokens histogram)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    total = re.search(rf'^specinfer_accepted_tokens_per_step_sum{{model="{model}"}} (\S+)$', text, re.M)
    return float(total.group(1)) if total else 0.0


def drop_http_stream(server, model, prompt, max_tokens, on_cancel=lambda: None):
    """Open /generate_stream (sampled, on the wide fixed tree of the cancel test), read the first
    event, and drop the connection (calling ``on_cancel`` just before)."""
    import http.client
    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(
        {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "tree": "4,4,4", "temperature": 1.0}),
        {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    while not response.fp.readline().startswith(b"data:"):
        pass
    on_cancel()
    conn.sock.shutdown(2)
    conn.close()
    return ["dropped"]


@pytest.mark.parametrize("model, how", [("ensemble", "grpc"), ("ensemble_fused", "grpc"), ("ensemble", "http")])
def test_a_cancel_frees_the_sequences_at_once_and_others_finish(triton_server, expected, model, how):
    """A cancelled stream (gRPC cancel, or a dropped /generate_stream connection) ends its loop
    within a step or so: its sequences and KV are freed, long before max_tokens would be reached."""
    stateful = ["llm", "ssm_0", "ssm_1"] if model == "ensemble" else ["ensemble_fused"]
    counter = "llm" if model == "ensemble" else "ensemble_fused"
    before = tokens_emitted(triton_server, counter)
    other = {}
    runner = threading.Thread(target=lambda: other.update(text="".join(grpc_stream(triton_server, PROMPTS[3], model))))
    runner.start()
    runner.join(timeout=300)
    alone = tokens_emitted(triton_server, counter) - before    # the tokens of one whole request of N tokens
    before = tokens_emitted(triton_server, counter)
    runner = threading.Thread(target=lambda: other.update(text="".join(grpc_stream(triton_server, PROMPTS[3], model))))
    runner.start()
    long = 200     # the context is 256: a request of ~200 tokens takes many times the steps of one of N
    at_cancel = []   # the tokens emitted when the client cancels, after it saw the first piece
    on_cancel = lambda: at_cancel.append(tokens_emitted(triton_server, counter))    # noqa: E731
    if how == "grpc":
        pieces = grpc_stream(triton_server, PROMPTS[4], model, cancel_after=1, on_cancel=on_cancel,
                             max_tokens=np.array([long], np.int32), tree=np.array([b"4,4,4"], dtype=object),
                             temperature=np.array([1.0], np.float32))
    else:
        pieces = drop_http_stream(triton_server, model, PROMPTS[4], long, on_cancel=on_cancel)
    assert pieces and at_cancel
    cancelled_at = time.monotonic()
    while time.monotonic() < cancelled_at + 30 and any(metric(triton_server, "specinfer_active_sequences", m)
                                                       for m in stateful):
        time.sleep(0.05)
    freed_after = time.monotonic() - cancelled_at
    runner.join(timeout=300)
    assert other["text"] == expected[PROMPTS[3]]
    assert [metric(triton_server, "specinfer_active_sequences", m) for m in stateful] == [0] * len(stateful)
    assert all(metric(triton_server, "specinfer_kv_bytes", m) == 0 for m in stateful)
    # The cancelled request is sampled on a wide fixed tree ("4,4,4", cut to the node budget, or to
    # its share while the other request runs), so that each of its steps verifies up to 64 nodes
    # and keeps ~1-3 tokens: 200 tokens take well over a second. With one token a step (tree
    # "none"), a step on the native kernels took ~1 ms, 100 tokens ~0.1 s, and a cancel took longer
    # than that to reach the server on a loaded 2-core machine (192 tokens after the client's
    # cancel, once in a full run of the suite). Counted from the client's cancel, its tokens are
    # those until the cancel reached the server, far fewer than its 200 (the loop asks for a cancel
    # every 20 ms). Counted from its start, they also take in how long the client took to see its
    # first piece and cancel, which on a loaded CI machine was 0.3-0.4 s: that only has to leave it
    # short of its 200. The other request emits `alone` tokens (tokens, not steps: batched beside
    # the cancelled one, its trees are smaller, its steps more), some before the cancel and the
    # rest after.
    end = tokens_emitted(triton_server, counter)
    cancelled, after_cancel = end - before - alone, end - at_cancel[0] - alone
    if at_cancel[0] - before - alone >= long:
        # The request had emitted all its tokens before the client saw its first piece and
        # cancelled: there is no cancel to count.
        pytest.skip(f"the request ended before the client's cancel ({at_cancel[0] - before - alone:.0f} tokens)")
    assert cancelled < long and after_cancel < 0.5 * long, (cancelled, after_cancel, alone, freed_after)


def test_internal_models_refuse_clients(triton_server):
    """Only the orchestrator opens sequences in llm and ssm_<i>: a client's op=start is refused."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    for model in ("llm", "ssm_0", "lookup"):
        inputs = []
        for name, value in (("op", b"start"), ("sequence_id", b"made-up"), ("caller_key", b"guess")):
            t = grpcclient.InferInput(name, [1, 1], "BYTES")   # the inner models take batches of one
            t.set_data_from_numpy(np.array([[value]], dtype=object))
            inputs.append(t)
        with pytest.raises(InferenceServerException, match="internal to specinfer's orchestrator"):
            client.infer(model, inputs)
    assert metric(triton_server, "specinfer_active_sequences", "llm") == 0


def test_specinfer_serve_starts_answers_and_stops_on_ctrl_c(triton_server, tmp_path):
    import signal
    import subprocess
    import sys
    from conftest import free_port
    http = free_port()
    # The server's log goes to a file: an unread stderr pipe would block a chatty shutdown once full.
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "specinfer.cli", "serve", str(triton_server.repository),
                             "--http-port", str(http), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()  # printed once the server is ready
        assert line.startswith("ready:") and f"127.0.0.1:{http}" in line
        class Server:
            http_url = f"127.0.0.1:{http}"
        status, body = generate(Server, text_input="def f(x):")
        assert status == 200 and body["text_output"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = f"no exit within 60 s; log tail: {(tmp_path / 'serve.log').read_text()[-2000:]}"
        log.close()
        assert code == 0
