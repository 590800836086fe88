"""What the per-request models of the Triton repository do, as plain Python over numpy arrays.

The ``model.py`` files (``templates/``) only move tensors between Triton and these classes, so
everything here is tested without a server. Requests are read and checked in
:mod:`specinfer.serving.request`; the client-facing orchestrator is in
:mod:`specinfer.serving.orchestrator`.

Models and their state: ``ssm_<i>`` (:class:`DraftModel`) and ``llm`` (:class:`VerifyModel`) keep
one KV sequence per request, keyed by the ``sequence_id`` the orchestrator makes, and ``lookup``
(:class:`LookupModel`, drafting by lookup) each request's tokens; they answer only the orchestrator
(its key) and reclaim sequences left idle. ``tree_builder`` (:func:`build_tree`) is stateless.
"""
from __future__ import annotations

import hmac
import threading
import time
from typing import Generator, Hashable

import numpy as np

from ..engines.runtime import Runtime
from ..errors import RequestError, SpecInferError
from ..generate import DEFAULT_BUDGET, drafts_by_lookup
from ..lookup import LookupDrafter
from ..sampling import SamplingParams
from ..scheduler import PREFILL_CHUNK_TOKENS, Scheduler
from ..speculate import DYNAMIC, DYNAMIC_DEPTH, SSMDrafter, parse_tree, run_draft, run_drafts
from ..tree import Proposal, TokenTree, merge
from ..tree_sizing import StepCost, TreeSizer, acceptance
from .request import Tensors, as_text, sampling_from, scalar, tree_spec, verification_rule


# --- trees as tensors ----------------------------------------------------------------------------
def tree_to_tensors(tree: TokenTree, vocab_size: int) -> Tensors:
    """A tree as flat arrays: per node token and parent; per proposal node, ssm, rank and the row of
    its q in ``proposal_q`` (-1: a deterministic proposal, a point mass). A sampled q is one row
    per distribution, not per proposal: an SSM's draws at a parent share one (V floats each)."""
    props = [(node, p) for node, ps in enumerate(tree.proposals) for p in ps]
    rows: dict[int, int] = {}                       # id(q) -> its row
    q_rows = [-1 if p.q is None else rows.setdefault(id(p.q), len(rows)) for _, p in props]
    table = {row: p.q for (_, p), row in zip(props, q_rows) if row >= 0}
    return {
        "tree_tokens": np.asarray(tree.tokens, dtype=np.int64),
        "tree_parents": np.asarray(tree.parents, dtype=np.int32),
        "proposal_node": np.asarray([node for node, _ in props], dtype=np.int32),
        "proposal_ssm": np.asarray([p.ssm for _, p in props], dtype=np.int32),
        "proposal_rank": np.asarray([p.rank for _, p in props], dtype=np.int32),
        "proposal_q_row": np.asarray(q_rows, dtype=np.int32),
        # q is needed only under sampling (greedy trees send an empty [0, V] array); it travels as
        # float32, so acceptance probabilities are exact to float32 rounding (~1e-7 relative).
        "proposal_q": (np.stack([table[r] for r in range(len(table))]).astype(np.float32) if table
                       else np.zeros((0, vocab_size), dtype=np.float32)),
    }


def tensors_to_tree(t: Tensors) -> TokenTree:
    tokens, parents = np.asarray(t["tree_tokens"]).reshape(-1), np.asarray(t["tree_parents"]).reshape(-1)
    if len(tokens) == 0 or len(tokens) != len(parents) or parents[0] != -1:
        raise RequestError("malformed tree: tokens and parents must have the same length, root first")
    tree = TokenTree(int(tokens[0]))
    q = np.asarray(t["proposal_q"], dtype=np.float64)
    fields = [np.asarray(t[k]).reshape(-1) for k in ("proposal_node", "proposal_ssm", "proposal_rank", "proposal_q_row")]
    if len({len(f) for f in fields}) != 1 or ((fields[3] < -1) | (fields[3] >= len(q))).any():
        raise RequestError("malformed tree: proposal fields of different lengths, or a q row out of range")
    by_node: dict[int, list[Proposal]] = {}
    for node, ssm, rank, row in zip(*fields):
        by_node.setdefault(int(node), []).append(Proposal(int(ssm), int(rank), q[row] if row >= 0 else None))
    for node in range(1, len(tokens)):
        props = by_node.get(node) or [None]
        for p in props:  # the first add creates the node, the others add the other SSMs' proposals
            index = tree.add(int(parents[node]), int(tokens[node]), p)
        if index != node:
            raise RequestError("malformed tree: nodes must be in topological order without duplicates")
    return tree


