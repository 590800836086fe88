"""The serving process around tritonserver: the HTTP gateway's limits and checks, the restricted
administrative APIs, stopping, crashing, and two servers on one machine."""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

MODEL = "ensemble"
ADMIN_HEADER = "specinfer-admin-key"


def request(server, method, path, body=b"", headers=None, chunked=False, timeout=120):
    """(status, body text) of one HTTP request to the server's public address."""
    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        if chunked:
            conn.putrequest(method, path)
            for k, v in (headers or {}).items():
                conn.putheader(k, v)
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            try:
                for i in range(0, len(body), 1 << 16):
                    piece = body[i:i + (1 << 16)]
                    conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                conn.send(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass   # refused before the end: the answer is still there to read
        else:
            conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def generate(server, path=f"/v2/models/{MODEL}/generate", **body):
    return request(server, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})


def error_of(text: str) -> str:
    """The error of a JSON answer, or of the first server-sent event of a stream's."""
    if text.startswith("data:"):
        text = text.splitlines()[0][5:]
    return json.loads(text)["error"]


def assert_serving(server):
    assert request(server, "GET", "/v2/health/ready")[0] == 200
    status, text = generate(server, text_input="def f(x):", max_tokens=4)
    assert status == 200 and json.loads(text)["text_output"], text


# -- the gateway, on the session's server -----------------------------------------------------------

FORM = {"Content-Type": "application/x-www-form-urlencoded"}
BIG = b"a=" + b"x" * (10 << 20)   # about 10 MB: crashed tritonserver's HTTP front end (SIGSEGV)


@pytest.mark.parametrize("path", [f"/v2/models/{MODEL}/generate", f"/v2/models/{MODEL}/infer", "/v2/repository/index"])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_10mb_form_post_is_refused_and_the_server_stays_up(triton_server, path, chunked):
    status, text = request(triton_server, "POST", path, BIG, FORM, chunked=chunked)
    assert status in (403, 413, 415), text
    if status == 413:
        assert "limit of 1048576 bytes" in error_of(text)
    assert_serving(triton_server)


def test_only_json_bodies_pass(triton_server):
    status, text = request(triton_server, "POST", f"/v2/models/{MODEL}/generate", b"text_input=hi", FORM)
    assert status == 415 and "application/json" in error_of(text)
    status, text = request(triton_server, "POST", f"/v2/models/{MODEL}/generate", b"--x\r\n",
                           {"Content-Type": "multipart/form-data; boundary=x"})
    assert status == 415
    # A JSON body labelled form-urlencoded (what curl -d and urllib send) goes on as JSON.
    status, text = request(triton_server, "POST", f"/v2/models/{MODEL}/generate",
                           json.dumps({"text_input": "x = [", "max_tokens": 2}).encode(), FORM)
    assert status == 200, text


@pytest.mark.parametrize("method, path", [
    ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/llm/unload"), ("GET", "/v2/models/llm/config"),
    ("GET", "/v2/models/stats"), ("GET", "/v2/trace/setting"), ("GET", "/v2/logging"),
    ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/status"),
])
def test_administrative_apis_are_forbidden_through_the_gateway(triton_server, method, path):
    status, text = request(triton_server, method, path, b"{}" if method == "POST" else b"")
    assert status == 403 and "--open-admin-api" in error_of(text) and ADMIN_HEADER in error_of(text)
    wrong = request(triton_server, method, path, headers={ADMIN_HEADER: "not-the-key"})
    assert wrong[0] == 403


def test_the_admin_key_opens_them(triton_server):
    status, text = request(triton_server, "POST", "/v2/repository/index", b"{}", triton_server.admin_headers)
    assert status == 200 and "llm" in {m["name"] for m in json.loads(text)}


def test_grpc_shared_memory_registration_needs_the_key(triton_server):
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    key = f"/specinfer_test_{os.getpid()}"
    region = shm.create_shared_memory_region("test_region", key, 64)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.register_system_shared_memory("test_region", key, 64)
        admin = triton_server.grpc_admin_headers
        client.register_system_shared_memory("test_region", key, 64, headers=admin)
        assert "test_region" in str(client.get_system_shared_memory_status(headers=admin))
        client.unregister_system_shared_memory("test_region", headers=admin)
    finally:
        shm.destroy_shared_memory_region(region)


