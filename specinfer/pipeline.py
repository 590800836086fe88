"""Text in, text out: a target LLM, its SSMs and the tokenizer, opened from folders.

    from specinfer import Pipeline
    pipe = Pipeline("llm_dir", ssms=["ssm_dir"])
    for piece in pipe.stream("def fibonacci(n):", max_new_tokens=64):
        print(piece, end="")
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from .engines.loader import load_runtime
from .generate import DEFAULT_BUDGET, Stats, decode
from .scheduler import BATCH_TREE_TOKENS, IDLE_SECONDS, PREFILL_CHUNK_TOKENS, Scheduler, warm_for_requests
from .sampling import SamplingParams
from .speculate import DYNAMIC, parse_tree
from .text import TextStream, load_tokenizer


class Pipeline:
    """Speculative generation from model folders (exports or checkpoints), on ONNX Runtime by default."""

    def __init__(self, llm: str | Path, ssms: Sequence[str | Path] = (), tree: str | Sequence[int] | None = DYNAMIC,
                 sampling_ssms: Sequence[str | Path] = (),
                 budget: int = DEFAULT_BUDGET, engine: str = "onnxruntime", max_context: int | None = None,
                 threads: int | None = None, min_confidence: float = 0.0, lookup: bool = True, rule: str = "mss",
                 kv_budget: int | None = None, batch_tree_tokens: int = BATCH_TREE_TOKENS,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, idle_seconds: float | None = IDLE_SECONDS,
                 kv_dtype: str = "float32", matmul_dtype: str = "float32", warm: int = 0):
        """``lookup``: the dynamic tree also drafts by lookup in the sequence, at no model cost (with
        no SSMs, lookup alone; ``lookup=False`` and no SSMs is incremental decoding). ``rule``: the
        verification rule under sampling ("mss", "traversal" or "naive"; see verify.py).
        ``sampling_ssms``: SSMs that draft for sampled requests instead of ``ssms`` (e.g. distilled
        ones, ``specinfer distill``); none: ``ssms`` draft for every request.

        Streams may run from many threads at once: their steps are batched (scheduler.py), under
        ``kv_budget`` bytes of KV cache (default: half the memory available), their trees sharing
        ``batch_tree_tokens`` nodes per batch, and long prompts going in by chunks of
        ``prefill_chunk_tokens`` while other streams step. After ``idle_seconds`` with no stream
        running, the memory kept for batches is given back (None: kept). ``warm``: every batch size
        up to this many streams runs once at load, so that no burst waits for a session to open
        (~1.1 s and ~58 MB for 16 with the embedded LLM; 0: each opens at its first batch).
        ``kv_dtype``: the LLM's KV caches' type, float32 or float16 (half the memory and the bytes
        a step reads, K and V rounded to float16: logits move by ~1e-3; ONNX Runtime on the native
        kernels only). The SSMs keep
        float32 caches: theirs are small, and their drafter node reads float32 only. ``matmul_dtype``:
        the LLM's matrix products, float32, bfloat16 or int8 (see :func:`~specinfer.engines.loader.load_runtime`);
        the SSMs' stay float32. What a first request would wait for is done here, at load: the
        dynamic tree's cost table timed and its drafters opened, or incremental decoding's chain run,
        and the LLM's sampled chain (:func:`~specinfer.scheduler.warm_for_requests`)."""
        self.llm = load_runtime(llm, engine, max_context, threads, kv_dtype, matmul_dtype)
        self.ssms = [load_runtime(s, engine, max_context, threads) for s in ssms]
        self.sampling_ssms = [load_runtime(s, engine, max_context, threads) for s in sampling_ssms]
        self.tree = parse_tree(tree)
        self.budget = budget
        self.min_confidence, self.lookup, self.rule = min_confidence, lookup, rule
        self.tokenizer = load_tokenizer(getattr(self.llm, "dir", llm))
        self.eos_ids = self.llm.config.eos_token_ids
        self.scheduler = Scheduler(self.llm, self.ssms, sampling_ssms=self.sampling_ssms, kv_budget=kv_budget,
                                   batch_tree_tokens=batch_tree_tokens, prefill_chunk_tokens=prefill_chunk_tokens,
                                   idle_seconds=idle_seconds, warm=warm)
        warm_for_requests(self.llm, self.ssms, self.sampling_ssms, self.tree, lookup)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt).ids

    def stream_ids(self, prompt_ids: Sequence[int], max_new_tokens: int = 128,
                   params: SamplingParams = SamplingParams(), stats: Stats | None = None) -> Iterator[list[int]]:
        stats = stats if stats is not None else Stats()
        speculator = self.scheduler.speculator(max_new_tokens, params, self.tree, rule=self.rule, lookup=self.lookup,
                                               min_confidence=self.min_confidence, stats=stats, budget=self.budget)
        return decode(speculator, prompt_ids, max_new_tokens, self.eos_ids, self.budget, stats)

    def stream(self, prompt: str, max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
               stats: Stats | None = None) -> Iterator[str]:
        """Yield text as it is generated (UTF-8 safe)."""
        text = TextStream(self.tokenizer)
        for ids in self.stream_ids(self.encode(prompt), max_new_tokens, params, stats):
            piece = text.push(ids)
            if piece:
                yield piece
        tail = text.flush()
        if tail:
            yield tail

    def generate(self, prompt: str, max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
                 stats: Stats | None = None) -> str:
        return "".join(self.stream(prompt, max_new_tokens, params, stats))
