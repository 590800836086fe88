"""The Runtime interface: the seam between speculation/verification and whatever runs the model.

A sequence's KV cache is one buffer ``kv[layer, key|value, slot, kv_head, head_dim]`` allocated once
up to its capacity. Slots ``[0, length)`` hold the committed tokens. Every :meth:`Runtime.score`
call appends *pending* tree nodes after them: their KV is written to the next free slots, and each
pending node attends to the committed prefix and to its pending ancestors (possibly scored by an
earlier call, which is how a speculative model grows its tree one depth per call).
:meth:`Runtime.commit` keeps one root-to-leaf path of pending nodes: their KV moves down to slots
``length, length + 1, ...`` (a copy of only the accepted tokens, never of the cache) and every other
pending node is dropped.

Cost of a step: the model's forward over T new tokens reads the S cached tokens' KV once per layer
(attention is O(T * S)); nothing else scales with S. Commit copies ``len(path)`` tokens' KV.
"""
from __future__ import annotations

import abc
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, NamedTuple, Sequence

import numpy as np

from ..config import ModelConfig
from ..errors import SpecInferError
from ..plugins.tree_attention import ancestor_matrix


class ChainDraft(NamedTuple):
    """A chain drafted by :meth:`Runtime.draft_chain`: greedy, with each depth's runner-up, or
    sampled, with each depth's candidates."""

    tokens: list[int]                 # the chain: each the argmax (or the draw) after the ones before
    probability: list[float]          # greedy: each token's probability under the model (temperature 1)
    runner_up: list[int]              # greedy: at each depth, the second most likely token (a sibling of tokens[i])
    runner_up_probability: list[float]
    candidates: list[np.ndarray]      # sampled: at each depth, the tokens drawn among, likeliest first
    candidate_logits: list[np.ndarray]   # sampled: their logits (temperature 1), float32


class ChainSampling(NamedTuple):
    """How :meth:`Runtime.decode_chain` draws under sampling: step i's token from softmax(logits /
    ``temperature``) by the inverse CDF at ``uniforms[i]`` (``sampling.draw``'s draw, no top-k or
    top-p cut), where greedy decoding takes the argmax."""

    temperature: float
    uniforms: np.ndarray   # float64 [>= depth], each in [0, 1)