def build_tree(root: int, trees: list[Tensors], budget: int, vocab_size: int) -> Tensors:
    """The ``tree_builder`` model: merge the SSMs' trees under one node budget."""
    parsed = [tensors_to_tree(t) for t in trees]
    if any(p.tokens[0] != root for p in parsed):
        raise RequestError("an SSM's tree does not start at the step's root")
    merged = merge(parsed, max(1, budget))[0] if parsed else TokenTree(root)
    return tree_to_tensors(merged, vocab_size)


# --- the stateful models: drafts and verification --------------------------------------------------
OPS = ("start", "step", "release")
CALLER_KEY = "caller_key"    # the input that proves a request comes from the orchestrator


def _op_and_sequence(t: Tensors, key: str | None) -> tuple[str, str]:
    """A request's op and sequence id, after checking that the orchestrator sent it: the stateful
    models hold KV memory per sequence, so only the orchestrator may open and release sequences."""
    if key is not None:
        given = t.get(CALLER_KEY)
        given = as_text(np.asarray(given, dtype=object).reshape(-1)[0], CALLER_KEY) if given is not None else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise RequestError("this model is internal to specinfer's orchestrator: call ensemble, ensemble_fused "
                                 "or ensemble_sync")
    for name in ("op", "sequence_id"):
        if t.get(name) is None:
            raise RequestError(f"missing input '{name}'")
    op = as_text(np.asarray(t["op"], dtype=object).reshape(-1)[0], "op")
    if op not in OPS:
        raise RequestError(f"unknown op '{op}' (one of {', '.join(OPS)})")
    return op, as_text(np.asarray(t["sequence_id"], dtype=object).reshape(-1)[0], "sequence_id")


def _ids(t: Tensors, name: str) -> list[int]:
    return [int(x) for x in np.asarray(t.get(name, np.zeros(0, np.int64))).reshape(-1)]


class _Sequences:
    """Per-sequence state of a model, safe under concurrent requests, with each one's last use (a
    sequence its orchestrator forgot, because it died, is reclaimed once idle too long)."""

    def __init__(self):
        self.items: dict[Hashable, object] = {}
        self.used: dict[Hashable, float] = {}
        self.lock = threading.Lock()

    def add(self, seq_id, item):
        with self.lock:
            if seq_id in self.items:
                raise SpecInferError(f"sequence {seq_id!r} is already open")
            self.items[seq_id], self.used[seq_id] = item, time.monotonic()

    def get(self, seq_id):
        with self.lock:
            if seq_id not in self.items:
                raise SpecInferError(f"unknown sequence {seq_id!r} (never started, released, or idle too long)")
            self.used[seq_id] = time.monotonic()
            return self.items[seq_id]

    def pop(self, seq_id):
        with self.lock:
            self.used.pop(seq_id, None)
            return self.items.pop(seq_id, None)

    def idle(self, seconds: float) -> list:
        """The sequences unused for more than ``seconds``."""
        now = time.monotonic()
        with self.lock:
            return [s for s, t in self.used.items() if now - t > seconds]

    def __len__(self):
        return len(self.items)


