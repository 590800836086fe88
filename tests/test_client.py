"""specinfer.client against a real tritonserver: HTTP and gRPC, sync and asyncio, streamed or not,
the same greedy text as in-process generation; server errors as ClientError; the CLI; the bench."""
import argparse
import asyncio
import json
import subprocess
import sys

import pytest

pytest.importorskip("tritonclient.grpc")

from specinfer.client import AsyncClient, Client, ClientError, run_bench  # noqa: E402
from specinfer.client.cli import add_client_parser  # noqa: E402
from specinfer.client.messages import request_body, split_url  # noqa: E402
from specinfer.errors import SpecInferError  # noqa: E402

PROMPT = "def wrap(text, width=70):"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(served_pair):
    """Greedy in-process generation with the server's models and tree: (text, Stats)."""
    from specinfer import Pipeline
    from specinfer.generate import Stats

    stats = Stats()
    pipe = Pipeline(served_pair["llm"], ssms=served_pair["ssms"], tree="1,1,3,1,1,1")
    text = pipe.generate(PROMPT, MAX_TOKENS, stats=stats)
    return text, stats


def url(server, protocol):
    return server.http_url if protocol == "http" else server.grpc_url


def run_sync(server, protocol, model, stream, **params):
    with Client(url(server, protocol), protocol, model) as c:
        if stream:
            return list(c.stream(PROMPT, **params))
        return c.generate(PROMPT, **params)


