"""The generation loop: incremental decoding is speculative decoding with no SSM.

Every step the LLM scores a token tree in one Runtime call and keeps a verified path plus one token
of its own (the bonus). The tree's root is the last emitted token, which no model has in its KV
cache yet; with no SSM the tree is that root alone and a step is one incremental decoding step.

    prefill(prompt[:-1]); root = prompt[-1]
    loop: SSMs draft trees from root -> merge -> LLM scores the tree -> verify -> commit -> emit
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .engines.runtime import Runtime
from .errors import SpecInferError
from .sampling import SamplingParams
from .speculate import SSMDrafter, check_vocab
from .tree import TokenTree, merge
from .verify import verify

DEFAULT_TREE = (1, 1, 3, 1, 1, 1, 1, 1)  # SpecInfer's expansion config
DEFAULT_BUDGET = 64                      # tree nodes, root included


@dataclass
class Stats:
    """What requests cost (one, or the sum of several given the same Stats). ``tokens_per_step`` counts every emitted token of a verification step
    (accepted speculated tokens plus the LLM's bonus token), as SpecInfer reports it."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    tokens_per_step: list[int] = field(default_factory=list)
    draft_tokens: int = 0      # speculated tree nodes sent to verification (root excluded)
    accepted_draft_tokens: int = 0
    ssm_seconds: float = 0.0
    llm_seconds: float = 0.0
    total_seconds: float = 0.0
    stop_reason: str = ""

    @property
    def steps(self) -> int:
        return len(self.tokens_per_step)

    @property
    def mean_tokens_per_step(self) -> float:
        return float(np.mean(self.tokens_per_step)) if self.tokens_per_step else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.tokens_per_step).items()))

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.ssm_seconds - self.llm_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_seconds:.2f} s ({self.tokens_per_second:.1f} tokens/s), "
                f"{self.steps} steps, {self.mean_tokens_per_step:.2f} tokens/step {self.histogram}, "
                f"time: SSM {self.ssm_seconds:.2f} s, LLM {self.llm_seconds:.2f} s, "
                f"other {self.other_seconds:.2f} s; stop: {self.stop_reason}")


def generate_ids(
    llm: Runtime,
    prompt: Sequence[int],
    *,
    ssms: Sequence[Runtime] = (),
    tree: Sequence[int] = DEFAULT_TREE,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_ids: Sequence[int] = (),
    budget: int = DEFAULT_BUDGET,
    stats: Stats | None = None,
) -> Iterator[list[int]]:
    """Yield the new token ids of each step until EOS (included), ``max_new_tokens`` or the context
    capacity. Greedy output is token for token the LLM's own greedy decoding; sampled output is
    distributed as the LLM's own sampling (multi-step speculative sampling)."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise SpecInferError("the prompt is empty")
    if max_new_tokens < 1:
        raise SpecInferError(f"max tokens must be >= 1, got {max_new_tokens}")
    if budget < 1:
        raise SpecInferError(f"tree budget must be >= 1 node, got {budget}")
    if len(prompt) >= llm.max_context:
        raise SpecInferError(f"the prompt has {len(prompt)} tokens; the context holds {llm.max_context} "
                             f"(prompt plus at least one new token)")
    check_vocab(llm, ssms)
    stats = stats if stats is not None else Stats()  # accumulates over the requests it is given
    stats.prompt_tokens += len(prompt)
    rng = np.random.default_rng(params.seed)
    eos = set(int(e) for e in eos_ids)
    started = time.perf_counter()
    seq = llm.start()
    drafters = [SSMDrafter(rt, i) for i, rt in enumerate(ssms)]
    try:
        t0 = time.perf_counter()
        if len(prompt) > 1:
            llm.prefill(seq, prompt[:-1])
        t1 = time.perf_counter()
        for d in drafters:
            d.prefill(prompt[:-1])
        stats.llm_seconds += t1 - t0
        stats.ssm_seconds += time.perf_counter() - t1
        root, produced, stop = prompt[-1], 0, ""
        while not stop:
            room = llm.capacity(seq) - llm.length(seq)
            if room < 1:
                stats.stop_reason = "context capacity"
                return
            limit = min(budget, room)
            t0 = time.perf_counter()
            trees = [d.draft(root, tree, params, rng, limit) for d in drafters] if limit > 1 else []
            token_tree = merge(trees, limit)[0] if trees else TokenTree(root)
            t1 = time.perf_counter()
            logits = llm.score(seq, token_tree.tokens, token_tree.parents)
            verdict = verify(token_tree, logits, params, rng)
            llm.commit(seq, verdict.path)
            t2 = time.perf_counter()
            path_tokens = [token_tree.tokens[i] for i in verdict.path]
            for d in drafters:
                d.commit(path_tokens)
            stats.ssm_seconds += (t1 - t0) + (time.perf_counter() - t2)
            stats.llm_seconds += t2 - t1
            stats.draft_tokens += len(token_tree) - 1
            stats.accepted_draft_tokens += len(verdict.path) - 1
            new = path_tokens[1:] + [verdict.bonus]
            for i, token in enumerate(new):  # stop conditions may fall inside the accepted path
                if token in eos or produced + i + 1 >= max_new_tokens:
                    new = new[:i + 1]
                    stop = stats.stop_reason = "eos" if token in eos else "max tokens"
                    break
            produced += len(new)
            stats.new_tokens += len(new)
            stats.tokens_per_step.append(len(new))
            yield new
            root = verdict.bonus
    finally:
        llm.release(seq)
        for d in drafters:
            d.release()
        stats.total_seconds += time.perf_counter() - started
