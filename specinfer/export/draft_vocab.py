"""An SSM's draft vocabulary: the tokens its drafts are drawn from (after FR-Spec, Zhao et al. 2025).

A small SSM's LM head is most of its work: SSM 1's is 64 x 8192 of its ~0.6M weights, and with
the top-k and the probability mass over the whole vocabulary it was ~40% of a draft step. Text
is mostly frequent tokens (the embedded LLM's continuations of code it never saw: 99% of them
among the 2048 tokens most frequent in its training corpus), so a drafter that scores only
those keeps nearly every draft it would have made, at a fraction of the head's cost.

The vocabulary is a file beside the SSM's checkpoint (``draft_vocab.json``: the token ids, most
frequent first, and where they were counted); exports and engine builds carry it along, and
every runtime's ``draft_chain`` draws from it. It changes only which tokens are proposed, never
what is accepted: greedy verification takes any draft, and a sampled draft's proposal is the
distribution it was drawn from (over the candidates within the vocabulary), which verification
corrects exactly. Scoring a tree (``Runtime.score``) keeps the whole vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from ..errors import SpecInferError

DRAFT_VOCAB = "draft_vocab.json"
DRAFT_VOCAB_SIZE = 2048   # tokens kept by `specinfer draft-vocab` unless told otherwise


def token_counts(tokenizer, texts: Iterable[str], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in ``texts`` as ``tokenizer`` (a ``tokenizers.Tokenizer``)
    encodes them; int64 [vocab_size]."""
    counts = np.zeros(vocab_size, np.int64)
    for text in texts:
        ids = np.asarray(tokenizer.encode(text).ids, np.int64)
        counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def most_frequent(counts: np.ndarray, size: int) -> list[int]:
    """The ``size`` most frequent token ids, most frequent first (ties to the lower id)."""
    if not 2 <= size <= len(counts):
        raise SpecInferError(f"a draft vocabulary needs 2..{len(counts)} tokens, got {size}")
    return [int(t) for t in np.lexsort((np.arange(len(counts)), -counts))[:size]]


def write_draft_vocab(model_dir: str | Path, token_ids: list[int], source: str) -> Path:
    """Write ``model_dir/draft_vocab.json``: ``token_ids`` (most frequent first) and ``source``,
    a line saying what they were counted on."""
    path = Path(model_dir) / DRAFT_VOCAB
    path.write_text(json.dumps({"source": source, "size": len(token_ids), "token_ids": token_ids}) + "\n")
    return path


def read_draft_vocab(model_dir: str | Path, vocab_size: int) -> np.ndarray | None:
    """The draft vocabulary in ``model_dir`` as sorted token ids (int64), or None without one.
    A file that is not a list of distinct ids within the model's vocabulary is refused, naming
    the problem."""
    path = Path(model_dir) / DRAFT_VOCAB
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise SpecInferError(f"{path}: not a draft vocabulary (a JSON object with a list 'token_ids'): {e}") from None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise SpecInferError(f"{path}: 'token_ids' must be a list of integer token ids")
    if len(ids) < 2:   # a draft step names its best token and a runner-up
        raise SpecInferError(f"{path}: 'token_ids' must list at least 2 token ids, found {len(ids)}")
    array = np.asarray(ids, dtype=np.int64)
    if array.min() < 0 or array.max() >= vocab_size:
        raise SpecInferError(f"{path}: token ids must lie in 0..{vocab_size - 1}, found {array.min()}..{array.max()}")
    if len(np.unique(array)) != len(array):
        raise SpecInferError(f"{path}: 'token_ids' lists a token twice")
    return np.sort(array)   # sorted, so that ties between equal logits go to the lower id everywhere