def run_async(server, protocol, model, stream, **params):
    async def main():
        async with AsyncClient(url(server, protocol), protocol, model) as c:
            if stream:
                return [piece async for piece in c.stream(PROMPT, **params)]
            return await c.generate(PROMPT, **params)
    return asyncio.run(main())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("run", [run_sync, run_async], ids=["sync", "asyncio"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_served_text_is_in_process_greedy_text(triton_server, expected, protocol, run, stream):
    text, stats = expected
    out = run(triton_server, protocol, "ensemble", stream, max_tokens=MAX_TOKENS)
    if stream:
        assert len(out) > 1 and all(out) and "".join(out) == text
    else:
        assert out.text == text
        assert out.accepted_tokens_per_step == stats.tokens_per_step and out.tokens == stats.new_tokens == MAX_TOKENS
        assert out.total_draft_tokens == stats.draft_tokens
        assert out.total_accepted_draft_tokens == stats.accepted_draft_tokens


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_model_every_mode(triton_server, expected, protocol):
    text = expected[0]
    for model in ("ensemble_fused", "ensemble_sync"):
        assert run_sync(triton_server, protocol, model, False, max_tokens=MAX_TOKENS).text == text
    assert "".join(run_async(triton_server, protocol, "ensemble_fused", True, max_tokens=MAX_TOKENS)) == text
    with_prompt = run_sync(triton_server, protocol, "ensemble", False, max_tokens=MAX_TOKENS, include_input=True)
    assert with_prompt.text == PROMPT + text
    with Client(url(triton_server, protocol), protocol) as c:  # stream_results: pieces with stats so far
        results = list(c.stream_results(PROMPT, max_tokens=MAX_TOKENS))
        assert [r.tokens for r in results] == sorted(r.tokens for r in results) and results[-1].tokens == MAX_TOKENS
    with pytest.raises(ClientError, match="decoupled"):  # ensemble_sync cannot stream: the server says why
        run_sync(triton_server, protocol, "ensemble_sync", True)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("run", [run_sync, run_async], ids=["sync", "asyncio"])
def test_server_errors_are_client_errors(triton_server, protocol, run):
    for stream in (False, True):
        with pytest.raises(ClientError, match="temperature must be >= 0"):
            run(triton_server, protocol, "ensemble", stream, temperature=-1.0)
    with pytest.raises(ClientError, match="unknown model"):
        run(triton_server, protocol, "no_such_model", False)
    with pytest.raises(ClientError, match="tree"):
        run(triton_server, protocol, "ensemble", True, tree="1,x")
    # the server keeps serving
    assert run(triton_server, protocol, "ensemble", False, max_tokens=2).tokens == 2


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unreachable_server(protocol):
    from conftest import free_port

    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(ClientError, match=f"cannot reach the server at {dead}"):
        Client(dead, protocol, timeout=10).generate("hi")

    async def main():
        async with AsyncClient(dead, protocol, timeout=10) as c:
            return [p async for p in c.stream("hi")]
    with pytest.raises(ClientError, match="cannot reach the server"):
        asyncio.run(main())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_timeout(triton_server, protocol):
    with pytest.raises(ClientError, match="no answer from"):
        Client(url(triton_server, protocol), protocol, timeout=0.05).generate(PROMPT, max_tokens=200)


def test_addresses_and_request_fields():
    assert split_url(None, "grpc") == ("localhost", 8001)
    assert split_url("http://example:9000/", "http") == ("example", 9000)
    with pytest.raises(ClientError, match="protocol"):
        split_url("x:1", "websocket")
    body = request_body("hi", True, max_tokens=5, temperature=1, seed=3, stop_words=["\n"])
    assert body == {"text_input": "hi", "max_tokens": 5, "stream": True, "exclude_input_in_output": True,
                    "temperature": 1.0, "random_seed": 3, "stop_words": ["\n"]}
    assert issubclass(ClientError, SpecInferError)  # the CLI prints it in one line, exit 2


def cli(*argv):
    """The main CLI's shape (specinfer/cli.py main) around add_client_parser."""
    parser = argparse.ArgumentParser(prog="specinfer")
    add_client_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except SpecInferError as e:
        print(f"specinfer: error: {e}", file=sys.stderr)
        return 2
    return 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cli_prints_the_text(triton_server, expected, protocol, capsys):
    for flags in ([], ["--stream"]):
        assert cli("client", "generate", PROMPT, "--url", url(triton_server, protocol), "--protocol", protocol,
                   "--max-tokens", str(MAX_TOKENS), "--stats", *flags) == 0
        out, err = capsys.readouterr()
        assert out == expected[0] + "\n" and f"{MAX_TOKENS} tokens in" in err


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--model", "nope"], "unknown model"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_cli_errors_are_one_line_exit_2(triton_server, argv, message, capsys):
    assert cli("client", "generate", "hi", "--url", triton_server.http_url, *argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("specinfer: error: ") and message in err and not out


def test_main_cli_has_client(triton_server, expected):
    """Through `python -m specinfer.cli` once specinfer/cli.py registers the command."""
    from specinfer.cli import build_parser

    try:
        build_parser().parse_args(["client", "generate", "hi"])
    except SystemExit:
        pytest.skip("specinfer/cli.py does not register `client` yet")
    r = subprocess.run([sys.executable, "-m", "specinfer.cli", "client", "generate", PROMPT, "--url", triton_server.grpc_url,
                        "--protocol", "grpc", "--stream", "--max-tokens", str(MAX_TOKENS)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == expected[0] + "\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "specinfer.cli", "client", "bench", "--url", triton_server.http_url,
                        "--concurrency", "2", "--requests", "2", "--max-tokens", "4", "--stream"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "2 of 2 requests ok" in r.stdout, r.stderr


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bench(triton_server, protocol, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli("client", "bench", "--url", url(triton_server, protocol), "--protocol", protocol, "--concurrency", "2",
               "--requests", "4", "--stream", "--max-tokens", "16", "--contenders", "speculative", "--details",
               "--json", str(out)) == 0
    table = capsys.readouterr().out
    assert "| TTFT (ms) |" in table and "4 of 4 requests ok, 0 errors" in table
    report = json.loads(out.read_text())
    run = report["levels"][0]["contenders"]["speculative"]
    s = run["summary"]
    assert (s["requests"], s["ok"], s["errors"], s["tokens"]) == (4, 4, 0, 64) and s["tokens_per_s"] > 0
    for sample in run["samples"]:
        assert sample["ok"] and sample["tokens"] == 16
        assert 0 < sample["ttft_s"] <= sample["latency_s"] and sample["itl_s"] > 0
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] <= s["latency_ms"]["p99"]


def test_bench_unstreamed_errors_and_bounds(triton_server):
    report = run_bench(triton_server.http_url, "http", concurrency=2, requests=3, max_tokens=4)
    assert report["summary"]["ok"] == 3 and report["summary"]["ttft_ms"] is None
    report = run_bench(triton_server.grpc_url, "grpc", concurrency=2, requests=2, temperature=-1.0)
    assert report["summary"]["errors"] == 2 and "temperature" in next(iter(report["summary"]["error_messages"]))
    with pytest.raises(ClientError, match="loopback"):
        run_bench("10.0.0.1:8000", requests=1)
    with pytest.raises(ClientError, match=">= 1"):
        run_bench(triton_server.http_url, requests=0)


def test_a_prompt_is_never_taken_for_the_bench(capsys):
    """`client generate PROMPT` and `client bench`: the prompt "bench" is a prompt."""
    from specinfer.client.cli import cmd_bench, cmd_generate
    parser = argparse.ArgumentParser(prog="specinfer")
    add_client_parser(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(["client", "generate", "bench", "--max-tokens", "3"])
    assert a.func is cmd_generate and a.prompt == "bench"
    a = parser.parse_args(["client", "bench", "--concurrency", "2"])
    assert a.func is cmd_bench and a.concurrency == [2] and a.contenders == ["speculative", "incremental"]
    assert parser.parse_args(["client", "bench", "--concurrency", "1,4,16,4"]).concurrency == [1, 4, 16]
    for argv, says in ((["client", "generate", "hi", "--concurrency", "2"], "unrecognized arguments: --concurrency"),
                       (["client", "bench", "hi"], "unrecognized arguments: hi"), (["client", "hi"], "invalid choice")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert says in capsys.readouterr().err
