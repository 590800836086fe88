"""Many sequences at once: continuous batching of speculation steps, KV memory under a budget.

Every request runs :func:`specinfer.generate.decode` (the one loop) on its own thread, over a
:class:`BatchedSpeculator`. Its ``start`` and ``step`` do not run the models: they hand the work
to the scheduler's thread and wait. That thread takes whatever is ready, as one batch:

    drafts: each sequence's SSMs and lookup draft and merge its tree    (LocalSpeculator.proposing),
            each SSM for all sequences in one run                       (speculate.run_drafts)
    one LLM call scores every tree and new prompts (by chunks)           (Runtime.score_batch)
    each sequence verifies its tree and commits the accepted path        (LocalSpeculator.settle)

(requests that draft nothing, incremental ones, those the batch's share leaves no tree, and, in
a batch that verifies no tree, those whose drafters drafted nothing, take several tokens a step
instead, all of them in one run of the LLM's drafter, greedy or drawing each token:
:meth:`Scheduler._run_chained`; sampled ones only without a top-k or top-p cut), so
the step algorithm is the one of :class:`~specinfer.generate.LocalSpeculator`, and requests join
and leave between batches. A settled step's successor (from its bonus token) is queued at once,
before the request's thread asks for it (:meth:`BatchedSpeculator.settled`): the next batch need
not wait for the requests' threads to handle their tokens, and a request that then stops wastes
that one step. Before it runs a batch, the thread gives running sequences that have no step
queued (and will have one: not those whose tokens are all made) a moment (``gather_seconds``) to
ask, and lets in first the requests waiting to start or end between batches.

The tree a request verifies gets smaller as more requests run: their trees share
``batch_tree_tokens`` nodes (SpecInfer finds small trees best from a batch of 4 up; here, on 2
cores, verifying many tokens is no longer almost free, and from 16 requests a step without a draft
is fastest). A batch of greedy speculative requests drafts trees only while trees have made more
tokens a second than chains at that many requests (:class:`ChainsOrTrees` measures both ways).

KV memory: a request is admitted when the KV cache it may need (its prompt plus ``max_tokens``
plus one tree, in the LLM and every SSM) fits in the budget beside the running requests'; it is
reserved for the request's whole life, so a running request never runs out. The buffers themselves
grow as the sequence does (``specinfer_kv_bytes`` is what they hold). A request that does not fit
waits (at most ``max_waiting`` of them, each at most ``wait_seconds``), or is refused with an error
that says why: it never takes memory from a running request.

Memory the batches leave behind is given back once no request has run for ``idle_seconds``: the
heap's free pages (the sessions run without a memory arena, so a batch's tensors go back to the
heap as it ends), and whatever a model keeps for batches that it can make again cheaply
(:meth:`~specinfer.engines.runtime.Runtime.trim`; ONNX Runtime keeps the LLM's session per batch
size, ~2 MB each with the weights one copy for all, as opening them again slowed every burst after
an idle spell). A server warms the batch sizes' sessions before its first request (``warm``).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from .engines.runtime import Runtime, each_or_its_error
from .errors import RequestTooLarge, ServerBusy, ServerStopping, SpecInferError
from .generate import DEFAULT_BUDGET, LocalSpeculator, Stats
from .sampling import SamplingParams
from .speculate import check_vocab, run_drafts
from .tree import TokenTree
from .tree_sizing import chains, step_cost, warm_drafter, warm_shapes

# Tree nodes a batch's trees share; a request alone keeps its whole budget. On 2 cores a batch of 16
# verifies fastest with no draft at all (measured in-process, embedded models, 16 streams: 808
# tokens/s incremental, 784 with lookup drafts, 649 with SSM drafts of 4 nodes), so the share falls
# to 1 (an incremental step) from 16 requests, and SSMs stop drafting from 8 (speculate.SSM_MIN_BUDGET).
BATCH_TREE_TOKENS = 16
MIN_TREE = 1               # a batch may leave a request no draft at all (an incremental step)
# Prompt tokens a batch takes while other requests step (chunked prefill): a long prompt goes in a
# chunk per batch, so that it does not hold the running requests' next tokens for its whole
# prefill (~0.18 ms a token here: 0.2 s for 1000). A prompt with no one else running goes in whole.
PREFILL_CHUNK_TOKENS = 128
# Seconds with no request running after which the models trim what they keep for batches
# (Runtime.trim) and the heap's free pages go back to the system.
IDLE_SECONDS = 10.0


class ChainsOrTrees:
    """Whether a batch's greedy speculative requests draft trees or all take chains (as
    incremental ones do), by how many requests run: whichever way made more tokens a second in the
    batches of that size so far. A request alone decides for itself (its sizer weighs its trees
    against its chain run); in a batch, the chains of every sequence share one run, which makes a
    chain token cheaper as the batch grows faster than a tree token gets (served on int8 products,
    4 streams: speculative 2874 tokens/s against incremental 3888, 16 streams 4127 against 4742).
    Trees are tried first; the losing way is tried again now and then, the wait doubling while it
    still loses, so that a change (other prompts, drafts that start to pay) is seen."""

    WEIGHT = 0.3          # of a new batch in a moving average
    RETRY = (4, 64)       # batches of a size between tries of the losing way: first, most

    def __init__(self):
        self.rates: dict[tuple[str, int], float] = {}   # (way, requests running) -> tokens/s
        self._wait: dict[int, int] = {}
        self._waited: dict[int, int] = {}
        self._leader: dict[int, str] = {}

    def chains(self, size: int) -> bool:
        """Whether the next batch of ``size`` running requests takes chains instead of trees."""
        trees, chains = self.rates.get(("trees", size)), self.rates.get(("chains", size))
        if trees is None or chains is None:
            return trees is not None      # each way measured once, trees first
        leader = "chains" if chains > trees else "trees"
        if self._leader.get(size) != leader:   # a new leader: its rival is soon tried again
            self._leader[size], self._wait[size], self._waited[size] = leader, self.RETRY[0], 0
        self._waited[size] += 1
        if self._waited[size] < self._wait[size]:
            return leader == "chains"
        self._waited[size], self._wait[size] = 0, min(2 * self._wait[size], self.RETRY[1])
        return leader != "chains"

    def observe(self, way: str, size: int, tokens: int, seconds: float) -> None:
        """A batch of ``size`` running requests that went ``way`` ("trees" or "chains") made
        ``tokens`` in ``seconds``, its drafting included."""
        if seconds <= 0 or tokens <= 0:
            return
        rate, old = tokens / seconds, self.rates.get((way, size))
        self.rates[way, size] = rate if old is None else old + self.WEIGHT * (rate - old)


def default_kv_budget() -> int:
    """Half the memory available now (bytes), for the KV caches of every model in this process."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available // 2


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5G"``, ``"100000"``: a byte count."""
    units = {"": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1024 ** 2,
             "g": 1e9, "gb": 1e9, "gib": 1024 ** 3, "t": 1e12, "tb": 1e12, "tib": 1024 ** 4}
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise SpecInferError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 100000)") from None
    if not value > 0:
        raise SpecInferError(f"a KV budget must be positive, got {text!r}")
    return int(value)


