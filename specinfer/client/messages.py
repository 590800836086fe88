"""What travels between a client and the ``ensemble`` models: request fields, results, errors.

One request is a plain dict named as the ensemble's inputs (``text_input``, ``max_tokens``, ...);
the HTTP generate endpoints take it as JSON, gRPC as typed tensors (:func:`infer_inputs`).
Responses come back as dicts of plain values (:func:`read_outputs`) and become :class:`Result`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import SpecInferError

# The ensemble's request inputs and their Triton types (all [1] but stop_words, which is [-1]).
INPUT_TYPES = {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32",
               "top_k": "INT32", "top_p": "FP32", "random_seed": "UINT64", "end_id": "INT32",
               "stop_words": "BYTES", "exclude_input_in_output": "BOOL", "tree": "BYTES",
               "rule": "BYTES"}
NUMPY_TYPES = {"BYTES": object, "INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32, "UINT64": np.uint64}
OUTPUTS = ("text_output", "output_ids", "accepted_tokens_per_step", "total_draft_tokens", "total_accepted_draft_tokens")
DEFAULT_PORTS = {"http": 8000, "grpc": 8001}


class ClientError(SpecInferError):
    """A request failed: the server's own message, or why the server could not be reached."""


@dataclass
class Result:
    """One generation (or, when streaming, one piece of it with the statistics so far).

    ``accepted_tokens_per_step``: the tokens each speculation step emitted (accepted draft tokens
    plus the LLM's bonus token); their sum is the number of generated tokens."""

    text: str
    accepted_tokens_per_step: list[int] = field(default_factory=list)
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)   # this response's token ids

    @property
    def tokens(self) -> int:
        """Generated tokens (so far, for a streamed piece)."""
        return sum(self.accepted_tokens_per_step)


def request_body(prompt: str, stream: bool, *, max_tokens: int = 128, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 end_id: int | None = None, stop_words: list[str] | None = None, tree: str | None = None,
                 rule: str | None = None, include_input: bool = False) -> dict:
    """The request's fields; parameters left as None are not sent (the server's defaults apply).

    ``include_input``: non-streamed text starts with the prompt (the server's default is to include
    it; this client asks for the generated text only, as :meth:`specinfer.Pipeline.generate` gives)."""
    body = {"text_input": prompt, "max_tokens": int(max_tokens), "stream": bool(stream),
            "exclude_input_in_output": not include_input}
    optional = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "random_seed": seed,
                "end_id": end_id, "stop_words": stop_words, "tree": tree, "rule": rule}
    for name, value in optional.items():
        if value is not None:
            body[name] = float(value) if INPUT_TYPES[name] == "FP32" else value
    return body


def infer_inputs(make_input: Callable, body: dict) -> list:
    """The body as tritonclient ``InferInput``s (``make_input`` is ``tritonclient.grpc.InferInput``)."""
    inputs = []
    for name, value in body.items():
        kind = INPUT_TYPES[name]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if kind == "BYTES":
            values = [str(v).encode("utf-8") for v in values]
        array = np.array(values, dtype=NUMPY_TYPES[kind])
        tensor = make_input(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def read_outputs(get: Callable[[str], object]) -> dict:
    """A response's outputs as plain values; ``get(name)`` gives a JSON value, an array or None."""
    out = {}
    for name in OUTPUTS:
        value = get(name)
        if value is None:
            continue
        if name == "output_ids":   # a JSON list, a JSON number (one token) or an array
            out[name] = [int(v) for v in np.asarray(value).reshape(-1)]
            continue
        if isinstance(value, np.ndarray):
            value = value.reshape(-1)[0] if value.size else None
        if isinstance(value, (bytes, np.bytes_)):
            value = bytes(value).decode("utf-8", errors="replace")
        if name == "accepted_tokens_per_step":
            value = [int(v) for v in str(value or "").split(",") if v]
        elif name.startswith("total_"):
            value = int(value)
        out[name] = value
    return out


def to_result(outputs: dict) -> Result:
    return Result(outputs.get("text_output", ""), outputs.get("accepted_tokens_per_step", []),
                  outputs.get("total_draft_tokens", 0), outputs.get("total_accepted_draft_tokens", 0),
                  outputs.get("output_ids", []))


def split_url(url: str | None, protocol: str) -> tuple[str, int]:
    """``host:port`` (a scheme such as ``http://`` is dropped; no port: Triton's default for the protocol)."""
    if protocol not in DEFAULT_PORTS:
        raise ClientError(f"unknown protocol '{protocol}' (http or grpc)")
    url = (url or "localhost").split("://", 1)[-1].rstrip("/")
    host, _, port = url.rpartition(":") if ":" in url else (url, "", "")
    try:
        return host.strip("[]") or "localhost", int(port) if port else DEFAULT_PORTS[protocol]
    except ValueError:
        raise ClientError(f"bad server address '{url}' (expected host:port)") from None