def chain_draw(logits: np.ndarray, noise: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """A sampled chain's step: the ``len(noise)`` likeliest tokens (ties to the lower id) and the
    one drawn among them by Gumbel-max, the argmax of their logits plus ``noise`` (temperature x
    Gumbel(0, 1) noise: the draw follows softmax(logits / temperature) over them). Returns the
    drawn token, the candidates and their logits."""
    candidates = np.asarray(top_tokens(logits, len(noise)), dtype=np.int64)   # all of a smaller vocabulary
    top = np.asarray(logits, dtype=np.float32)[candidates]
    return int(candidates[int(np.argmax(top + noise[:len(candidates)]))]), candidates, top


def top_tokens(logits: np.ndarray, k: int) -> list[int]:
    """The k largest logits' tokens, best first, ties to the lower id (as argmax breaks them)."""
    k = min(k, len(logits))
    if k == 1:  # the common case (chains): argmax already takes the lowest id among ties
        return [int(np.argmax(logits))]
    part = np.argpartition(-logits, k - 1)[:k]  # O(V), not a full sort of the vocabulary
    return [int(t) for t in part[np.lexsort((part, -logits[part]))]]


def chain_step(logits: np.ndarray) -> tuple[int, float, int, float]:
    """The two most likely tokens of one position's logits and their probabilities (temperature 1),
    ties to the lower id (as argmax breaks them)."""
    first = int(np.argmax(logits))
    rest = logits.copy()
    rest[first] = -np.inf
    second = int(np.argmax(rest))
    mass = float(np.exp(logits - logits[first]).sum())
    return first, 1.0 / mass, second, float(np.exp(logits[second] - logits[first])) / mass


KV_DTYPES = ("float32", "float16")   # what a KV cache may hold (float16: ONNX Runtime's native kernels only)


def check_kv_dtype(kv_dtype: str) -> None:
    """Refuse a KV cache type that is none of :data:`KV_DTYPES`, naming it."""
    if kv_dtype not in KV_DTYPES:
        raise SpecInferError(f"KV cache type must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")


# What an LLM's matrix products compute in: float32 (the stored weights, exactly), bfloat16
# (weights and activations rounded to bfloat16, sums in float32, as a GPU's bfloat16 products;
# ONNX Runtime's native kernels on a CPU with AVX512-BF16 only), or int8 (weights quantized per
# column, activations per row, sums exact in int32; native kernels, by AVX512-VNNI or AVX2).
MATMUL_DTYPES = ("float32", "bfloat16", "int8")


def check_matmul_dtype(matmul_dtype: str) -> None:
    """Refuse a product type that is none of :data:`MATMUL_DTYPES`, naming it."""
    if matmul_dtype not in MATMUL_DTYPES:
        raise SpecInferError(f"matrix product type must be one of {', '.join(MATMUL_DTYPES)}, got {matmul_dtype!r}")


@dataclass
class SequenceState:
    """One sequence's state: its KV buffer, committed length and pending tree."""

    kv: Any                     # [L, 2, capacity, Hkv, D], numpy array or torch tensor
    capacity: int               # slots allocated now
    limit: int                  # slots it may grow to (its start's ``capacity``)
    length: int = 0             # committed tokens
    parents: list[int] = field(default_factory=list)   # pending nodes' parents (-1 = the prefix)
    depths: list[int] = field(default_factory=list)
    bindings: dict = field(default_factory=dict)   # an engine's per-sequence handles (ONNX Runtime: IOBindings)
    trims: int = 0              # the runtime's trims when it started (Runtime.release)

    @property
    def pending(self) -> int:
        return len(self.parents)


class Runtime(abc.ABC):
    """Prefill, score a tree, commit a path, release: for many sequences, keyed by id."""

    config: ModelConfig
    max_context: int
    # Draft tokens one draft_chain call makes at its cheapest: a drafter asks in chunks of this
    # many and decides between chunks whether to go on (the base class drafts token by token).
    draft_depth: int = 1
    # Candidates a sampled draft_chain draws among at each depth (the likeliest; see chain_draw).
    draft_candidates: int = 16
    # The tokens draft_chain drafts from (sorted ids; None: every token): the model's draft
    # vocabulary (specinfer/export/draft_vocab.py), read from its folder by each engine.
    draft_vocab: np.ndarray | None = None
    # Slots a sequence's KV buffer starts with; it doubles as the sequence grows, up to the capacity
    # asked at start. None: the whole capacity at once (an engine that cannot move its buffers).
    initial_slots: int | None = None
    slot_axis: int = 2          # the KV buffer's slot axis (growth copies the committed slots)
    # Whether decode_chain draws a sampled chain in one run (the engine's graph draws each token),
    # not a call a token: sampled incremental decoding then takes its tokens as greedy does.
    samples_chains: bool = False
    # Released sequences kept, buffer and handles, for the next starts (at most this many; 0: none):
    # an engine's per-sequence handles are then made once, not per request (ONNX Runtime binds a
    # sequence's cache to each session it runs, ~0.2 ms a binding, about ten a request of the
    # dynamic tree on the embedded pair). Not counted in :meth:`kv_bytes` (no sequence holds them);
    # :meth:`trim` drops them.
    spare_sequences: int = 0

    def __init__(self, config: ModelConfig, max_context: int):
        self.config = config
        self.max_context = max_context
        self._sequences: dict[Hashable, SequenceState] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._spare: list[SequenceState] = []
        self._trims = 0   # trims so far: a sequence open across one is not kept (below)

    # --- what an implementation provides ---------------------------------------------------------
    @abc.abstractmethod
    def _allocate(self, capacity: int) -> Any:
        """A zeroed KV buffer [L, 2, capacity, Hkv, D]."""

    @abc.abstractmethod
    def _forward(self, seq: SequenceState, tokens: np.ndarray, positions: np.ndarray,
                 visible: np.ndarray) -> np.ndarray:
        """Run the model on T new tokens over the cache's first ``start`` slots (start = committed +
        pending before this call), write their KV to slots ``[start, start + T)``, return float32
        [T, V]. ``visible`` is the pending tree's ancestor matrix, bool [N, N] (N = pending + T, its
        first node at slot ``seq.length``; :func:`pack_bits` gives the graphs' packed form)."""

    # --- the interface ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def start(self, seq_id: Hashable | None = None, capacity: int | None = None) -> Hashable:
        """Open a sequence (an id is made if none is given) with room for ``capacity`` tokens."""
        capacity = self.max_context if capacity is None else capacity
        if not 0 < capacity <= self.max_context:
            raise SpecInferError(f"capacity {capacity} is outside 1..{self.max_context} (the exported max context)")
        slots = capacity if self.initial_slots is None else min(capacity, self.initial_slots)
        with self._lock:
            if seq_id is None:
                seq_id = next(self._ids)
            if seq_id in self._sequences:
                raise SpecInferError(f"sequence {seq_id!r} is already open")
            spare = next((i for i, s in enumerate(self._spare) if slots <= s.capacity <= capacity), None)
            if spare is None:
                seq = self._sequences[seq_id] = SequenceState(self._allocate(slots), slots, capacity)
            else:
                seq = self._sequences[seq_id] = self._spare.pop(spare)
                seq.limit = capacity
            seq.trims = self._trims
        return seq_id

    def release(self, seq_id: Hashable) -> None:
        """Free a sequence's KV buffer (or keep it for a later start, zeroed again, as
        :attr:`spare_sequences` allows). Releasing an unknown id does nothing (idempotent)."""
        with self._lock:
            seq = self._sequences.pop(seq_id, None)
            # A sequence open across a trim is not kept: its handles hold what the trim dropped
            # (ONNX Runtime: sessions of their own weights, ~50 MB each).
            if seq is None or not self.spare_sequences or seq.trims != self._trims:
                return
            # All of it: dropped drafts wrote past the committed and pending slots (~0.1 ms for
            # the embedded LLM's buffer of 256 slots; allocating one zeroed costs about as much).
            seq.kv[...] = 0
            seq.length, seq.parents, seq.depths = 0, [], []
            self._spare = [seq] + self._spare[:self.spare_sequences - 1]

    def sequences(self) -> list[Hashable]:
        return list(self._sequences)

    def trim(self) -> None:
        """Drop what the engine keeps for later batches and can make again on next use at little
        cost (scratch buffers; sessions that hold memory of their own): an idle server calls it so
        that its memory goes back to what it was at load. By default the spare sequences."""
        with self._lock:
            self._spare = []
            self._trims += 1

    def length(self, seq_id: Hashable) -> int:
        """Committed tokens of a sequence."""
        return self._get(seq_id).length

    def capacity(self, seq_id: Hashable) -> int:
        """Tokens the sequence may hold (its KV buffer grows to it as needed)."""
        return self._get(seq_id).limit

    def kv_bytes(self, seq_id: Hashable | None = None) -> int:
        """Bytes of KV buffer a sequence holds now; with no id, all of them (read under the lock, so
        that a sequence released meanwhile neither counts twice nor fails the sum)."""
        size = lambda kv: int(kv.nbytes) if hasattr(kv, "nbytes") else int(kv.numel() * kv.element_size())
        if seq_id is not None:
            return size(self._get(seq_id).kv)
        with self._lock:
            return sum(size(seq.kv) for seq in self._sequences.values())

    kv_itemsize: int = 4   # bytes of a cached value (float32; an engine may keep float16)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes in this model (K and V in every layer)."""
        c = self.config
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * self.kv_itemsize

    def score(self, seq_id: Hashable, tokens: Sequence[int], parents: Sequence[int] | None = None) -> np.ndarray:
        """Score new pending nodes; returns their logits, float32 [T, V].

        ``parents[i]`` is the index, among all pending nodes of the sequence (earlier calls' first,
        then this call's), of node i's parent, or -1 for a child of the committed prefix; it must
        be smaller than node i's own index. ``None`` means a chain hanging from the last pending
        node (or from the prefix): a prefill or an incremental step.
        """
        return self.score_batch([(seq_id, tokens, parents)])[0]

    def score_batch(self, calls: Sequence[tuple]) -> list[np.ndarray]:
        """:meth:`score` for several sequences at once, ``(seq_id, tokens, parents)`` each, in one
        model run where the engine can (many requests' trees verified together); their logits in
        order. A call ``(seq_id, tokens, parents, True)`` asks for its last token's logits only
        ([1, V]: a prompt's), which an engine may then not compute for the others. All or nothing:
        a bad call fails the batch before any sequence changes."""
        self._check_distinct(calls)
        prepared = [self._prepare(*call[:3]) for call in calls]
        logits = self._forward_many([p[:4] for p in prepared], [len(call) > 3 and bool(call[3]) for call in calls])
        for seq, _, _, _, parents, depths in prepared:
            seq.parents = seq.parents + parents
            seq.depths = seq.depths + depths
        return logits

    def _prepare(self, seq_id: Hashable, tokens: Sequence[int], parents: Sequence[int] | None):
        """Check one score call and work out its positions and tree mask; the sequence's tree is
        unchanged (its buffer may have grown)."""
        seq = self._get(seq_id)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        t, m = len(tokens), seq.pending
        self._check_tokens(tokens)
        if parents is None:   # a chain after the last pending node (an incremental step, a prompt)
            parents = list(range(m - 1, m + t - 1))
            first = seq.depths[-1] + 1 if m else 0
            depths = list(range(first, first + t))
        else:
            parents = [int(p) for p in parents]
            if len(parents) != t:
                raise SpecInferError(f"{t} tokens but {len(parents)} parents")
            depths = [0] * t
            for i, p in enumerate(parents):  # a node's parent may be in this very call
                if not -1 <= p < m + i:
                    raise SpecInferError(f"node {m + i} has parent {p}: parents must be -1 or an earlier node")
                depths[i] = 0 if p < 0 else (seq.depths[p] if p < m else depths[p - m]) + 1
        if seq.length + m + t > seq.limit:
            raise SpecInferError(f"context capacity {seq.limit} reached: {seq.length} committed, "
                                 f"{m} pending and {t} new tokens do not fit")
        self._grow(seq, seq.length + m + t)
        # Only the tree built since the last commit enters the mask; its first node sits at slot
        # `length`, so the mask covers N = m + t tree tokens and the prefix is implicit.
        visible = ancestor_matrix(seq.parents + parents)
        positions = seq.length + np.asarray(depths, dtype=np.int64)
        return seq, tokens, positions, visible, parents, depths

    def _forward_many(self, calls: list[tuple[SequenceState, np.ndarray, np.ndarray, np.ndarray]],
                      last_only: list[bool]) -> list[np.ndarray]:
        """:meth:`_forward` for several sequences (of those ``last_only``, the last token's logits);
        an engine that batches them, or computes fewer logits, overrides this."""
        return [self._forward(*call)[-1:] if last else self._forward(*call) for call, last in zip(calls, last_only)]

    def _grow(self, seq: SequenceState, need: int) -> None:
        """Make room for ``need`` slots (at most the sequence's limit): if the buffer is smaller, move
        the KV into one at least twice as large (its committed and pending slots are copied)."""
        if need <= seq.capacity:
            return
        slots = min(seq.limit, max(need, 2 * seq.capacity))
        kv = self._allocate(slots)
        used = (slice(None),) * self.slot_axis + (slice(0, seq.length + seq.pending),)
        kv[used] = seq.kv[used]
        seq.kv, seq.capacity = kv, slots
        seq.bindings.clear()   # an engine's handles point at the old buffer

    def commit(self, seq_id: Hashable, path: Sequence[int]) -> None:
        """Keep the pending nodes ``path`` (a root-to-leaf chain, in order), drop all others."""
        seq = self._get(seq_id)
        path = [int(i) for i in path]
        previous = -1
        for i in path:
            if not 0 <= i < seq.pending or seq.parents[i] != previous:
                raise SpecInferError(f"commit path {path} is not a chain of pending nodes from the prefix")
            previous = i
        moved = [(i, j) for j, i in enumerate(path) if i != j]
        if moved:
            # Sources lie at or after their destinations and in increasing order, so moving in
            # order never overwrites a source before it is read.
            src, dst = (seq.length + np.asarray(column, dtype=np.int64) for column in zip(*moved))
            self._move(seq, src, dst)
        seq.length += len(path)
        seq.parents, seq.depths = [], []

    def draft_chain(self, seq_id: Hashable, tokens: Sequence[int], depth: int,
                    noise: np.ndarray | None = None) -> ChainDraft:
        """Drafting: score ``tokens`` as a chain after the committed prefix and the pending nodes,
        which must be a chain too (none, or an earlier draft's: ``tokens`` then continue it), then
        extend it ``depth`` tokens: greedy (by argmax, each depth's runner-up and their
        probabilities under the model returned too), or sampled with ``noise`` float32
        [>= depth, :attr:`draft_candidates`], step i drawing among its likeliest tokens by
        Gumbel-max with ``noise[i]`` (:func:`chain_draw`; the candidates and their logits
        returned); both among the tokens of :attr:`draft_vocab` only, when the model has one
        (probabilities then within it). The drafted tokens but the last are left pending after
        ``tokens``, as a chain: with m nodes pending before the call, pending node ``m +
        len(tokens) + i`` is draft token i. An engine may draft more tokens than asked (and leave
        them pending) to do it in one call, never more than :attr:`draft_depth`.
        """
        self._check_pending_chain(seq_id)
        logits = self.score(seq_id, tokens)[-1]
        draft = ChainDraft([], [], [], [], [], [])
        outside = None
        if self.draft_vocab is not None:   # nothing outside it: no mass, never a top token
            outside = np.ones(len(logits), bool)
            outside[self.draft_vocab] = False
        for i in range(depth):
            if outside is not None:
                logits = np.where(outside, np.float32(-np.inf), logits)
            if noise is None:
                first, p_first, second, p_second = chain_step(logits)
                draft.runner_up.append(second)
                draft.probability.append(p_first)
                draft.runner_up_probability.append(p_second)
            else:
                first, candidates, top = chain_draw(logits, noise[i])
                draft.candidates.append(candidates)
                draft.candidate_logits.append(top)
            draft.tokens.append(first)
            if i + 1 < depth:
                logits = self.score(seq_id, [first])[0]
        return draft

    def draft_chains(self, calls: Sequence[tuple]) -> list[ChainDraft]:
        """:meth:`draft_chain` for several sequences, ``(seq_id, tokens, depth, noise)`` each (noise
        None: greedy), in one model run where the engine can (many requests' drafts made
        together); their drafts in order, each as :meth:`draft_chain` makes it alone."""
        self._check_distinct(calls)
        return [self.draft_chain(*call) for call in calls]

    def decode_chain(self, seq_id: Hashable, tokens: Sequence[int], depth: int,
                     sampling: ChainSampling | None = None) -> list[int]:
        """Incremental decoding of ``depth`` tokens after ``tokens`` in the fewest calls, greedy
        (:meth:`draft_chain`'s tokens) or drawn as ``sampling`` says, the sequence left as
        :meth:`draft_chain` leaves it; an engine may skip what only drafting needs (the
        probabilities). Here a sampled chain takes a call a token; an engine whose graph draws
        (:attr:`samples_chains`) takes one."""
        if sampling is None:
            return self.draft_chain(seq_id, tokens, depth).tokens
        from ..sampling import SamplingParams, draw_at

        self._check_pending_chain(seq_id)
        params, chain = SamplingParams(sampling.temperature), []
        logits = self.score(seq_id, tokens)[-1]
        for i in range(depth):
            chain.append(draw_at(logits, params, float(sampling.uniforms[i])))
            if i + 1 < depth:
                logits = self.score(seq_id, [chain[-1]])[0]
        return chain

    def decode_chains(self, calls: Sequence[tuple]) -> list[list[int]]:
        """:meth:`decode_chain` for several sequences, ``(seq_id, tokens, depth)`` or ``(seq_id,
        tokens, depth, sampling)`` each, in one model run where the engine can."""
        if any(len(call) > 3 and call[3] is not None for call in calls):
            self._check_distinct(calls)
            return [self.decode_chain(*call) for call in calls]
        return [draft.tokens for draft in self.draft_chains([(*call[:3], None) for call in calls])]

    @staticmethod
    def _check_distinct(calls: Sequence[tuple]) -> None:
        """A batch's calls are for different sequences (each call's first item is its id)."""
        if len({c[0] for c in calls}) != len(calls):
            raise SpecInferError("a sequence appears twice in one batch")

    def _check_pending_chain(self, seq_id: Hashable) -> None:
        seq = self._get(seq_id)
        if seq.parents != list(range(-1, seq.pending - 1)):
            raise SpecInferError("draft_chain continues a chain: the sequence has a pending tree; commit first")

    def prefill(self, seq_id: Hashable, tokens: Sequence[int]) -> np.ndarray:
        """Score and commit a chain of tokens; returns the logits of the last one, float32 [V]."""
        if self._get(seq_id).pending:
            raise SpecInferError("prefill needs a sequence with no pending tree: commit first")
        logits = self.score_batch([(seq_id, tokens, None, True)])[0]
        self.commit(seq_id, range(len(tokens)))
        return logits[-1]

    # --- helpers -----------------------------------------------------------------------------------
    def _check_tokens(self, tokens: np.ndarray) -> None:
        if len(tokens) == 0:
            raise SpecInferError("score needs at least one token")
        ids = tokens.tolist()   # a step's few tokens: faster in Python than in numpy
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise SpecInferError(f"token id out of range 0..{self.vocab_size - 1}")

    def _move(self, seq: SequenceState, src: np.ndarray, dst: np.ndarray) -> None:
        for s, d in zip(src, dst):
            seq.kv[:, :, d] = seq.kv[:, :, s]

    def _get(self, seq_id: Hashable) -> SequenceState:
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise SpecInferError(f"unknown sequence {seq_id!r} (not started, or released)") from None


def each_or_its_error(run, calls: list) -> list:
    """``run(calls)``, a batched model call's results in order; if the batch fails, each call run
    alone to find the one that fails, its exception in its place: only its request fails."""
    if not calls:
        return []
    try:
        return list(run(calls))
    except Exception:  # noqa: BLE001
        out: list = []
        for call in calls:
            try:
                out.append(run([call])[0])
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out
