"""`Client` and `AsyncClient`: text in, text out, from a specinfer Triton deployment.

    from specinfer.client import Client
    with Client("localhost:8001", protocol="grpc") as c:
        print(c.generate("def fibonacci(n):", max_tokens=64).text)
        for piece in c.stream("def fibonacci(n):", max_tokens=64):
            print(piece, end="", flush=True)

The model is any of the repository's client-facing models (``ensemble`` by default, and
``ensemble_sync``, in every layout; ``ensemble_fused`` where the layout has it) and every request goes to
the model named: no silent remapping. Triton refuses
KServe infer (HTTP ``/infer``, gRPC ``ModelInfer``) on decoupled models, so both protocols use the
endpoints that answer every model: HTTP the generate extension (``/generate``, ``/generate_stream``:
:mod:`.http`), gRPC the bidirectional stream (:mod:`.grpc`). One-shot and streamed generation then
work on ``ensemble`` and ``ensemble_fused``, and one-shot on ``ensemble_sync`` (which refuses
``stream``).

Request parameters (keywords of ``generate`` and ``stream``): ``max_tokens`` (128), ``temperature``,
``top_k``, ``top_p``, ``seed``, ``end_id``, ``stop_words``, ``tree`` ("dynamic", or "1,1,3,1": children per depth),
``rule`` (verification under sampling: "mss", "traversal" or "naive"),
``include_input`` (non-streamed text starts with the prompt; default False). None means the
server's default. A failed request raises :class:`ClientError` with the server's message.
"""
from __future__ import annotations

from typing import AsyncIterator, Iterator

from .grpc import AsyncGrpcTransport, GrpcTransport
from .http import AsyncHttpTransport, HttpTransport
from .messages import ClientError, Result, request_body, split_url, to_result

DEFAULT_MODEL = "ensemble"
DEFAULT_TIMEOUT = 300.0


def _last(results: list[dict]) -> Result:
    if not results:
        raise ClientError("the server sent no response")
    return to_result(results[-1])


class Client:
    """A synchronous client. Not for concurrent use from several threads (gRPC streams are one at
    a time per client): give each thread its own."""

    def __init__(self, url: str | None = None, protocol: str = "http", model: str = DEFAULT_MODEL,
                 timeout: float | None = DEFAULT_TIMEOUT):
        host, port = split_url(url, protocol)
        self.url, self.protocol, self.model = f"{host}:{port}", protocol, model
        self.transport = (HttpTransport if protocol == "http" else GrpcTransport)(host, port, timeout)

    def generate(self, prompt: str, **params) -> Result:
        """The whole generation in one response."""
        return _last(list(self.transport.responses(self.model, request_body(prompt, False, **params))))

    def stream_results(self, prompt: str, **params) -> Iterator[Result]:
        """One Result per streamed response: its new text and the statistics so far."""
        for outputs in self.transport.responses(self.model, request_body(prompt, True, **params)):
            yield to_result(outputs)

    def stream(self, prompt: str, **params) -> Iterator[str]:
        """The generated text, piece by piece as the server accepts tokens."""
        for result in self.stream_results(prompt, **params):
            if result.text:
                yield result.text

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio client: ``await generate(...)``, ``async for piece in stream(...)``. Requests may
    run concurrently on one AsyncClient."""

    def __init__(self, url: str | None = None, protocol: str = "http", model: str = DEFAULT_MODEL,
                 timeout: float | None = DEFAULT_TIMEOUT):
        host, port = split_url(url, protocol)
        self.url, self.protocol, self.model = f"{host}:{port}", protocol, model
        self.transport = (AsyncHttpTransport if protocol == "http" else AsyncGrpcTransport)(host, port, timeout)

    async def generate(self, prompt: str, **params) -> Result:
        """The whole generation in one response."""
        body = request_body(prompt, False, **params)
        return _last([outputs async for outputs in self.transport.responses(self.model, body)])

    async def stream_results(self, prompt: str, **params) -> AsyncIterator[Result]:
        """One Result per streamed response: its new text and the statistics so far."""
        async for outputs in self.transport.responses(self.model, request_body(prompt, True, **params)):
            yield to_result(outputs)

    async def stream(self, prompt: str, **params) -> AsyncIterator[str]:
        """The generated text, piece by piece as the server accepts tokens."""
        async for result in self.stream_results(prompt, **params):
            if result.text:
                yield result.text

    async def close(self) -> None:
        await self.transport.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
