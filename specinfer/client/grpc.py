"""gRPC: every request goes over Triton's bidirectional ``ModelStreamInfer``, one stream per request.

Triton refuses unary ``ModelInfer`` on decoupled models (``ensemble``, ``ensemble_fused``), while
the stream answers every model, streamed (``stream`` true: one response per piece) or not (one
response). The last response of a request carries the ``triton_final_response`` parameter.
Synchronous: ``tritonclient.grpc`` (``start_stream`` / ``async_stream_infer``); asyncio:
``tritonclient.grpc.aio`` (``stream_infer``).
"""
from __future__ import annotations

import queue
from typing import AsyncIterator, Iterator

from .messages import ClientError, infer_inputs, read_outputs


def _error(e: Exception, url: str) -> ClientError:
    """A tritonclient error (``status()``, ``message()``) or a grpc one (``code()``, ``details()``) as a
    ClientError: the server's message, or why the server is unreachable."""
    if hasattr(e, "status"):
        status, message = str(e.status()), e.message()
    else:
        status, message = str(e.code()), e.details()
    if "UNAVAILABLE" in status:
        return ClientError(f"cannot reach the server at {url} over gRPC: {message}")
    if "DEADLINE_EXCEEDED" in status:
        return ClientError(f"no answer from {url} in time: {message}")
    return ClientError(message or str(e))


def _unpack(result) -> tuple[dict, bool]:
    """A stream response -> (outputs, final)."""
    params = result.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    return read_outputs(result.as_numpy), final


class GrpcTransport:
    """Synchronous gRPC. tritonclient allows one stream at a time per client: use one transport
    (one :class:`~specinfer.client.Client`) per thread."""

    def __init__(self, host: str, port: int, timeout: float | None):
        import tritonclient.grpc as grpcclient

        self.url, self.timeout, self.module = f"{host}:{port}", timeout, grpcclient
        self.client = grpcclient.InferenceServerClient(self.url)

    def responses(self, model: str, body: dict) -> Iterator[dict]:
        """The responses to one request: one, or one per streamed piece (``body["stream"]``)."""
        from tritonclient.utils import InferenceServerException

        answers: queue.Queue = queue.Queue()
        final = False
        try:
            self.client.start_stream(lambda result, error: answers.put((result, error)), stream_timeout=self.timeout)
            self.client.async_stream_infer(model, infer_inputs(self.module.InferInput, body),
                                           enable_empty_final_response=True)
            while not final:
                try:
                    result, error = answers.get(timeout=self.timeout)
                except queue.Empty:
                    raise ClientError(f"no answer from {self.url} within {self.timeout} s") from None
                if error is not None:
                    raise _error(error, self.url)
                outputs, final = _unpack(result)
                if outputs:
                    yield outputs
        except InferenceServerException as e:
            if not answers.empty():  # a broken stream reports its cause to the callback first
                e = answers.get()[1] or e
            raise _error(e, self.url) from None
        finally:  # an abandoned request is cancelled on the server
            self.client.stop_stream(cancel_requests=not final)

    def close(self) -> None:
        self.client.close()


class AsyncGrpcTransport:
    """asyncio gRPC over one channel; requests may run concurrently."""

    def __init__(self, host: str, port: int, timeout: float | None):
        import tritonclient.grpc.aio as aioclient

        self.url, self.timeout = f"{host}:{port}", timeout
        self.client = aioclient.InferenceServerClient(self.url)

    async def responses(self, model: str, body: dict) -> AsyncIterator[dict]:
        import grpc
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        async def one_request():  # then the client half-closes; the server ends the stream when done
            yield {"model_name": model, "inputs": infer_inputs(grpcclient.InferInput, body)}

        call = self.client.stream_infer(one_request(), stream_timeout=self.timeout)
        try:
            async for result, error in call:
                if error is not None:
                    raise _error(error, self.url)
                outputs, final = _unpack(result)
                if outputs:
                    yield outputs
                if final:
                    break
        except (InferenceServerException, grpc.RpcError) as e:
            raise _error(e, self.url) from None
        finally:
            call.cancel()  # no-op once the stream has ended; cancels an abandoned request

    async def close(self) -> None:
        await self.client.close()
