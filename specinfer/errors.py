"""The exceptions users see: a problem said in one line."""


class SpecInferError(Exception):
    """Bad input or an unsupported model: the message names the problem (CLI exit code 2). The
    server answers it as an internal error (its message is ours, never a raw Python one)."""


class RequestError(SpecInferError):
    """What a client's request got wrong, naming the input: the server answers it as Triton's
    INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT)."""


class RequestTooLarge(RequestError):
    """The request could never fit the server's KV budget. Its message starts with :attr:`PREFIX`."""

    PREFIX = "the request needs"


class ServerStopping(SpecInferError):
    """The server is stopping: a running request ends early with this (Triton's UNAVAILABLE, which
    clients may retry on another server). Its message starts with :attr:`PREFIX`."""

    PREFIX = "the server is stopping"


class ServerBusy(SpecInferError):
    """The server cannot take the request now (its KV memory is in use and its queue full): Triton's
    UNAVAILABLE, which clients may retry later. Its message starts with :attr:`PREFIX`.

    (A relay that gets only an error's message knows these three by their prefixes:
    serving/triton_glue.py.)"""

    PREFIX = "the server is busy"
