"""The client-facing orchestrator (``ensemble``, ``ensemble_fused``, ``ensemble_sync``), as plain Python.

:class:`Orchestrator` (text in and out) runs :func:`specinfer.generate.decode` over a
:class:`RemoteSpeculator`, whose step is one call of the ``spec_step`` ensemble (the models of
:mod:`specinfer.serving.models`), or over a ``LocalSpeculator`` (fused).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..generate import DEFAULT_BUDGET, Stats, decode
from ..sampling import SamplingParams
from ..text import TextStream, decode_piece
from ..speculate import parse_tree
from ..tree import TokenTree
from .models import CALLER_KEY, tree_to_tensors
from .request import GenerationRequest, Tensors, read_request

log = logging.getLogger(__name__)


# --- the orchestrator --------------------------------------------------------------------------------
class RemoteSpeculator:
    """A Speculator whose models live elsewhere: ``call(model, inputs) -> outputs`` reaches them
    (Triton BLS in the server; plain method calls in tests).

    A speculative step is one call of ``spec_step``. Incremental decoding (tree ``"none"``) has
    nothing to draft: its sequence lives in the ``llm`` model alone, and each step is one call of
    it with the root as the whole tree (one model hop instead of the drafters', ``tree_builder``'s
    and the LLM's)."""

    def __init__(self, call: Callable[[str, Tensors], Tensors], ssm_names: list[str], seq_id: str,
                 max_context: int, params: SamplingParams, tree: str | None, stats: Stats, key: str | None = None,
                 rule: str = "mss", max_tokens: int | None = None):
        """``max_tokens``: the request's, which sizes the KV the ``llm`` model reserves for it."""
        self.call, self.ssm_names, self.seq_id, self.key, self.rule = call, ssm_names, seq_id, key, rule
        self.max_tokens = max_tokens
        self.max_context, self.params, self.tree, self.stats = max_context, params, tree, stats
        self.started: list[str] = []
        self.last_path: list[int] = []
        self.incremental = parse_tree(tree) == []   # tree "none" (None, the dynamic tree, parses to None)

    def _common(self, op: str) -> Tensors:
        t = {"op": np.array([op.encode()], dtype=object), "sequence_id": np.array([self.seq_id.encode()], dtype=object),
             "temperature": np.array([self.params.temperature], dtype=np.float32),
             "top_k": np.array([self.params.top_k], dtype=np.int32),
             "top_p": np.array([self.params.top_p], dtype=np.float32)}
        if self.params.seed is not None:
            t["random_seed"] = np.array([self.params.seed], dtype=np.uint64)
        if self.key is not None:
            t[CALLER_KEY] = np.array([self.key.encode()], dtype=object)
        return t

    def start(self, prefix: list[int]) -> None:
        inputs = self._common("start") | {"tokens": np.asarray(prefix, dtype=np.int64)}
        # The llm model verifies with the rule the sequence starts with, and reserves its KV.
        llm = inputs | {"rule": np.array([self.rule.encode()], dtype=object)}
        if self.max_tokens is not None:
            llm["max_tokens"] = np.array([self.max_tokens], dtype=np.int32)
        for name in ["llm"] + ([] if self.incremental else self.ssm_names):
            self.call(name, llm if name == "llm" else inputs)
            self.started.append(name)

    def step(self, root: int, budget: int) -> tuple[list[int], int]:
        if self.incremental:
            out = self.call("llm", self._common("step") | tree_to_tensors(TokenTree(root), 0))
        else:
            inputs = self._common("step") | {"tokens": np.asarray(self.last_path, dtype=np.int64),
                                             "root": np.array([root], dtype=np.int64),
                                             "budget": np.array([budget], dtype=np.int32)}
            if self.tree:
                inputs["tree"] = np.array([self.tree.encode()], dtype=object)
            out = self.call("spec_step", inputs)
        path = [int(t) for t in np.asarray(out["accepted_tokens"]).reshape(-1)]
        self.stats.draft_tokens += int(np.asarray(out["draft_tokens"]).reshape(-1)[0])
        self.stats.accepted_draft_tokens += len(path) - 1
        self.last_path = path
        return path, int(np.asarray(out["bonus"]).reshape(-1)[0])

    def release(self) -> None:
        inputs = self._common("release")
        for name in self.started:
            try:
                self.call(name, inputs)
            except Exception as e:  # noqa: BLE001 - release every model even if one fails; the model
                # reclaims the sequence once idle, and the log says why it was left
                log.warning("releasing sequence %s in %s failed: %s", self.seq_id, name, e)
        self.started = []


@dataclass
class Piece:
    """One response of the orchestrator: ids whose text is final, and the stats so far."""

    context_ids: list[int]
    output_ids: list[int]
    stats: Stats
    final: bool


STREAMED_OUTPUTS = ("text_output", "output_ids")   # what a response adds to the ones before it


def merge_responses(responses: list[Tensors]) -> Tensors:
    """Consecutive responses of one request as one: their text and ids joined, the statistics of
    the last (they are cumulative, sent with the final response only)."""
    merged = dict(responses[-1])
    for name in STREAMED_OUTPUTS:
        parts = [np.asarray(r[name]).reshape(-1) for r in responses]
        merged[name] = (np.array([b"".join(p[0] for p in parts)], dtype=object) if parts[0].dtype == object
                        else np.concatenate(parts))
    return merged


def stats_tensors(stats: Stats) -> Tensors:
    return {
        "accepted_tokens_per_step": np.array([",".join(map(str, stats.tokens_per_step)).encode()], dtype=object),
        "total_draft_tokens": np.array([stats.draft_tokens], dtype=np.int32),
        "total_accepted_draft_tokens": np.array([stats.accepted_draft_tokens], dtype=np.int32),
    }


def run_request(speculator, request: GenerationRequest, tokenizer, eos_ids: list[int],
                budget: int = DEFAULT_BUDGET, cancelled: Callable[[], bool] = lambda: False,
                stats: Stats | None = None) -> Iterator[Piece]:
    """Drive one request: stream pieces as their text becomes final (UTF-8 safe), stop at EOS,
    ``end_id``, a stop word (the output ends with the token that completes it), ``max_tokens`` or a
    cancellation; or, unstreamed, one final piece. The text of the step that reaches EOS or
    ``max_tokens`` comes in the final piece, not in one of its own."""
    stats = stats if stats is not None else Stats()
    eos = [request.end_id] if request.end_id is not None else list(eos_ids)
    stream, text = TextStream(tokenizer), ""
    produced: list[int] = []
    longest = max((len(w) for w in request.stop_words), default=0)
    generation = decode(speculator, request.prompt, request.max_tokens, eos, budget, stats)
    held: tuple[list[int], list[int]] | None = None   # the last step's piece, sent with the final one
    try:
        for ids in generation:
            context, ready, stop = None, [], False
            for token in ids:  # token by token, so that a stop word ends the output where it ends
                produced.append(token)
                piece = stream.push([token])
                if piece:
                    context = stream.window[0] if context is None else context
                    ready += stream.window[1]
                    start = max(0, len(text) - longest + 1)
                    text += piece
                    if any(w in text[start:] for w in request.stop_words):
                        stats.stop_reason, stop = "stop word", True
                        break
            # decode ends after a step that reached EOS or max_tokens: that step's piece goes out
            # with the final response, one response fewer (each costs the served stream ~1 ms).
            if not stop and produced and (produced[-1] in eos or len(produced) >= request.max_tokens):
                held = (context, ready) if ready else None
                break
            if request.stream and ready:
                yield Piece(context, ready, stats, final=False)
            if stop:
                break
            if cancelled():
                stats.stop_reason = "cancelled"
                break
    finally:
        generation.close()  # releases every model's state, whatever ended the loop
    if not request.stream:
        ids = produced if request.exclude_input else request.prompt + produced
        yield Piece([], ids, stats, final=True)
        return
    stream.flush()
    context, tail = stream.window
    yield Piece(held[0], held[1] + tail, stats, final=True) if held else Piece(context, tail, stats, final=True)


class Orchestrator:
    """The client-facing model (``ensemble``, ``ensemble_fused``, ``ensemble_sync``): text in,
    speculation loop, text out. Tokenizing and detokenizing in the same process as the loop is
    what lets a client's cancel reach the loop (Triton does not pass a cancel on to a request that
    an ensemble step already runs)."""

    def __init__(self, tokenizer, max_context: int, eos_ids: list[int], vocab_size: int,
                 make_speculator: Callable[[GenerationRequest, Stats], object], budget: int = DEFAULT_BUDGET):
        self.tokenizer, self.max_context, self.eos_ids = tokenizer, max_context, list(eos_ids)
        self.vocab_size, self.make_speculator, self.budget = vocab_size, make_speculator, budget

    def read_request(self, inputs: Tensors) -> GenerationRequest:
        """The request the tensors ask for, checked (a :class:`RequestError` names what is wrong)."""
        return read_request(inputs, self.max_context, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def run(self, inputs: Tensors, cancelled: Callable[[], bool] = lambda: False,
            stats: Stats | None = None) -> Iterator[tuple[Tensors, bool]]:
        """Yield (response tensors, final) pairs; the last one is final."""
        request = self.read_request(inputs)
        stats = stats if stats is not None else Stats()
        speculator = self.make_speculator(request, stats)
        for piece in run_request(speculator, request, self.tokenizer, self.eos_ids, self.budget, cancelled, stats):
            # The statistics are cumulative: sent once, with the final response (and empty before it,
            # so that every response has every output).
            stats_out = stats_tensors(piece.stats if piece.final else Stats())
            text = decode_piece(self.tokenizer, piece.context_ids, piece.output_ids)
            yield ({"text_output": np.array([text.encode()], dtype=object),
                    "output_ids": np.asarray(piece.output_ids, dtype=np.int64)} | stats_out, piece.final)