@pytest.mark.parametrize("body, message", [
    ({"text_input": 5}, "input 'text_input' must be a string"),
    ({"text_input": "hi", "max_tokens": "abc"}, "input 'max_tokens' must be an integer in -2147483648..2147483647"),
    ({"text_input": "hi", "max_tokens": 4294967304}, "input 'max_tokens' must be an integer in -2147483648..2147483647"),
    ({"text_input": "hi", "max_tokens": True}, "input 'max_tokens' must be an integer"),
    ({"text_input": "hi", "random_seed": -1}, "input 'random_seed' must be an integer in 0..18446744073709551615"),
    ({"text_input": "hi", "stop_words": 5}, "input 'stop_words' must be a string"),
    ({"text_input": "hi", "temperature": 1e39}, "input 'temperature' must be a finite number"),
    ({"text_input": "hi", "stream": 1}, "input 'stream' must be true or false"),
    ({"max_tokens": 3}, "missing input 'text_input'"),
])
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_generate_fields_are_checked_against_the_model(triton_server, body, message, endpoint):
    status, text = generate(triton_server, f"/v2/models/{MODEL}/{endpoint}", **body)
    assert status == 400 and message in error_of(text), text


def test_malformed_json_and_unknown_model(triton_server):
    status, text = request(triton_server, "POST", f"/v2/models/{MODEL}/generate", b'{"text_input": ',
                           {"Content-Type": "application/json"})
    assert status == 400 and error_of(text).startswith("request body is not valid JSON")
    status, text = generate(triton_server, "/v2/models/nosuchmodel/generate", text_input="hi")
    assert status in (400, 404) and "nosuchmodel" in error_of(text)


def test_streams_pass_event_by_event_and_a_disconnect_cancels(triton_server):
    """The first event arrives long before the end; a client that goes away frees the sequence."""
    import urllib.request
    host, port = triton_server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", f"/v2/models/{MODEL}/generate_stream",
                 json.dumps({"text_input": "for i in range(10):", "max_tokens": 200, "stream": True}).encode(),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    assert r.readline().startswith(b"data:")   # the first event, while the rest is generated
    conn.sock.close()   # go away mid-stream
    conn.close()

    def active():
        text = urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode()
        return sum(float(v) for v in re.findall(r'^specinfer_active_sequences{model="llm"} (\S+)$', text, re.MULTILINE))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and active():
        time.sleep(0.5)
    assert active() == 0
    assert_serving(triton_server)


# -- servers of their own: `specinfer serve` processes ------------------------------------------------

