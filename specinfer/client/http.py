"""HTTP: Triton's generate extension, ``POST /v2/models/<model>/generate`` (one JSON response) and
``/generate_stream`` (server-sent events, one ``data: {...}`` line per response).

These endpoints answer decoupled models (``ensemble``, ``ensemble_fused``) as well as
``ensemble_sync``, and they stream; ``tritonclient.http`` speaks only KServe infer, which Triton
refuses on decoupled models, and does not stream. So HTTP goes through them (stdlib ``http.client``;
``aiohttp``, which ``tritonclient[http]`` brings, for asyncio).
"""
from __future__ import annotations

import http.client
import json
from typing import AsyncIterator, Iterable, Iterator

from .messages import ClientError, read_outputs


def _path(model: str, stream: bool) -> str:
    return f"/v2/models/{model}/generate_stream" if stream else f"/v2/models/{model}/generate"


def _parse(payload: str) -> dict:
    """One JSON response (or an SSE event's data) -> outputs; an ``error`` field -> ClientError."""
    try:
        message = json.loads(payload)
    except json.JSONDecodeError:
        raise ClientError(f"the server answered something that is not JSON: {payload[:200]!r}") from None
    if "error" in message:
        raise ClientError(message["error"])
    return read_outputs(message.get)


def _events(lines: Iterable[bytes]) -> Iterator[dict]:
    """Server-sent events -> outputs, one per ``data:`` line."""
    for line in lines:
        line = line.decode("utf-8").strip()
        if line.startswith("data:"):
            yield _parse(line[len("data:"):].strip())


class HttpTransport:
    """Synchronous HTTP; one connection per request, so one transport may serve several threads."""

    def __init__(self, host: str, port: int, timeout: float | None):
        self.host, self.port, self.timeout = host, port, timeout

    def responses(self, model: str, body: dict) -> Iterator[dict]:
        """The responses to one request: one, or one per streamed piece (``body["stream"]``)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            try:
                conn.connect()
            except OSError as e:
                raise ClientError(f"cannot reach the server at {self.host}:{self.port} over HTTP: {e}") from None
            conn.request("POST", _path(model, body["stream"]), json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.getheader("Content-Type", "").startswith("text/event-stream"):
                yield from _events(response)
            else:
                yield _parse(response.read().decode("utf-8"))
        except TimeoutError:
            raise ClientError(f"no answer from {self.host}:{self.port} within {self.timeout} s") from None
        except OSError as e:
            raise ClientError(f"the connection to {self.host}:{self.port} broke: {e}") from None
        finally:
            conn.close()

    def close(self) -> None:
        pass


class AsyncHttpTransport:
    """asyncio HTTP over one ``aiohttp`` session (opened on first use)."""

    def __init__(self, host: str, port: int, timeout: float | None):
        self.address, self.timeout = f"{host}:{port}", timeout
        self.session = None

    async def responses(self, model: str, body: dict) -> AsyncIterator[dict]:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        try:
            url = f"http://{self.address}{_path(model, body['stream'])}"
            async with self.session.post(url, json=body) as response:
                if response.content_type == "text/event-stream":
                    async for line in response.content:
                        for outputs in _events([line]):
                            yield outputs
                else:
                    yield _parse(await response.text())
        except aiohttp.ClientConnectorError as e:
            raise ClientError(f"cannot reach the server at {self.address} over HTTP: {e.os_error}") from None
        except aiohttp.ClientError as e:
            raise ClientError(f"HTTP to {self.address} failed: {e}") from None
        except TimeoutError:
            raise ClientError(f"no answer from {self.address} within {self.timeout} s") from None

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
