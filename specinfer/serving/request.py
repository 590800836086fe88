"""A generation request as Triton's LLM clients send it: reading and checking its tensors.

Request tensors use the names Triton's LLM clients already send (``text_input``, ``max_tokens``,
``stream``, ``temperature``, ``top_k``, ``top_p``, ``random_seed``, ``end_id``, ``stop_words``,
``exclude_input_in_output``) plus ours (``tree``). Every problem is a :class:`RequestError` that
names the input and, for a value out of range, the range: each field is checked before any work
is done for the request (a text too long to fit is refused before it is tokenized).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import RequestError, SpecInferError
from ..generate import check_request
from ..sampling import SamplingParams
from ..speculate import DYNAMIC, NONE, parse_tree
from ..verify import SAMPLING_RULES

Tensors = dict[str, np.ndarray]
MAX_STOP_WORDS = 16
MAX_STOP_WORD_BYTES = 256
MAX_SEED = 2**63 - 1           # a JSON -1 arrives as 2**64 - 1 in the UINT64 input: refused, not wrapped
MAX_TREE_SPEC_BYTES = 256      # bounds the parsing of a tree spec
MAX_TREE_DEPTH = 64            # deeper or wider than any node budget a server uses (default 64 nodes)
MAX_TREE_WIDTH = 256


# --- reading request tensors ---------------------------------------------------------------------
def scalar(inputs: Tensors, name: str, kind: str, default):
    """One value from an optional [1] tensor of the right kind ('i', 'f', 'b'), else an error."""
    if name not in inputs or inputs[name] is None:
        return default
    a = np.asarray(inputs[name])
    if a.size != 1:
        raise RequestError(f"'{name}' must hold one value, got shape {list(a.shape)}")
    kinds = {"i": "iu", "f": "fiu", "b": "b"}[kind]
    if a.dtype.kind not in kinds:
        raise RequestError(f"'{name}' has the wrong type {a.dtype} (expected {dict(i='an integer', f='a number', b='a bool')[kind]})")
    value = a.reshape(-1)[0]
    return {"i": int, "f": float, "b": bool}[kind](value)


def as_text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"'{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"'{name}' must be text (BYTES), got {type(value).__name__}")


def _size(value) -> int:
    """The size in bytes of a BYTES element, before it is decoded."""
    return len(value) if isinstance(value, (bytes, np.bytes_)) else len(str(value).encode())


def _one_string(inputs: Tensors, name: str):
    """The one element of a [1] BYTES input (still bytes: its size can be checked before decoding)."""
    if inputs.get(name) is None:
        raise RequestError(f"missing input '{name}'")
    a = np.asarray(inputs[name], dtype=object)
    if a.size != 1:
        raise RequestError(f"'{name}' must hold one string, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


def _prompt_text(value) -> str:
    text = as_text(value, "text_input")
    if not text:
        raise RequestError("'text_input' is empty")
    return text


_LONGEST: dict[int, tuple[object, int]] = {}   # id(tokenizer) -> (the tokenizer, kept alive so its id stays its own, L)


def longest_token_bytes(tokenizer) -> int:
    """L, the most bytes of text one token of ``tokenizer`` stands for (computed once per tokenizer).

    A tokenizer that keeps every byte of its input (byte-level BPE, SentencePiece) makes at least
    B / L tokens of a B-byte text. Each token's UTF-8 length bounds the bytes it stands for from
    above (a byte-level symbol such as 'Ġ' is two bytes for one), so L errs on the generous side."""
    entry = _LONGEST.get(id(tokenizer))
    if entry is None:
        longest = max(len(token.encode()) for token in tokenizer.get_vocab(with_added_tokens=True))
        entry = _LONGEST[id(tokenizer)] = (tokenizer, longest)
    return entry[1]


def prompt_from_text(inputs: Tensors, tokenizer, max_context: int) -> list[int]:
    """``text_input`` tokenized, unless its size in bytes alone shows that it cannot fit the context
    (tokenizing megabytes takes seconds, which other requests would wait for)."""
    value = _one_string(inputs, "text_input")
    size, limit = _size(value), max_context * longest_token_bytes(tokenizer)
    if size > limit:
        raise RequestError(f"'text_input' is {size} bytes; at most {limit} bytes can fit the context of "
                           f"{max_context} tokens")
    return tokenizer.encode(_prompt_text(value)).ids


def prompt_from_ids(inputs: Tensors, vocab_size: int | None) -> np.ndarray:
    """``input_ids``: token ids, in the vocabulary when its size is known."""
    if inputs.get("input_ids") is None:
        raise RequestError("missing input 'input_ids'")
    ids = np.asarray(inputs["input_ids"]).reshape(-1)
    if ids.dtype.kind not in "iu":
        raise RequestError(f"'input_ids' must be integers, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)] if vocab_size is not None else ids[ids < 0]
    if len(bad):
        allowed = ">= 0" if vocab_size is None else f"in 0..{vocab_size - 1}"
        raise RequestError(f"'input_ids' must be token ids {allowed}, got {bad[0]}")
    return ids


def _in_range(name: str, value: int | None, low: int, high: int | None, note: str = "") -> int | None:
    """``value`` if it is None or in low..high (high None: unbounded), else an error naming the range."""
    if value is None or (low <= value and (high is None or value <= high)):
        return value
    allowed = f">= {low}" if high is None else f"in {low}..{high}"
    raise RequestError(f"'{name}' must be {allowed}{note}, got {value}")


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
    rule: str = "mss"             # the verification rule under sampling (verify.SAMPLING_RULES)


def read_request(inputs: Tensors, max_context: int, *, tokenizer=None,
                 vocab_size: int | None = None) -> GenerationRequest:
    """Validate a generation request; every problem is a RequestError naming the input.

    With a ``tokenizer``, the prompt is ``text_input`` (one non-empty UTF-8 string; refused before
    it is tokenized when its size alone shows that it cannot fit), unless only ``input_ids`` is
    sent; without one, ``input_ids``. With ``vocab_size``, token ids, ``end_id`` and ``top_k`` are
    checked against the vocabulary. The cheap checks come first, tokenizing last."""
    max_tokens = _in_range("max_tokens", scalar(inputs, "max_tokens", "i", 128), 1, max_context, " (the context)")
    params = sampling_from(inputs, vocab_size)
    top = None if vocab_size is None else vocab_size - 1
    end_id = _in_range("end_id", scalar(inputs, "end_id", "i", None), 0, top, " (a token id)")
    stops = stop_words(inputs)
    tree = tree_spec(inputs) if inputs.get("tree") is not None else None
    rule = verification_rule(inputs)
    if tokenizer is not None and (inputs.get("text_input") is not None or inputs.get("input_ids") is None):
        prompt = prompt_from_text(inputs, tokenizer, max_context)
    else:
        prompt = prompt_from_ids(inputs, vocab_size)
    try:
        check_request(prompt, max_tokens, max_context)
    except SpecInferError as e:
        raise RequestError(str(e)) from None
    return GenerationRequest([int(t) for t in prompt], max_tokens, scalar(inputs, "stream", "b", False), params,
                             end_id, stops, scalar(inputs, "exclude_input_in_output", "b", False), tree, rule)


def stop_words(inputs: Tensors) -> list[str]:
    """The non-empty ``stop_words``: at most MAX_STOP_WORDS, each at most MAX_STOP_WORD_BYTES."""
    if inputs.get("stop_words") is None:
        return []
    words = np.asarray(inputs["stop_words"], dtype=object).reshape(-1)
    if len(words) > MAX_STOP_WORDS:
        raise RequestError(f"'stop_words' holds {len(words)} words; at most {MAX_STOP_WORDS}")
    for i, w in enumerate(words):
        if _size(w) > MAX_STOP_WORD_BYTES:
            raise RequestError(f"'stop_words' word {i} is {_size(w)} bytes; at most {MAX_STOP_WORD_BYTES}")
    return [w for w in (as_text(w, "stop_words") for w in words) if w]


def tree_spec(inputs: Tensors) -> str:
    """The ``tree`` input, checked: ``dynamic`` or widths per depth (at most MAX_TREE_DEPTH depths
    of at most MAX_TREE_WIDTH children)."""
    value = _one_string(inputs, "tree")
    if _size(value) > MAX_TREE_SPEC_BYTES:
        raise RequestError(f"'tree' is {_size(value)} bytes; at most {MAX_TREE_SPEC_BYTES}")
    try:
        widths = parse_tree(as_text(value, "tree"))
    except SpecInferError as e:
        raise RequestError(str(e)) from None
    if widths is None:
        return DYNAMIC
    if not widths:
        return NONE
    if len(widths) > MAX_TREE_DEPTH or max(widths) > MAX_TREE_WIDTH:
        raise RequestError(f"'tree' may have at most {MAX_TREE_DEPTH} depths of widths in 1..{MAX_TREE_WIDTH}, "
                           f"got {len(widths)} depths, widest {max(widths)}")
    return ",".join(map(str, widths))


def verification_rule(inputs: Tensors) -> str:
    """The ``rule`` input: how a sampled tree is verified ("mss" when absent)."""
    if inputs.get("rule") is None:
        return "mss"
    value = _one_string(inputs, "rule")
    rule = as_text(value, "rule") if _size(value) <= 16 else None
    if rule not in SAMPLING_RULES:
        got = repr(rule) if rule is not None else f"{_size(value)} bytes"
        raise RequestError(f"'rule' must be one of {', '.join(SAMPLING_RULES)}, got {got}")
    return rule


def sampling_from(inputs: Tensors, vocab_size: int | None = None) -> SamplingParams:
    """``temperature``, ``top_k``, ``top_p`` and ``random_seed``, each checked against its range."""
    temperature = scalar(inputs, "temperature", "f", 0.0)
    if not (temperature >= 0 and math.isfinite(temperature)):   # a JSON 1e39 arrives as inf in FP32
        raise RequestError(f"temperature must be >= 0 and finite, got {temperature}")
    top_k = _in_range("top_k", scalar(inputs, "top_k", "i", 0), 0, vocab_size, " (0: no top-k cut)")
    top_p = scalar(inputs, "top_p", "f", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    seed = _in_range("random_seed", scalar(inputs, "random_seed", "i", None), 0, MAX_SEED)
    return SamplingParams(temperature, top_k, top_p, seed)
