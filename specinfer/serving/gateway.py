"""The public HTTP endpoint of `specinfer serve`: a small reverse proxy in front of Triton's HTTP port.

Triton 2.51's HTTP front end (libevhtp) parses a form-urlencoded body as query arguments on the
stack: a few MB of it crash the whole server (SIGSEGV), and Triton has no option to cap the body
size. So Triton's HTTP listens on 127.0.0.1 only, and this gateway is what clients reach. It

- caps request bodies (413, from Content-Length before reading, or while reading a chunked body);
- lets through JSON bodies (and Triton's binary tensor format on ``/infer``) only, so Triton never
  sees a form-urlencoded Content-Type (415 otherwise);
- forwards inference, health and model metadata; the administrative APIs answer 403 unless the
  request carries the admin key (Triton checks it too: ``--http-restricted-api``);
- checks ``/generate`` and ``/generate_stream`` bodies against the model's declared inputs (types,
  integer and float ranges, required inputs) and names the field that is wrong (400), where Triton
  would silently wrap an out-of-range integer;
- streams responses through chunk by chunk; a client that goes away closes the upstream
  connection, which makes Triton cancel the request.

It runs on its own event loop in a background thread of the process that owns the tritonserver.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from ..errors import SpecInferError

ADMIN_HEADER = "specinfer-admin-key"
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
# Triton's header for binary tensor data after the JSON part of an infer request (and response).
BINARY_HEADER = "Inference-Header-Content-Length"
# Headers passed through as they are; hop-by-hop headers and Content-Length are aiohttp's business.
# A request's Content-Encoding is not: aiohttp has already decompressed the body (and the size cap
# counts the decompressed bytes).
_REQUEST_HEADERS = (BINARY_HEADER, "Accept-Encoding", ADMIN_HEADER)
_RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", BINARY_HEADER)

_NAME = r"(?!\.{1,2}(?:/|$))[A-Za-z0-9_.\-]+"   # a model name or version (never "." or ".."), unencoded
_MODEL = rf"/v2/models/(?P<model>{_NAME})(?:/versions/(?P<version>{_NAME}))?"
_ROUTES = [   # (kind, path pattern); the first match wins, anything else under /v2 is administrative
    ("health", re.compile(r"/v2/health/(?:live|ready)")),
    ("metadata", re.compile(r"/v2")),
    ("generate", re.compile(rf"{_MODEL}/generate(?:_stream)?")),
    ("infer", re.compile(rf"{_MODEL}/infer")),
    ("admin", re.compile(r"/v2/models/stats")),   # Triton's statistics of every model, not a model "stats"
    ("metadata", re.compile(rf"{_MODEL}(?:/ready)?")),
]

_INT_RANGES = {f"TYPE_{'U' if u else ''}INT{b}": ((0, 2**b - 1) if u else (-2**(b - 1), 2**(b - 1) - 1))
               for b in (8, 16, 32, 64) for u in (False, True)}
_FLOAT_MAX = {"TYPE_FP16": 65504.0, "TYPE_BF16": 3.3895313892515355e38, "TYPE_FP32": 3.4028234663852886e38,
              "TYPE_FP64": 1.7976931348623157e308}


@dataclass(frozen=True)
class InputSpec:
    """One declared input of a model (from Triton's model config)."""
    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool


class _Refusal(Exception):
    """An answer to the client without asking Triton: (status, message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _got(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_element(name: str, value: Any, data_type: str) -> str | None:
    """Why one element of input ``name`` is not a valid ``data_type``, or None."""
    if data_type == "TYPE_STRING":
        return None if isinstance(value, str) else f"input '{name}' must be a string, got {_got(value)}"
    if data_type == "TYPE_BOOL":
        return None if isinstance(value, bool) else f"input '{name}' must be true or false, got {_got(value)}"
    if data_type in _INT_RANGES:
        lo, hi = _INT_RANGES[data_type]
        if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
            return None
        return f"input '{name}' must be an integer in {lo}..{hi} ({data_type}), got {_got(value)}"
    if data_type in _FLOAT_MAX:
        top = _FLOAT_MAX[data_type]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and abs(value) <= top:
            return None
        return f"input '{name}' must be a finite number of magnitude at most {top:.7g} ({data_type}), got {_got(value)}"
    return None   # a type a JSON body cannot carry precisely: Triton answers


def _flatten(value: Any) -> list[Any]:
    return [x for v in value for x in _flatten(v)] if isinstance(value, list) else [value]


def check_generate_body(body: Any, inputs: dict[str, InputSpec]) -> str | None:
    """Why a ``/generate`` body does not fit the model's declared inputs, or None. Fields that are
    not inputs are left to Triton (it reads them as request parameters)."""
    if not isinstance(body, dict):
        return f"the request body must be a JSON object, got {_got(body)}"
    for spec in inputs.values():
        if spec.name not in body:
            if not spec.optional:
                return f"missing input '{spec.name}'"
            continue
        elements = _flatten(body[spec.name])
        if all(d > 0 for d in spec.dims) and len(elements) != math.prod(spec.dims):
            return f"input '{spec.name}' must have {math.prod(spec.dims)} element(s) (dims {list(spec.dims)}), got {len(elements)}"
        for element in elements:
            if (why := _check_element(spec.name, element, spec.data_type)) is not None:
                return why
    return None


def classify(path: str) -> tuple[str, re.Match | None]:
    """The kind of a request path: health, metadata, generate, infer, admin (other /v2 paths) or unknown."""
    for kind, pattern in _ROUTES:
        if m := pattern.fullmatch(path):
            return kind, m
    return ("admin" if path.startswith("/v2/") else "unknown"), None


class Gateway:
    """The aiohttp proxy, on ``host:port``, in front of Triton's HTTP at ``upstream`` (host:port).
    ``admin_key`` None: the administrative APIs are open (Triton restricts nothing either)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 8000,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, admin_key: str | None = None):
        self.upstream, self.host, self.port = f"http://{upstream}", host, port
        self.max_request_bytes, self.admin_key = max_request_bytes, admin_key
        self._inputs: dict[tuple[str, str], dict[str, InputSpec]] = {}
        self._active = 0          # requests being forwarded now
        self._draining = False
        self._session: ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    # -- lifecycle: a thread running its own event loop --------------------------------------------

    def start(self, timeout: float = 10.0) -> Gateway:
        """Listen (in a background thread); raises if the port cannot be bound."""
        self._thread = threading.Thread(target=self._run, name=f"specinfer-gateway-{self.port}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise SpecInferError(f"the HTTP gateway did not start within {timeout:.0f} s")
        if self._error is not None:
            raise SpecInferError(f"the HTTP gateway cannot listen on {self.host}:{self.port}: {self._error}")
        return self

    def drain(self, wait: float = 1.0) -> None:
        """Before Triton is asked to stop: refuse new requests (503), let those under way finish,
        then close the upstream connections. Triton's HTTP server waits, up to its whole exit
        timeout, for open connections to go, idle keep-alive ones included: without this every
        stop took the full grace period. Waits up to ``wait`` seconds for the connections to close
        (they close at once when nothing is under way)."""
        if self._loop is not None and self._thread and self._thread.is_alive():
            closed = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
            try:
                closed.result(wait)
            except concurrent.futures.TimeoutError:
                pass   # requests under way: Triton waits for them, up to the grace period

    async def _drain(self) -> None:
        self._draining = True
        while self._active:
            await asyncio.sleep(0.05)
        await self._session.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and the open connections (streams still open get their last event)."""
        if self._loop is not None and self._stopping is not None and self._thread and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
        finally:
            self._started.set()
            self._loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        # One keep-alive session for every upstream call. No read timeout: a stream lasts as long
        # as the generation does. Bodies pass through compressed or not, as they came.
        self._session = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False,
                                      timeout=ClientTimeout(total=None, connect=10),
                                      skip_auto_headers=("Accept-Encoding", "Content-Type", "User-Agent"))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that disconnects cancels its handler, which closes the
        # upstream connection (Triton then cancels the request). lingering_time: what is left of a
        # refused body is read and dropped for a moment so that the client gets the 413/415.
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0, lingering_time=2.0,
                               access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port, reuse_address=True).start()
            self._started.set()
            await self._stopping.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    # -- requests ---------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._proxy(request)
        except _Refusal as r:
            return web.json_response({"error": r.message}, status=r.status)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        # The raw path is both what is classified and what is forwarded: a percent-encoded path
        # matches no forwarded kind, so it cannot reach Triton as something else than it looked.
        path = request.rel_url.raw_path
        kind, match = classify(path)
        if self._draining:
            raise _Refusal(503, "the server is stopping")
        if kind == "unknown":
            raise _Refusal(404, f"no such endpoint: {path}")
        if kind == "admin" and not self._admin_allowed(request):
            raise _Refusal(403, f"{path} is an administrative API, restricted on this server: send the header "
                                f"'{ADMIN_HEADER}: <key>' with the key `specinfer serve --admin-key` (or "
                                f"SPECINFER_ADMIN_KEY) set, or start `specinfer serve --open-admin-api`")
        binary = self._check_content_type(request, binary_ok=kind == "infer")
        body = await self._read_body(request)
        if kind == "generate":
            await self._check_generate(body, match["model"], match["version"] or "")
        headers = {h: request.headers[h] for h in _REQUEST_HEADERS if h in request.headers}
        if body:
            headers["Content-Type"] = "application/octet-stream" if binary else "application/json"
        return await self._forward(request, body, headers)

    def _admin_allowed(self, request: web.Request) -> bool:
        if self.admin_key is None:
            return True
        given = request.headers.get(ADMIN_HEADER, "")
        return hmac.compare_digest(given.encode(), self.admin_key.encode())

    def _check_content_type(self, request: web.Request, binary_ok: bool) -> bool:
        """True for a binary-tensor infer body, False for JSON (or none); 415 for anything else.
        ``application/x-www-form-urlencoded`` is accepted only as a label on a JSON body (it is what
        ``curl -d`` and urllib send by default): the body must parse as JSON and is forwarded as
        application/json, so Triton never parses a form."""
        raw = request.headers.get("Content-Type")
        mime = raw.split(";")[0].strip().lower() if raw else ""
        if binary_ok and BINARY_HEADER in request.headers and mime in ("", "application/octet-stream"):
            return True
        if mime in ("", "application/json", "application/x-www-form-urlencoded"):
            return False
        accepted = "application/json" + (f", or application/octet-stream with {BINARY_HEADER}" if binary_ok else "")
        raise _Refusal(415, f"unsupported Content-Type {raw!r}: this endpoint accepts {accepted}")

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.max_request_bytes
        too_large = _Refusal(413, f"the request body is larger than the limit of {limit} bytes "
                                  f"(`specinfer serve --max-request-bytes`)")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.content.iter_any():   # a chunked body: cap while reading
            body += chunk
            if len(body) > limit:
                raise too_large
        form_label = request.headers.get("Content-Type", "").split(";")[0].strip().lower().endswith("urlencoded")
        if body and form_label:
            try:
                json.loads(body)
            except ValueError:
                raise _Refusal(415, "unsupported Content-Type 'application/x-www-form-urlencoded': send the "
                                    "body as application/json") from None
        return bytes(body)

    async def _check_generate(self, body: bytes, model: str, version: str) -> None:
        parsed = _parse_json(body)
        inputs = await self._model_inputs(model, version)
        if inputs is not None and (why := check_generate_body(parsed, inputs)) is not None:
            raise _Refusal(400, why)

    async def _model_inputs(self, model: str, version: str) -> dict[str, InputSpec] | None:
        """The model's declared inputs, read once from Triton; None where Triton has no such model
        (the request then goes on, and Triton answers that)."""
        key = (model, version)
        if key not in self._inputs:
            path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/config"
            headers = {ADMIN_HEADER: self.admin_key} if self.admin_key else {}
            try:
                async with self._session.get(self.upstream + path, headers=headers) as r:
                    if r.status != 200:
                        return None
                    config = json.loads(await r.read())
            except (ClientError, ValueError):
                return None
            self._inputs[key] = {i["name"]: InputSpec(i["name"], i["data_type"], tuple(i.get("dims", ())),
                                                      bool(i.get("optional", False)))
                                 for i in config.get("input", [])}
        return self._inputs[key]

    async def _forward(self, request: web.Request, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
        self._active += 1
        try:
            return await self._exchange(request, body, headers)
        finally:
            self._active -= 1

    async def _exchange(self, request: web.Request, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
        url = self.upstream + request.rel_url.raw_path_qs
        try:
            upstream = await self._session.request(request.method, url, data=body or None, headers=headers)
        except (ClientError, RuntimeError) as e:   # RuntimeError: the session is closed (draining)
            raise _Refusal(503, f"the inference server is not available ({e})") from None
        complete = False
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                          headers={h: upstream.headers[h] for h in _RESPONSE_HEADERS
                                                   if h in upstream.headers})
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():   # server-sent events pass as they come
                    await response.write(chunk)
                complete = True
            except ClientError as e:
                # Triton went away mid-response (stopped or died): end a stream with an error event
                # rather than a cut connection.
                if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    await response.write(b'data: ' + json.dumps({"error": f"the inference server stopped "
                                                                          f"while streaming ({e})"}).encode() + b"\n\n")
                else:
                    raise
            await response.write_eof()
            return response
        finally:
            # Read to the end: the connection goes back to the keep-alive pool. Otherwise (the
            # client went away and its handler was cancelled, or Triton did) closing the connection
            # is what tells Triton to cancel a request still running.
            if complete:
                upstream.release()
            else:
                upstream.close()


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else {}
    except ValueError as e:
        raise _Refusal(400, f"request body is not valid JSON: {e}") from None
