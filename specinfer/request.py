"""A generation request as Triton's LLM clients send it: reading and checking its tensors.

Request tensors use the names Triton's LLM clients already send (``text_input``, ``max_tokens``,
``stream``, ``temperature``, ``top_k``, ``top_p``, ``random_seed``, ``end_id``, ``stop_words``,
``exclude_input_in_output``) plus ours (``tree``). Every problem is a :class:`SpecInferError`
that names the input.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import SpecInferError
from .generate import check_request
from .sampling import SamplingParams
from .speculate import DYNAMIC, parse_tree
from .text import decode_piece

Tensors = dict[str, np.ndarray]
MAX_STOP_WORDS = 16


# --- reading request tensors ---------------------------------------------------------------------
def scalar(inputs: Tensors, name: str, kind: str, default):
    """One value from an optional [1] tensor of the right kind ('i', 'f', 'b'), else an error."""
    if name not in inputs or inputs[name] is None:
        return default
    a = np.asarray(inputs[name])
    if a.size != 1:
        raise SpecInferError(f"'{name}' must hold one value, got shape {list(a.shape)}")
    kinds = {"i": "iu", "f": "fiu", "b": "b"}[kind]
    if a.dtype.kind not in kinds:
        raise SpecInferError(f"'{name}' has the wrong type {a.dtype} (expected {dict(i='an integer', f='a number', b='a bool')[kind]})")
    value = a.reshape(-1)[0]
    return {"i": int, "f": float, "b": bool}[kind](value)


def as_text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecInferError(f"'{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise SpecInferError(f"'{name}' must be text (BYTES), got {type(value).__name__}")


def text_input(inputs: Tensors) -> str:
    if inputs.get("text_input") is None:
        raise SpecInferError("missing input 'text_input'")
    a = np.asarray(inputs["text_input"], dtype=object)
    if a.size != 1:
        raise SpecInferError(f"'text_input' must hold one string, got shape {list(a.shape)}")
    text = as_text(a.reshape(-1)[0], "text_input")
    if not text:
        raise SpecInferError("'text_input' is empty")
    return text


@dataclass
class GenerationRequest:
    """One generation request as the orchestrator reads it."""

    prompt: list[int]
    max_tokens: int = 128
    stream: bool = False
    params: SamplingParams = SamplingParams()
    end_id: int | None = None
    stop_words: list[str] = field(default_factory=list)
    exclude_input: bool = False
    tree: str | None = None       # a tree spec ("dynamic" or widths), None: the server's default


def read_request(inputs: Tensors, max_context: int) -> GenerationRequest:
    """Validate the orchestrator's inputs; every problem is a SpecInferError naming the input."""
    if inputs.get("input_ids") is None:
        raise SpecInferError("missing input 'input_ids'")
    ids = np.asarray(inputs["input_ids"])
    if ids.dtype.kind not in "iu":
        raise SpecInferError(f"'input_ids' must be integers, got {ids.dtype}")
    prompt = [int(t) for t in ids.reshape(-1)]
    max_tokens = scalar(inputs, "max_tokens", "i", 128)
    if not 1 <= max_tokens <= max_context:
        raise SpecInferError(f"'max_tokens' must be in 1..{max_context} (the context), got {max_tokens}")
    check_request(prompt, max_tokens, max_context)
    params = SamplingParams(temperature=scalar(inputs, "temperature", "f", 0.0),
                            top_k=scalar(inputs, "top_k", "i", 0), top_p=scalar(inputs, "top_p", "f", 1.0),
                            seed=scalar(inputs, "random_seed", "i", None))
    stops = []
    if inputs.get("stop_words") is not None:
        stops = [as_text(w, "stop_words") for w in np.asarray(inputs["stop_words"], dtype=object).reshape(-1)]
        stops = [w for w in stops if w]
        if len(stops) > MAX_STOP_WORDS:
            raise SpecInferError(f"at most {MAX_STOP_WORDS} stop words, got {len(stops)}")
    tree = None
    if inputs.get("tree") is not None:
        tree = tree_spec(inputs)
    return GenerationRequest(prompt, max_tokens, scalar(inputs, "stream", "b", False), params,
                             scalar(inputs, "end_id", "i", None), stops,
                             scalar(inputs, "exclude_input_in_output", "b", False), tree)


def tree_spec(inputs: Tensors) -> str:
    """The ``tree`` input, checked: ``dynamic`` or widths per depth."""
    spec = as_text(np.asarray(inputs["tree"], dtype=object).reshape(-1)[0], "tree")
    widths = parse_tree(spec)
    return DYNAMIC if widths is None else ",".join(map(str, widths))


def sampling_from(inputs: Tensors) -> SamplingParams:
    return SamplingParams(scalar(inputs, "temperature", "f", 0.0), scalar(inputs, "top_k", "i", 0),
                          scalar(inputs, "top_p", "f", 1.0), scalar(inputs, "random_seed", "i", None))


# --- pre- and postprocessing -----------------------------------------------------------------------
def preprocess(tokenizer, inputs: Tensors) -> Tensors:
    return {"input_ids": np.asarray(tokenizer.encode(text_input(inputs)).ids, dtype=np.int64)}


def postprocess(tokenizer, inputs: Tensors) -> Tensors:
    context = [int(t) for t in np.asarray(inputs.get("context_ids", np.zeros(0))).reshape(-1)]
    ids = [int(t) for t in np.asarray(inputs["output_ids"]).reshape(-1)]
    return {"text_output": np.array([decode_piece(tokenizer, context, ids).encode()], dtype=object)}