class _Done:
    """A job's completion: :class:`threading.Event`'s ``set``, ``is_set`` and ``wait`` on one lock,
    held from birth until set. (An Event is a Condition with a lock of its own and a list of
    waiters: making and setting one cost ~3 us against ~0.4, and a batch of 16 streams makes 16.)
    Set once, by the thread that runs the batch; waited on by the request's."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self) -> None:
        if not self._set:
            with self._lock:   # acquired once set; given back at once for any other waiter
                pass


@dataclass(eq=False)   # a job is itself: `in` compares identity
class _Job:
    """A sequence's request to the scheduler's thread: a start (prefix) or a step (root, budget;
    or a tree drafted elsewhere, to verify)."""

    spec: "BatchedSpeculator"
    prefix: list[int] | None = None
    prefilled: int = 0          # of the prefix, tokens in the LLM's cache (chunked prefill)
    root: int = 0
    budget: int = DEFAULT_BUDGET
    tree: TokenTree | None = None
    stats: Stats | None = None  # a step's own accounting, added to its request's when it takes the result
    done: _Done = field(default_factory=_Done)
    result: object = None
    error: BaseException | None = None

    def finish(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class Scheduler:
    """The batching engine of one process: an LLM and its SSMs, the requests running on them, and
    the KV budget they share. Thread-safe; :meth:`speculator` makes a request's speculator."""

    def __init__(self, llm: Runtime, ssms: Sequence[Runtime] = (), *, sampling_ssms: Sequence[Runtime] = (),
                 kv_budget: int | None = None,
                 batch_tree_tokens: int = BATCH_TREE_TOKENS, max_batch: int = 32, max_waiting: int = 64,
                 wait_seconds: float = 60.0, gather_seconds: float = 0.005,
                 prefill_chunk_tokens: int | None = PREFILL_CHUNK_TOKENS, idle_seconds: float | None = IDLE_SECONDS,
                 warm: int = 0):
        """``warm``: the LLM runs every batch size up to this many sequences (at most
        ``max_batch``) before the first request (:func:`warm_batches`), so that no burst waits
        for a session to open (a server; 0: each opens at its first batch)."""
        check_vocab(llm, [*ssms, *sampling_ssms])
        if batch_tree_tokens < MIN_TREE or max_batch < 1 or max_waiting < 0:
            raise SpecInferError("batch_tree_tokens must be >= 2, max_batch >= 1 and max_waiting >= 0")
        # ``sampling_ssms`` draft for sampled requests instead of ``ssms`` (none: ``ssms`` draft for all).
        self.llm, self.ssms, self.sampling_ssms = llm, list(ssms), list(sampling_ssms)
        self.models = [llm] + self.ssms + self.sampling_ssms
        self.kv_budget = default_kv_budget() if kv_budget is None else int(kv_budget)
        self.batch_tree_tokens, self.max_batch, self.max_waiting = batch_tree_tokens, max_batch, max_waiting
        self.wait_seconds, self.gather_seconds = wait_seconds, gather_seconds
        self.prefill_chunk_tokens = prefill_chunk_tokens   # None: every prompt in one call
        self.idle_seconds = idle_seconds         # None: keep the batches' memory
        self.trims = 0                           # times the models gave their batches' memory back
        self._last_active = time.monotonic()     # when a batch last ran or the last request left
        self._trimmed = True                     # nothing kept for batches since the last trim
        self.prefill_chunks = 0                  # prompt chunks run (a prompt in one call counts one)
        # A request holds KV in the LLM and in one of the two sets of SSMs: reserve for the dearer.
        self.bytes_per_token = llm.kv_bytes_per_token + max(sum(s.kv_bytes_per_token for s in ssms)
                                                            for ssms in (self.ssms, self.sampling_ssms))
        self.reserved = 0                        # bytes reserved by admitted requests
        self.waiting = 0                         # requests waiting for memory
        self.running: set[BatchedSpeculator] = set()
        self.batches = 0                         # batches run, and the sequences they held
        self.batched_sequences = 0
        self.seconds = {"draft": 0.0, "llm": 0.0, "verify": 0.0}   # the batches' time, by part
        self.ways = ChainsOrTrees()              # greedy speculative requests in a batch: trees or chains
        self._jobs: list[_Job] = []
        self._lock = threading.Condition()       # jobs, running, memory
        self._run_lock = threading.Lock()        # held while a batch runs: no buffer is freed under it
        self._entering = 0   # request threads waiting to run between batches (_between_batches)
        self._closed = False
        if warm > 1:
            warm_batches(llm, min(warm, max_batch))
            _return_free_heap()   # the warm-up's tensors (~70 MB of free heap for 32 sizes here)
        self._thread = threading.Thread(target=self._loop, name="specinfer-scheduler", daemon=True)
        self._thread.start()

    # --- what requests see -------------------------------------------------------------------------
    def speculator(self, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                   tree: Sequence[int] | None = None, *, rule: str = "mss", lookup: bool = False,
                   min_confidence: float = 0.0, stats: Stats | None = None,
                   budget: int = DEFAULT_BUDGET, seq_id: str | None = None) -> "BatchedSpeculator":
        """A request's speculator (see :class:`~specinfer.generate.LocalSpeculator` for the
        arguments); ``max_new_tokens`` and ``budget`` size its KV reservation; ``seq_id``: its
        sequences' id in the models (default: a new one)."""
        return BatchedSpeculator(self, max_new_tokens, dict(tree=tree, params=params, rule=rule, lookup=lookup,
                                                            min_confidence=min_confidence), stats, budget, seq_id)

    def drafters(self, params: SamplingParams) -> list[Runtime]:
        """The SSMs that draft for a request sampled with ``params``."""
        return self.sampling_ssms if self.sampling_ssms and not params.greedy else self.ssms

    @property
    def sequences(self) -> list:
        with self._lock:
            return list(self.running)

    @property
    def mean_batch(self) -> float:
        """Sequences per batch so far (starts and steps)."""
        return self.batched_sequences / self.batches if self.batches else 0.0

    def kv_bytes(self) -> int:
        """Bytes the sequences' KV buffers hold now (every model of this scheduler)."""
        return sum(rt.kv_bytes() for rt in self.models)

    def close(self) -> None:
        """Refuse new requests and stop the scheduler's thread once the queued ones have run;
        returns when it has (from then on it no longer touches the models, trims included)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # --- admission ---------------------------------------------------------------------------------
    def _admit(self, nbytes: int, tokens: int) -> None:
        mb = 1 << 20
        if nbytes > self.kv_budget:
            raise RequestTooLarge(f"{RequestTooLarge.PREFIX} {nbytes / mb:.1f} MiB of KV cache ({tokens} tokens: "
                                  f"prompt, max_tokens and a tree); the server's KV budget is "
                                  f"{self.kv_budget / mb:.1f} MiB: ask for fewer tokens")
        with self._lock:
            if self.reserved + nbytes > self.kv_budget:
                if self.waiting >= self.max_waiting:
                    raise ServerBusy(f"{ServerBusy.PREFIX}: its KV memory is in use and {self.waiting} requests "
                                     f"already wait for it; try again later")
                self.waiting += 1
                try:
                    deadline = time.monotonic() + self.wait_seconds
                    while self.reserved + nbytes > self.kv_budget and not self._closed:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise ServerBusy(f"{ServerBusy.PREFIX}: no KV memory came free in {self.wait_seconds:g} s; "
                                             f"try again later")
                        self._lock.wait(left)
                finally:
                    self.waiting -= 1
            self.reserved += nbytes

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.reserved -= nbytes
            self._lock.notify_all()

    # --- the scheduler's thread --------------------------------------------------------------------
    def _submit(self, job: _Job):
        with self._lock:
            self._queue(job)
        return self._wait(job)

    def _queue(self, job: _Job) -> None:
        """Queue ``job`` for the next batch. Called under ``_lock``."""
        if self._closed:
            raise ServerStopping(f"{ServerStopping.PREFIX}: its scheduler is closed")
        self._jobs.append(job)
        self._lock.notify_all()

    @staticmethod
    def _wait(job: _Job):
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed and self._until_idle() != 0.0:
                    self._lock.wait(self._until_idle())
                if self._closed and not self._jobs:
                    return
                if self._jobs:
                    # Running sequences still busy with their last step's tokens get a moment to ask
                    # for their next step, so that it joins this batch; not those whose last step
                    # made their last tokens (they only release: waiting for them held every batch
                    # that a request's end fell in by gather_seconds).
                    # So do requests waiting to start or end between batches (their turn would
                    # otherwise come only when this thread waits: a burst of 16 requests went in
                    # over four batches, the first of two prompts).
                    deadline = time.monotonic() + self.gather_seconds
                    while (self._entering or len(self._jobs) < min(self._asking(), self.max_batch)) \
                            and time.monotonic() < deadline:
                        self._lock.wait(max(0.0, deadline - time.monotonic()))
                jobs, self._jobs = self._jobs[:self.max_batch], self._jobs[self.max_batch:]
            if not jobs:   # idle for idle_seconds
                self._trim()
                continue
            with self._run_lock:
                unfinished = self._run_guarded(jobs)
            if unfinished:   # prompts not all in: first in the next batch
                with self._lock:
                    self._jobs[:0] = unfinished

    @contextlib.contextmanager
    def _between_batches(self):
        """Hold the run lock between two batches, for a request thread that changes the models'
        state (starts or frees a sequence); the scheduler's thread lets it in before the next batch."""
        with self._lock:
            self._entering += 1
        try:
            with self._run_lock:
                yield
        finally:
            with self._lock:
                self._entering -= 1
                self._lock.notify_all()

    def _asking(self) -> int:
        """Running sequences that will ask for another step. Called under ``_lock``."""
        return sum(not spec.finished for spec in self.running)

    def _active(self) -> None:
        """Note activity now (a batch ran, a request left); with no request running, the idle
        period starts: wake the scheduler's thread to time it. Called under ``_lock``."""
        self._last_active = time.monotonic()
        if not self.running:
            self._lock.notify_all()

    def _until_idle(self) -> float | None:
        """Seconds until the models should give their batches' memory back (0: now); None while
        requests run or nothing is kept. Called under ``_lock``."""
        if self.idle_seconds is None or self._trimmed or self.running:
            return None
        return max(0.0, self._last_active + self.idle_seconds - time.monotonic())

    def _trim(self) -> None:
        """Give back what the models keep for batches, and the heap's free pages, if still no
        request has run for ``idle_seconds``."""
        with self._run_lock:
            with self._lock:
                if self._jobs or self._closed or self._until_idle() != 0.0:
                    return
                self._trimmed = True
            for runtime in self.models:
                runtime.trim()
            _return_free_heap()
            self.trims += 1

    def run_now(self, jobs: list[_Job]) -> None:
        """Run ``jobs`` on the calling thread, as one batch (and more for prompts that go in by
        chunks), for a caller whose batches are gathered already: the served llm model, to which
        Triton's batcher hands every request that waited."""
        with self._run_lock:
            while jobs:
                jobs = self._run_guarded(jobs)

    def _run_guarded(self, jobs: list[_Job]) -> list[_Job]:
        try:
            return self._run(jobs)
        except BaseException as e:  # noqa: BLE001 - a bug here must fail the batch, not hang it
            for job in jobs:
                if not job.done.is_set():
                    job.finish(error=e)
            return []

    def _run(self, jobs: list[_Job]) -> list[_Job]:
        """One batch: the greedy steps that draft nothing in one LLM run of chains
        (:meth:`_run_chained`); the others' drafts, one LLM call for every tree and prompt,
        verification of each. Returns the starts whose prompts are not all in yet."""
        for job in jobs:
            if job.spec.local is None:   # released while its job waited (an idle sequence reclaimed)
                job.finish(error=SpecInferError("the sequence was released"))
        jobs = [j for j in jobs if not j.done.is_set()]
        steps = [j for j in jobs if j.prefix is None]
        starts = [j for j in jobs if j.prefix is not None]
        self.batches += 1
        self.batched_sequences += len(jobs)
        # Shared by the requests running, not only those in this batch: the others come next batch.
        running = max(len(steps), len(self.running))
        for job in steps:   # each sequence has one job in a batch: its accounting goes to the job
            job.spec.local.stats = job.stats if job.stats is not None else job.spec.stats
        share = max(MIN_TREE, self.batch_tree_tokens // running if running > 1 else DEFAULT_BUDGET)
        t0 = time.perf_counter()
        # Where every step is a greedy speculative one (none sampled or incremental), ChainsOrTrees
        # chooses the way; with no prompt in the batch, the batch is a measure of that way.
        way = measured = None
        if running > 1 and steps and all(job.tree is None and job.spec.local.params.greedy and job.spec.local.can_chain
                                         and not job.spec.local.chained for job in steps):
            way = "chains" if self.ways.chains(running) else "trees"
            measured = None if starts else way
        chained = {id(job): (job, depth) for job in steps if job.tree is None
                   and (depth := job.spec.local.chain_depth(job.budget, 1 if way == "chains" else share))}
        steps = [job for job in steps if id(job) not in chained]
        trees = {id(job): job.tree for job in steps if job.tree is not None}
        drafting = [job for job in steps if job.tree is None]
        # Every sequence's drafts together: each SSM drafts for all of them in one run a round.
        for job, tree in zip(drafting, run_drafts([job.spec.local.proposing(job.root, min(job.budget, share))
                                                   for job in drafting])):
            if isinstance(tree, BaseException):   # this request fails, the batch goes on
                job.finish(error=tree)
            else:
                trees[id(job)] = tree
        if all(len(tree) == 1 for tree in trees.values()):
            # No tree to verify: the steps that drafted nothing take chains, as a request alone
            # does (LocalSpeculator.chain_instead); beside trees, one token each in their call.
            for job in drafting:
                if id(job) in trees and (depth := job.spec.local.chain_instead(trees[id(job)], job.budget)):
                    chained[id(job)] = (job, depth)
            steps = [job for job in steps if id(job) not in chained]
        if chained:   # steps that draft nothing: several tokens each, in an LLM run of their own
            started = time.perf_counter()
            self.seconds["draft"] += started - t0
            tokens = self._run_chained(list(chained.values()), started)
            if not steps and not starts:
                if measured is not None:   # drafts that kept nothing count: that way chose them
                    self.ways.observe(measured, running, tokens, time.perf_counter() - t0)
                return []
            measured, t0 = None, time.perf_counter()   # a mixed batch measures neither way
        chunks = self._prefill_chunks(starts, chunked=bool(steps or chained),
                                      per_step=max((depth for _, depth in chained.values()), default=1))
        for job in starts:
            if job.prefilled + len(chunks[id(job)]) == len(job.prefix):   # its prompt's last chunk
                try:
                    job.spec.local.start_drafters(job.prefix)
                except Exception as e:  # noqa: BLE001
                    job.finish(error=e)
        live = [j for j in steps + starts if not j.done.is_set()]
        calls = [(j.spec.local.seq, trees[id(j)].tokens, trees[id(j)].parents) if j.prefix is None
                 else (j.spec.local.seq, chunks[id(j)], None, True) for j in live]   # a prompt: its last logits
        live, calls = [j for j, c in zip(live, calls) if len(c[1])], [c for c in calls if len(c[1])]
        started = time.perf_counter()
        outputs = each_or_its_error(self.llm.score_batch, calls)
        seconds = time.perf_counter() - started
        self.seconds["draft"] += started - t0
        self.seconds["llm"] += seconds
        verified = []   # (step, its result): woken together below, so that their requests' threads
        # do not take the interpreter's lock from this one while it verifies the others
        for job, logits in zip(live, outputs):
            if isinstance(logits, Exception):
                job.finish(error=logits)
                continue
            try:
                if job.prefix is None:
                    verified.append((job, job.spec.local.settle(trees[id(job)], logits, seconds)))
                else:
                    chunk = len(chunks[id(job)])
                    self.llm.commit(job.spec.local.seq, range(chunk))
                    job.spec.local.stats.llm_seconds += seconds
                    job.prefilled += chunk
            except Exception as e:  # noqa: BLE001
                job.finish(error=e)
        # A start whose prompt is all in is done; the others go first in the next batch.
        unfinished = [job for job in starts if not job.done.is_set() and job.prefilled < len(job.prefix)]
        self.seconds["verify"] += time.perf_counter() - started - seconds
        if measured == "trees":
            self.ways.observe(measured, running, sum(len(path) for _, (path, _) in verified), time.perf_counter() - t0)
        self._settle(verified, [job for job in starts if not job.done.is_set() and job.prefilled == len(job.prefix)])
        return unfinished

    def _settle(self, verified: list[tuple[_Job, object]], started: Sequence[_Job] = ()) -> None:
        """Wake a batch's settled steps (each with its result; its successor queued) and its starts
        whose prompts are all in, together."""
        with self._lock:
            for job, result in verified:
                job.finish(result)
                job.spec.settled(job)
            for job in started:
                job.finish()
            self._trimmed = False
            self._active()

    def _run_chained(self, steps: list[tuple[_Job, int]], t0: float) -> int:
        """Steps of several tokens each, ``(job, tokens)``, greedy or sampled: incremental requests', those of
        requests whose drafts the batch's share leaves no room for (``LocalSpeculator.chain_depth``)
        and those whose drafters drafted nothing (``LocalSpeculator.chain_instead``),
        every sequence's in one LLM run (:meth:`~specinfer.engines.runtime.Runtime.decode_chains`),
        as an incremental request alone takes them (``LocalSpeculator.step``): a batch of one-token
        steps pays the run's fixed cost and this thread's Python for every token (measured: 16
        sequences at a context of 100, 8 tokens each in one run 1.22x the tokens/s of 8 batches of
        one token). A request that arrives meanwhile waits for that run (~8 tokens' time), then
        joins the next. Returns the tokens the steps made."""
        calls = [(job.spec.local.seq, [job.root], depth, job.spec.local.chain_sampling(depth)) for job, depth in steps]
        chains = each_or_its_error(self.llm.decode_chains, calls)
        seconds = time.perf_counter() - t0
        self.seconds["llm"] += seconds
        verified = []
        for (job, _), chain in zip(steps, chains):
            if isinstance(chain, Exception):
                job.finish(error=chain)
                continue
            try:
                verified.append((job, job.spec.local.settle_chain(job.root, chain, seconds)))
            except Exception as e:  # noqa: BLE001
                job.finish(error=e)
        self._settle(verified)
        return sum(len(path) for _, (path, _) in verified)

    def _prefill_chunks(self, starts: list[_Job], chunked: bool, per_step: int = 1) -> dict[int, list[int]]:
        """Each start's prompt tokens for this batch: the rest of its prompt, or, where other
        requests step in the batch, at most ``prefill_chunk_tokens`` in all for each token a step
        takes (``per_step``: chains of 8 take 8 times as many, so that a prompt holds the running
        requests no longer a token, and new requests join their chains as soon; the oldest start
        first; a start left with none waits for the next batch)."""
        left = self.prefill_chunk_tokens * per_step if chunked and self.prefill_chunk_tokens else None
        chunks = {}
        for job in starts:
            rest = job.prefix[job.prefilled:]
            chunks[id(job)] = rest if left is None else rest[:left]
            if left is not None:
                left -= len(chunks[id(job)])
            self.prefill_chunks += bool(chunks[id(job)])
        return chunks


def warm_batches(runtime: Runtime, most: int) -> None:
    """One run of every batch size from 1 to ``most`` sequences, scoring and drafting chains (as
    greedy requests' chains run, :meth:`Scheduler._run_chained`), on sequences of one token made
    and released here: an engine may open a session for a batch size at its first run (ONNX
    Runtime: ~0.1 s each for the embedded LLM), which a burst of requests would otherwise wait for
    (16 streams: 0.61 s). ~1.2 s for sizes up to 16 here; sampled decoding's chains too, where the
    engine draws them (:attr:`~specinfer.engines.runtime.Runtime.samples_chains`), a lone
    request's among them (its first sampled chain opened a session: 140-180 ms)."""
    depths = [runtime.draft_depth] if chains(runtime) else []
    warm_shapes(runtime, tree_sizes=[1], chain_depths=depths, batch_sizes=range(1, most + 1), decoding=True)
    if depths and runtime.samples_chains:
        warm_shapes(runtime, chain_depths=depths, sampled=True, batch_sizes=range(1, most + 1), decoding=True)


def warm_for_requests(llm: Runtime, ssms: Sequence[Runtime] = (), sampling_ssms: Sequence[Runtime] = (),
                      tree: Sequence[int] | None = None, lookup: bool = False) -> None:
    """What a first request would otherwise wait for, done now (a pipeline's or a fused server's
    load), for requests on ``tree`` (their default: None, the dynamic tree) drafting with these
    SSMs and by ``lookup``. On the dynamic tree: the LLM's cost table timed (:func:`step_cost`,
    ~0.5 s for the embedded LLM; the demo's first speculative request spent 0.63 of its 0.74 s on
    it and the drafters' first runs) and every drafter depth of the SSMs run once
    (:func:`warm_drafter`): greedy for ``ssms``, sampled for the SSMs that draft for sampled
    requests (``sampling_ssms``, or ``ssms`` where there are none). Always, a lone request's runs
    (:func:`warm_batches` of one): its first sampled chain opened a session (140-180 ms for the
    embedded LLM, against ~7 ms later)."""
    if tree is None and (ssms or sampling_ssms or lookup):
        step_cost(llm)
        for ssm in ssms:
            warm_drafter(ssm)
        for ssm in sampling_ssms or ssms:
            warm_drafter(ssm, sampled=True)
    warm_batches(llm, 1)


def _return_free_heap() -> None:
    """Hand the C heap's free pages back to the system. glibc keeps them otherwise: measured on the
    embedded LLM when each session had its own copy of the weights, a session for every batch size
    took the process from 123 to 612 MB; dropping them left 274 MB, and this then 129 MB."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: its allocator keeps its own counsel
        pass


class BatchedSpeculator:
    """One request's :class:`~specinfer.generate.Speculator` on a :class:`Scheduler`: its state is
    a LocalSpeculator's, its model calls run in the scheduler's batches."""

    def __init__(self, scheduler: Scheduler, max_new_tokens: int, options: dict, stats: Stats | None, budget: int,
                 seq_id: str | None = None):
        self.scheduler, self.max_new_tokens, self.options, self.budget = scheduler, max_new_tokens, options, budget
        self.seq_id = seq_id or uuid.uuid4().hex
        self.stats = stats if stats is not None else Stats()
        self.max_context = scheduler.llm.max_context
        self.local: LocalSpeculator | None = None
        self.reserved = 0
        self.produced = 0          # tokens the settled steps emitted (paths' tokens and bonus)
        self.ahead: _Job | None = None   # the next step, queued before the request asked for it
        self.finished = False      # no step follows the last one settled (its tokens are all made)

    def start(self, prefix: list[int]) -> None:
        job = self.open(prefix)
        try:
            self.scheduler._submit(job)
        except BaseException:
            self.release()
            raise

    def open(self, prefix: list[int]) -> _Job:
        """Admit the sequence (reserve the KV it may reach) and make its state; the job that puts
        its prompt in, to run (:meth:`start` submits it)."""
        s = self.scheduler
        # The prompt (prefix and root), max_new_tokens and one tree: the most this sequence holds.
        tokens = min(s.llm.max_context, len(prefix) + 1 + self.max_new_tokens + self.budget)
        nbytes = tokens * s.bytes_per_token
        s._admit(nbytes, tokens)
        self.reserved = nbytes
        try:
            # Between batches: making the sequences' state runs the models (and, at the LLM's first
            # drafting request, times its steps and chain runs: tree_sizing.step_cost), which must
            # not run beside a batch on another thread (seen: garbled tokens in later batches).
            with s._between_batches():
                self.local = LocalSpeculator(s.llm, s.drafters(self.options["params"]), stats=self.stats,
                                             seq_id=self.seq_id, capacity=tokens,
                                             max_new_tokens=self.max_new_tokens, **self.options)
            with s._lock:
                s.running.add(self)
        except BaseException:
            self.release()
            raise
        self.max_context = tokens
        return _Job(self, prefix=[int(t) for t in prefix])

    def step(self, root: int, budget: int) -> tuple[list[int], int]:
        """One step from ``root`` (the last step's bonus token). The step after it is queued as
        soon as this one is settled, before the request asks (see :meth:`settled`); this takes it."""
        s = self.scheduler
        with s._lock:
            job, self.ahead = self.ahead, None
            if job is not None and job in s._jobs:   # not run yet: it takes the request's own budget
                job.root, job.budget = int(root), budget
            elif job is not None and job.root != root:
                raise SpecInferError(f"a step from token {root} was asked for, but the sequence's next step, "
                                     f"from its last bonus token {job.root}, has run already")
            if job is None:
                job = _Job(self, root=int(root), budget=budget, stats=Stats())
                s._queue(job)
            elif job.done.is_set():   # settled before it was asked for: the next one goes now
                self._queue_next(job)
        try:
            return s._wait(job)
        finally:
            self.stats.add_step(job.stats)

    def settled(self, job: _Job) -> None:
        """``job``, a step, is settled: count what it emitted, and queue the next step if the
        request already took this one (otherwise :meth:`step` queues it when it does). Called
        under the scheduler's lock."""
        if job.stats is None:   # a tree verified for the ``llm`` model: its caller steps it
            return
        self.produced += len(job.result[0])
        if self.ahead is None:
            self._queue_next(job)

    def _queue_next(self, last: _Job) -> None:
        """Queue the step after ``last`` (settled), which the request's loop (:func:`decode`) asks
        for next unless it stops: at EOS, a stop word or a cancel, that step is wasted work; at
        ``max_new_tokens`` or the end of the sequence's room there is none. Running it ahead is
        what lets the scheduler's next batch start while the requests' threads still handle the
        last one's tokens. Called under the scheduler's lock."""
        if last.error is not None or self.local is None or self.scheduler._closed \
                or self.produced >= self.max_new_tokens:
            self.finished = True
            return
        room = self.max_context - self.scheduler.llm.length(self.local.seq)   # as decode counts it
        if room < 1:
            self.finished = True
            return
        self.ahead = _Job(self, root=last.result[1], budget=min(last.budget, room), stats=Stats())
        self.scheduler._queue(self.ahead)

    def verify_job(self, tree: TokenTree) -> _Job:
        """The job of a step whose tree was drafted elsewhere (the served ``llm`` model's: the SSM
        models drafted it, ``tree_builder`` merged it): verify it, commit the accepted path; its
        result is (path tokens, bonus), as :meth:`step`'s."""
        return _Job(self, root=tree.tokens[0], tree=tree)

    def release(self) -> None:
        s = self.scheduler
        with s._lock:
            s.running.discard(self)
            self.ahead = None   # if queued, the batch that takes it finds the sequence released
            s._active()
        if self.local is not None:
            with s._between_batches():   # never free a buffer that a running batch writes
                self.local.release()
            self.local = None
        if self.reserved:
            s._free(self.reserved)
            self.reserved = 0