class Serve:
    """A `specinfer serve` process; its stderr goes to a file (an unread pipe would block it)."""

    def __init__(self, tmp: Path, name: str, *args: str):
        self.http, self.grpc = free_port(), free_port()
        self.http_url = f"127.0.0.1:{self.http}"
        self.stderr_path = tmp / f"{name}.stderr"
        self.stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specinfer.cli", "serve", *args, "--http-port", str(self.http),
             "--grpc-port", str(self.grpc), "--metrics-port", str(free_port()), "--grace-period", "2"],
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.ready_line = ""

    def wait_ready(self) -> None:
        self.ready_line = self.proc.stdout.readline()
        assert self.ready_line.startswith("ready:"), self.log()

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def shm_prefix(self) -> str:
        return re.search(r"shared memory: /dev/shm/(\S+)\*", self.log()).group(1)

    def repository(self) -> Path:
        return Path(re.search(r"starting tritonserver on (\S+) \.\.\.", self.log()).group(1))

    def tritonserver_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return next(int(c) for c in children if "tritonserver" in Path(f"/proc/{c}/cmdline").read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.stderr.close()


def shm_files(prefix: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


@pytest.fixture(scope="module")
def two_serves(served_pair, tmp_path_factory):
    """Two `specinfer serve` started at the same moment: one on the embedded models (a temporary
    repository of its own), one on a repository of `served_pair`."""
    from specinfer.serving.repository import write_repository
    tmp = tmp_path_factory.mktemp("serves")
    repo = write_repository(served_pair["llm"], served_pair["ssms"], tmp / "repo", tree="1,1,3,1,1,1")
    serves = [Serve(tmp, "embedded"), Serve(tmp, "given", str(repo))]
    try:
        for s in serves:
            s.wait_ready()
        yield serves
    finally:
        for s in serves:
            s.close()


def test_two_servers_start_side_by_side_and_both_answer(two_serves):
    for s in two_serves:
        assert_serving(s)
    assert two_serves[0].shm_prefix() != two_serves[1].shm_prefix()
    assert all(shm_files(s.shm_prefix()) for s in two_serves)


def test_the_embedded_serve_drafts_sampled_requests_with_the_distilled_ssm(two_serves):
    """`specinfer serve` on the embedded models: ssm_0 (SSM 1) drafts for greedy requests, ssm_1 (the
    distilled SSM 1) for sampled ones, both in the one process of the default (fused) layout's
    ensemble, which is the only model that loads them; the other stub is ensemble_sync's, the relay."""
    from specinfer.client.bench import process_tree
    from specinfer.engines.loader import onnx_folder
    from specinfer.models import embedded_sampling_ssms, embedded_ssms
    serve = two_serves[0]
    assert sorted(p.name for p in serve.repository().iterdir() if p.is_dir()) == ["ensemble", "ensemble_sync"]
    config = (serve.repository() / "ensemble" / "config.pbtxt").read_text()
    assert f'"ssm_dirs" value: {{ string_value: "{onnx_folder(embedded_ssms()[0]).resolve()}" }}' in config
    assert (f'"sampling_ssm_dirs" value: {{ string_value: "{onnx_folder(embedded_sampling_ssms()[0]).resolve()}" }}'
            in config)
    stubs = [p for p in process_tree(serve.tritonserver_pid())
             if "triton_python_backend_stub" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(stubs) == 2, stubs
    relay = [p for p in stubs if "/ensemble_sync/" in Path(f"/proc/{p}/cmdline").read_text()]
    maps = {p: Path(f"/proc/{p}/maps").read_text() for p in stubs}
    assert len(relay) == 1 and ["onnxruntime" in maps[p] for p in stubs] == [p not in relay for p in stubs]
    answers = [generate(serve, "/v2/models/ensemble/generate", text_input="def f(x):", max_tokens=16,
                        temperature=0.7, random_seed=1, tree=tree) for tree in ("1,1,1", "1,1,1", "dynamic")]
    assert all(status == 200 for status, _ in answers), answers
    assert all(json.loads(text)["text_output"] for _, text in answers), answers


def _stream_events(server, text: str, into: list) -> None:
    """Each server-sent event of a long streamed request, as (time, parsed JSON), into ``into``."""
    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/generate_stream",
                     json.dumps({"text_input": text, "max_tokens": 900, "stream": True}).encode(),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        for line in iter(r.readline, b""):
            if line.startswith(b"data:"):
                into.append((time.monotonic(), json.loads(line[5:])))
    finally:
        conn.close()


def test_sigterm_ends_running_streams_stops_within_the_grace_period_and_leaves_nothing(two_serves):
    """Twelve streams running on the orchestrator's kept threads when SIGTERM comes: each ends at
    once with "the server is stopping", and serve exits cleanly within its grace period (2 s).
    Twelve, so that each runs at a few hundred tokens/s: three alone once made their 900 tokens
    in the second the stop takes to reach them (CI, 2026-11-25)."""
    import threading

    serve = two_serves[0]
    prefix, repository = serve.shm_prefix(), serve.repository()
    assert repository.is_dir() and shm_files(prefix)
    events: list[list] = [[] for _ in range(12)]
    streams = [threading.Thread(target=_stream_events, args=(serve, f"def f{i}(x):", events[i])) for i in range(12)]
    for t in streams:
        t.start()
    deadline = time.monotonic() + 60
    while not all(events) and time.monotonic() < deadline:   # every stream under way
        time.sleep(0.05)
    assert all(events), serve.log()
    start = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    for t in streams:
        t.join(timeout=30)
    code = serve.proc.wait(timeout=60)
    took = time.monotonic() - start
    assert code == 0 and took < 2 + 6, (code, took, serve.log())
    for t, got in zip(streams, events):
        assert not t.is_alive()
        *tokens, (when, last) = got
        assert tokens and all("text_output" in e for _, e in tokens), got
        assert "the server is stopping" in last.get("error", ""), last
        assert when - start < 2 + 3, when - start   # at the next step, not at the end of max_tokens
    assert not shm_files(prefix)
    assert not repository.exists()
    assert_serving(two_serves[1])   # the other one is untouched


def test_a_dead_tritonserver_ends_serve_with_one_clear_line(two_serves):
    serve = two_serves[1]
    prefix = serve.shm_prefix()
    os.kill(serve.tritonserver_pid(), signal.SIGKILL)
    code = serve.proc.wait(timeout=30)
    assert code != 0
    line = re.search(r"tritonserver stopped unexpectedly with signal 9 \(SIGKILL\); its log: (\S+)", serve.log())
    assert line and Path(line.group(1)).is_file()   # kept, for the post-mortem
    Path(line.group(1)).unlink()
    assert not shm_files(prefix)
    with pytest.raises(OSError):   # the gateway went with it
        request(serve, "GET", "/v2/health/ready", timeout=5)
    assert serve.repository().is_dir()   # a repository given to serve is left alone


# -- without a server ---------------------------------------------------------------------------------

def test_serve_refuses_repository_options_for_a_written_repository(tmp_path):
    """A repository's layout (as its budgets) is chosen when it is written: `serve REPO --layout` says so."""
    r = subprocess.run([sys.executable, "-m", "specinfer.cli", "serve", str(tmp_path), "--layout", "both"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--layout belong to the repository" in r.stderr, r.stderr


def test_tritonserver_command_line(tmp_path, monkeypatch):
    from specinfer.serving.server import Installation, TritonServer
    monkeypatch.delenv("SPECINFER_ADMIN_KEY", raising=False)
    install = Installation(Path("/bin/tritonserver"), Path("/backends"))
    server = TritonServer(tmp_path, 9000, 9001, 9002, host="0.0.0.0", admin_key="k", grace_period=2.5)
    server.triton_http_port = 9100
    cmd = server.command(install)
    assert "--http-port=9100" in cmd and "--http-address=127.0.0.1" in cmd   # behind the gateway
    assert "--grpc-address=0.0.0.0" in cmd and "--metrics-address=0.0.0.0" in cmd
    assert "--exit-timeout-secs=3" in cmd
    restricted = "shared-memory,model-config,model-repository,statistics,trace,logging:specinfer-admin-key=k"
    assert f"--http-restricted-api={restricted}" in cmd and f"--grpc-restricted-protocol={restricted}" in cmd
    assert f"--backend-config=python,shm-region-prefix-name={server.shm_prefix}" in cmd
    assert not any("restricted" in c for c in TritonServer(tmp_path, open_admin_api=True).command(install))
    other = TritonServer(tmp_path)
    assert other.admin_key and other.admin_key != TritonServer(tmp_path).admin_key   # random per launch
    assert other.shm_prefix != server.shm_prefix


def test_the_backend_folder_is_made_once_when_servers_start_together(tmp_path, monkeypatch):
    """Servers starting at once share one complete folder (an exists-then-copy raced: FileExistsError)."""
    import importlib.util
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from specinfer.serving.server import find_tritonserver
    if shutil.which("tritonserver") or importlib.util.find_spec("pytriton") is None:
        pytest.skip("needs the tritonserver bundled in nvidia-pytriton")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = (Path(importlib.util.find_spec("pytriton").origin).parent / "tritonserver" / "python_backend_stubs" / version
            / "triton_python_backend_stub")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # the race is narrow: threads take turns often, for several rounds
    try:
        for round in range(20):
            tmp = tmp_path / str(round)
            tmp.mkdir()
            monkeypatch.setattr(tempfile, "tempdir", str(tmp))
            with ThreadPoolExecutor(16) as pool:
                folders = set(pool.map(lambda _: find_tritonserver().backends, range(16)))
            assert len(folders) == 1
            python = folders.pop() / "python"
            assert (python / stub.name).read_bytes() == stub.read_bytes()
            assert (python / "libtriton_python.so").is_file()
            assert [p.name for p in tmp.iterdir()] == [python.parent.name]   # no half-made folder left
    finally:
        sys.setswitchinterval(switch)


def test_kv_budget_under_load_admits_what_fits_and_refuses_what_never_can(served_pair, tmp_path):
    """The fused orchestrator (the default layout's ensemble) with room for two requests' KV: eight
    concurrent requests all finish, each exactly as alone (the others waited for memory); one that
    could never fit gets a clear 400."""
    from concurrent.futures import ThreadPoolExecutor

    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.serving.repository import write_repository

    per_token = sum(OrtRuntime(d).kv_bytes_per_token for d in [served_pair["llm"], *served_pair["ssms"]])
    need = (8 + 1 + 24 + 64) * per_token          # a prompt of up to 8 tokens, 24 new ones, one tree
    repo = write_repository(served_pair["llm"], served_pair["ssms"], tmp_path / "repo", tree="1,1,3,1",
                            kv_budget=2 * need + need // 2, prefill_chunk_tokens=3)   # prompts by chunks too
    assert 'key: "prefill_chunk_tokens" value: { string_value: "3" }' in (repo / "ensemble" / "config.pbtxt").read_text()
    serve = Serve(tmp_path, "budget", str(repo))
    try:
        serve.wait_ready()
        path = "/v2/models/ensemble/generate"   # the default layout's: the fused orchestrator
        prompts = [f"def f{i}(x):" for i in range(8)]
        alone = [generate(serve, path, text_input=p, max_tokens=24) for p in prompts[:2]]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: generate(serve, path, text_input=p, max_tokens=24), prompts))
        assert all(status == 200 for status, _ in together), together
        assert [json.loads(t)["text_output"] for _, t in together[:2]] == [json.loads(t)["text_output"] for _, t in alone]
        status, text = generate(serve, path, text_input="def f(x):", max_tokens=200)
        assert status == 400 and "KV budget" in error_of(text), text
        assert_relayed_infer(serve, prompts[:4], [json.loads(t)["text_output"] for _, t in together[:4]])
        assert_serving(serve)
    finally:
        serve.close()


def assert_relayed_infer(serve, prompts, texts):
    """The default layout's ensemble_sync answers KServe unary infer (HTTP through the gateway, gRPC)
    by relaying to the fused ensemble: the same texts under the same KV budget, concurrent requests
    included, and its errors keep their codes (the client's mistake, a request over the budget)."""
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    for module, address in ((httpclient, serve.http_url), (grpcclient, f"127.0.0.1:{serve.grpc}")):
        def infer(prompt, max_tokens=24, **more):
            inputs = {"text_input": np.array([prompt.encode()], dtype=object), "max_tokens": np.array([max_tokens], np.int32)}
            inputs |= more
            tensors = []
            for name, value in inputs.items():
                tensors.append(module.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype)))
                tensors[-1].set_data_from_numpy(value)
            with module.InferenceServerClient(address) as client:
                return client.infer("ensemble_sync", tensors).as_numpy("text_output")[0].decode()
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(infer, prompts)) == texts, module.__name__
        for more, message in [({"max_tokens": 200}, "KV budget"), ({"max_tokens": 0}, "'max_tokens' must be in"),
                              ({"stream": np.array([True])}, "streaming needs a decoupled model")]:
            with pytest.raises(InferenceServerException) as e:
                infer("def f(x):", **more)
            assert str(e.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT") and message in e.value.message(), e.value