class _SequenceModel:
    """What the stateful models share: the caller check, release and reclaiming idle sequences."""

    sequences: _Sequences
    key: str | None = None     # the orchestrator's key; None: any caller (in-process use, tests)

    def handle_batch(self, requests: list[Tensors]) -> list[Tensors | Exception]:
        raise NotImplementedError

    def handle(self, t: Tensors) -> Tensors:
        """One request (see :meth:`handle_batch`): its outputs; raises what failed it."""
        answer = self.handle_batch([t])[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def release(self, seq_id) -> bool:
        raise NotImplementedError

    def reclaim(self, idle_seconds: float) -> int:
        """Release the sequences idle for more than ``idle_seconds``; how many there were."""
        return sum(self.release(s) for s in self.sequences.idle(idle_seconds))

    def kv_bytes(self) -> int:
        return self.runtime.kv_bytes()


DRAFTS_FOR = ("all", "greedy", "sampled")


class DraftModel(_SequenceModel):
    """``ssm_<i>``: one SSM's sequences; a step commits last step's verdict, then drafts a tree.

    ``tree`` is the default tree spec; the dynamic tree needs ``step_cost``, the LLM's verification
    cost table (the repository measures it when it is written). ``drafts_for``: the requests it
    drafts for, "all", "greedy" or "sampled" (a repository with SSMs for sampled requests, e.g. a
    distilled one, has both kinds); for the others it keeps no sequence and drafts nothing."""

    def __init__(self, runtime: Runtime, index: int, tree: str = DYNAMIC, step_cost: StepCost | None = None,
                 key: str | None = None, drafts_for: str = "all"):
        parse_tree(tree)
        if drafts_for not in DRAFTS_FOR:
            raise SpecInferError(f"drafts_for must be one of {', '.join(DRAFTS_FOR)}, got {drafts_for!r}")
        self.runtime, self.index, self.default_tree, self.key = runtime, index, tree, key
        self.drafts_for = drafts_for
        self.vocab_size = runtime.vocab_size
        self.sizer = TreeSizer(step_cost) if step_cost is not None else None
        self.sequences = _Sequences()

    def _drafter(self, seq_id, params: SamplingParams):
        """A new sequence's drafter."""
        return SSMDrafter(self.runtime, self.index, seq_id=seq_id)

    def drafts(self, params: SamplingParams) -> bool:
        """Whether this model drafts for a request sampled with ``params``."""
        return self.drafts_for == "all" or (self.drafts_for == "sampled") != params.greedy

    def start(self, seq_id, prefix: list[int], params: SamplingParams) -> None:
        drafter = self._drafter(seq_id, params)
        try:
            drafter.prefill(prefix)
        except BaseException:
            drafter.release()
            raise
        # Each model has its own random stream, derived from the request's seed and its role.
        rng = np.random.default_rng(None if params.seed is None else [params.seed, 1 + self.index])
        self.sequences.add(seq_id, (drafter, rng))

    def step(self, seq_id, accepted: list[int], root: int, params: SamplingParams, budget: int,
             tree: str | None = None) -> Tensors:
        """Commit last step's verdict (``accepted``, root first), then draft a tree from ``root``;
        ``tree``: the request's tree spec, None for the model's default."""
        return run_draft(self.stepping(seq_id, accepted, root, params, budget, tree))

    def stepping(self, seq_id, accepted: list[int], root: int, params: SamplingParams, budget: int,
                 tree: str | None = None) -> Generator:
        """:meth:`step` as a draft in progress (:func:`~specinfer.speculate.run_drafts` runs many)."""
        widths = parse_tree(tree or self.default_tree)
        if widths is None and self.sizer is None:
            raise RequestError("the dynamic tree needs the LLM's verification cost table, which this repository "
                                 "lacks (`specinfer repo` measures it with the LLM's engine): ask for a fixed tree")
        drafter, rng = self.sequences.get(seq_id)
        if accepted:
            drafter.commit(accepted)
        drafter.sizer = self.sizer if widths is None else None
        budget = budget if widths != [] else 1    # tree "none": incremental decoding
        draft = yield from drafter.drafting(root, widths or [1] * DYNAMIC_DEPTH, params, rng, budget)
        if drafter.sizer is not None and drafter.drafted:
            drafter.sizer.observe(drafter.seconds)
        return tree_to_tensors(draft, self.vocab_size)

    def handle_batch(self, requests: list[Tensors]) -> list[Tensors | Exception]:
        """Requests of the ``ssm_<i>`` model (op start: prefill; step: commit + draft; release),
        the steps' drafts made together (one drafter run for all their chains); each one's
        outputs, or the exception that failed it."""
        answers: list = [None] * len(requests)
        steps = []   # (request index, its draft in progress)
        for i, t in enumerate(requests):
            try:
                op, seq = _op_and_sequence(t, self.key)
                if op == "release":   # (its sampling inputs are not read: a release must not fail on them)
                    self.release(seq)
                elif not self.drafts(params := sampling_from(t)):   # another SSM drafts for this request
                    answers[i] = tree_to_tensors(TokenTree(scalar(t, "root", "i", 0)), self.vocab_size)
                    continue
                elif op == "start":
                    self.start(seq, _ids(t, "tokens"), params)
                else:
                    tree = tree_spec(t) if t.get("tree") is not None else None
                    steps.append((i, self.stepping(seq, _ids(t, "tokens"), scalar(t, "root", "i", None), params,
                                                   scalar(t, "budget", "i", DEFAULT_BUDGET), tree)))
                    continue
                answers[i] = tree_to_tensors(TokenTree(0), self.vocab_size)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                answers[i] = e
        for (i, _), out in zip(steps, run_drafts([drafting for _, drafting in steps])):
            answers[i] = out
        return answers

    def release(self, seq_id) -> bool:
        item = self.sequences.pop(seq_id)
        if item is not None:
            item[0].release()
        return item is not None


class LookupModel(DraftModel):
    """``lookup``: drafts by lookup in each sequence's own tokens (lookup.py) for the dynamic tree of
    greedy requests (as :class:`~specinfer.generate.LocalSpeculator`'s: see
    :func:`~specinfer.generate.drafts_by_lookup`), a draft model beside the ``ssm_<i>`` ones with no
    model to run. A step with a fixed tree drafts nothing here (the lookup still learns the accepted
    tokens)."""

    def __init__(self, index: int, vocab_size: int, step_cost: StepCost | None, tree: str = DYNAMIC,
                 key: str | None = None):
        if step_cost is None:
            raise SpecInferError("the lookup drafter sizes its drafts with the LLM's verification cost table, "
                                 "which this repository lacks")
        parse_tree(tree)
        self.runtime, self.index, self.default_tree, self.vocab_size, self.key = None, index, tree, vocab_size, key
        # Whether a sampled request drafts by lookup, asked where LocalSpeculator asks it.
        self.drafts_for = "all" if drafts_by_lookup(None, SamplingParams(temperature=1.0)) else "greedy"
        self.sizer, self.sequences = TreeSizer(step_cost), _Sequences()

    def _drafter(self, seq_id, params: SamplingParams) -> LookupDrafter:
        return LookupDrafter(self.index, self.sizer, acceptance(self, params, "lookup"), greedy=params.greedy)

    def stepping(self, seq_id, accepted: list[int], root: int, params: SamplingParams, budget: int,
                 tree: str | None = None) -> Generator:
        yield from ()   # no model to run: done at the first resume
        drafter, _ = self.sequences.get(seq_id)
        if accepted:
            drafter.commit(accepted)
        dynamic = parse_tree(tree or self.default_tree) is None
        draft = drafter.draft(root, budget) if dynamic and budget > 1 else TokenTree(root)
        return tree_to_tensors(draft, self.vocab_size)

    def kv_bytes(self) -> int:
        return 0


class VerifyModel(_SequenceModel):
    """``llm``: the LLM's sequences; a step scores the merged tree, verifies it and commits.

    :meth:`handle_batch` takes many requests at once (the Triton model gets every request that
    waited while the last batch ran) and runs them as one batch of the in-process engine's
    :class:`~specinfer.scheduler.Scheduler`: one LLM call scores every step's tree and every new
    prompt, and the sequences' KV stays under ``kv_budget`` bytes (None: half the memory available
    now). A start that does not fit is refused at once (the batch cannot wait for memory that only
    a later request's release frees).

    The trees are not cut to a share of the batch here, as the fused engine's are: behind the
    ensemble a step's hops (the drafters, tree_builder, the orchestrator) cost more than the
    verified tokens, and larger trees save hops (docs/batching.md). ``warm``: the batch sizes the
    LLM runs at load (:class:`~specinfer.scheduler.Scheduler`'s)."""

    def __init__(self, runtime: Runtime, key: str | None = None, *, kv_budget: int | None = None,
                 prefill_chunk_tokens: int | None = PREFILL_CHUNK_TOKENS, warm: int = 0):
        self.runtime, self.key = runtime, key
        self.scheduler = Scheduler(runtime, kv_budget=kv_budget, prefill_chunk_tokens=prefill_chunk_tokens,
                                   max_waiting=0, warm=warm)
        self.sequences = _Sequences()

    def start(self, seq_id, prefix: list[int], params: SamplingParams, max_tokens: int | None = None,
              rule: str = "mss") -> None:
        """Open a sequence and put its prompt in: admitted if the KV it may reach (prompt plus
        ``max_tokens``, default up to the context, plus a tree) fits the budget."""
        self._run_one(("start", seq_id, (prefix, params, max_tokens, rule)))

    def step(self, seq_id, tree: TokenTree) -> tuple[list[int], int]:
        """Verify ``tree`` (with the sampling and rule the sequence started with) and commit the
        accepted path; its tokens, root first, and the LLM's bonus token."""
        return self._run_one(("step", seq_id, tree))

    def _run_one(self, work):
        result = self._run_batch([work])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _run_batch(self, works: list[tuple]) -> list:
        """Each (op, sequence id, what) as one batch: a start's result None, a step's (path, bonus),
        or the exception that failed it (the others go on)."""
        results: list = [None] * len(works)
        jobs, seen = {}, set()
        for i, (op, seq_id, what) in enumerate(works):
            try:
                if seq_id in seen:
                    raise RequestError(f"sequence {seq_id!r} twice in one batch")
                seen.add(seq_id)
                if op == "start":
                    if seq_id in self.sequences.items:
                        raise SpecInferError(f"sequence {seq_id!r} is already open")
                    prefix, params, max_tokens, rule = what
                    spec = self.scheduler.speculator(max_tokens or self.runtime.max_context, params, [], rule=rule,
                                                     seq_id=seq_id)
                    jobs[i] = spec.open(prefix)
                else:
                    jobs[i] = self.sequences.get(seq_id).verify_job(what)
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                results[i] = e
        self.scheduler.run_now(list(jobs.values()))
        for i, job in jobs.items():
            op, seq_id, _ = works[i]
            if job.error is not None:
                results[i] = job.error
                if op == "start":
                    job.spec.release()
            elif op == "start":
                self.sequences.add(seq_id, job.spec)
            else:
                results[i] = job.result
        return results

    def handle_batch(self, requests: list[Tensors]) -> list[Tensors | Exception]:
        """Requests of the ``llm`` model (op start: prefill; step: verify + commit; release), run
        as one batch; each one's outputs, or the exception that failed it."""
        works, answers = [], [None] * len(requests)
        for i, t in enumerate(requests):
            try:
                op, seq = _op_and_sequence(t, self.key)
                if op == "release":
                    self.release(seq)
                    answers[i] = self._answer([], -1, 0)
                elif op == "start":
                    works.append((i, ("start", seq, (_ids(t, "tokens"), sampling_from(t),
                                                     scalar(t, "max_tokens", "i", 0) or None, verification_rule(t)))))
                else:
                    works.append((i, ("step", seq, tensors_to_tree(t))))
            except Exception as e:  # noqa: BLE001
                answers[i] = e
        for (i, (op, _, what)), result in zip(works, self._run_batch([w for _, w in works])):
            if isinstance(result, BaseException):
                answers[i] = result
            elif op == "start":
                answers[i] = self._answer([], -1, 0)
            else:
                path, bonus = result
                answers[i] = self._answer(path, bonus, len(what) - 1)
        return answers

    def _answer(self, path: list[int], bonus: int, drafted: int) -> Tensors:
        return {"accepted_tokens": np.asarray(path, dtype=np.int64), "bonus": np.array([bonus], dtype=np.int64),
                "draft_tokens": np.array([drafted], dtype=np.int32)}

    def release(self, seq_id) -> bool:
        spec = self.sequences.pop(seq_id)
        if spec is not None:
            spec.release()
        return spec is not None
