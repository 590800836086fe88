"""`specinfer distill`: an SSM fine-tuned on the LLM's whole next-token distribution.

Boost-tuning (``boost_tune.py``) teaches an SSM the LLM's greedy token, which is what greedy
verification accepts. Under sampling, verification accepts a draft drawn from the SSM's q with
probability sum_x min(p(x), q(x)) (p: the LLM's law), and a model trained on hard labels is sharper
than the LLM, so it overlaps p less than it could. Here the SSM learns p itself (soft targets, after
DistillSpec, Zhou et al., ICLR 2024): the cross-entropy against the LLM's top-``top_k`` probabilities
at temperature 1, on the LLM's own greedy and sampled continuations of prompts from the corpus
(``llm_continuations``), starting from a boost-tuned SSM. The report gives, on held-out prompts, that
overlap at temperatures 1 and 0.7 and the greedy agreement, before and after. The SSM is saved
with its logits sharpened by the scale its draws are drawn at (:func:`fold_draft_temperature`).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..export.draft_vocab import DRAFT_VOCAB
from ..speculate import DRAFT_TEMPERATURE_SCALE
from .boost_tune import llm_continuations
from .corpus import Corpus
from .train import TrainConfig, encode_files, fit, save_checkpoint


@dataclass
class DistillConfig:
    """The defaults are the run that made the embedded ``distilled_ssm1`` (from the embedded SSM 1)."""
    greedy_prompts: int = 2048    # followed by the LLM's greedy continuation
    sampled_prompts: int = 4096   # by its sample at temperature 1
    cool_prompts: int = 2048      # by its sample at temperature 0.7
    prompt_len: int = 64
    new_tokens: int = 64
    top_k: int = 64               # teacher probabilities kept per position (the rest of its mass is dropped)
    steps: int = 1500
    batch_size: int = 32
    lr: float = 1e-3
    test_prompts: int = 128
    seed: int = 1


def teacher_targets(llm, tokens: np.ndarray, top_k: int, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The LLM's ``top_k`` likeliest next tokens at every position of ``tokens`` [rows, T] and their
    probabilities (temperature 1): int32 and float16 arrays [rows, T, top_k], likeliest first."""
    import torch
    from tqdm import tqdm

    indices = np.zeros(tokens.shape + (top_k,), np.int32)
    probs = np.zeros(tokens.shape + (top_k,), np.float16)
    llm.eval()
    with torch.inference_mode():
        for i in tqdm(range(0, len(tokens), batch), desc="LLM distributions", unit="batch"):
            logp = torch.log_softmax(llm(torch.from_numpy(tokens[i:i + batch].astype(np.int64))).logits.float(), -1)
            top, index = logp.topk(top_k, -1)
            indices[i:i + batch], probs[i:i + batch] = index.numpy(), top.exp().numpy()
    return indices, probs


def agreement(llm, ssm, tokens: np.ndarray, prompt_len: int, temperature: float) -> float:
    """Mean over the continuation's positions of sum_x min(p(x), q(x)), p and q the LLM's and the
    SSM's laws at ``temperature`` (at 0: how often their argmax agree)."""
    import torch

    with torch.inference_mode():
        x = torch.from_numpy(tokens.astype(np.int64))
        p, q = (m.eval()(x).logits[:, prompt_len - 1:-1].float() for m in (llm, ssm))
    if temperature == 0:
        return float((p.argmax(-1) == q.argmax(-1)).float().mean())
    return float(torch.minimum(torch.softmax(p / temperature, -1), torch.softmax(q / temperature, -1)).sum(-1).mean())


def fold_draft_temperature(model, scale: float):
    """``model`` with its logits multiplied by ``scale`` (its final norm's weight scaled: the norm
    feeds only the head, so tied embeddings are untouched), in place. Sampled drafts are drawn at
    ``DRAFT_TEMPERATURE_SCALE`` times the LLM's temperature, which suits boost-tuned SSMs (sharper
    than the LLM); a distilled SSM is calibrated at the LLM's temperature, so it is saved sharpened
    by that scale and its draws follow its calibrated law. Its greedy token is unchanged."""
    import torch

    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    return model


def distill(llm_dir: str | Path, ssm_dir: str | Path, corpus: Corpus, out_dir: str | Path,
            cfg: DistillConfig = DistillConfig()) -> dict:
    """Fine-tune the SSM in ``ssm_dir`` on the LLM's distributions into ``out_dir``; returns (and
    writes beside it, as ``distillation.json``) the report."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    llm_dir, out_dir = Path(llm_dir), Path(out_dir)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    llm = transformers.AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    ssm = transformers.AutoModelForCausalLM.from_pretrained(ssm_dir, dtype=torch.float32)
    tok = Tokenizer.from_file(str(llm_dir / "tokenizer.json"))
    stream = encode_files(tok, corpus.texts(corpus.train))
    tokens = np.concatenate([llm_continuations(llm, stream, n, cfg.prompt_len, cfg.new_tokens, rng, t, desc=f"LLM at T={t}")[0]
                             for n, t in ((cfg.greedy_prompts, 0.0), (cfg.sampled_prompts, 1.0), (cfg.cool_prompts, 0.7)) if n])
    indices, probs = teacher_targets(llm, tokens, cfg.top_k)
    test_stream = encode_files(tok, corpus.texts(corpus.test))
    tests = {t: llm_continuations(llm, test_stream, cfg.test_prompts, cfg.prompt_len, cfg.new_tokens,
                                  np.random.default_rng(cfg.seed + 1), t, desc=f"held out, T={t}")[0]
             for t in (0.0, 0.7, 1.0)}

    def held_out() -> dict:
        return {f"T={t}": agreement(llm, ssm, rows, cfg.prompt_len, t) for t, rows in tests.items()}

    report = {"config": asdict(cfg), "teacher_mass_kept": float(probs.sum(-1, dtype=np.float32).mean()),
              "held_out_before": held_out()}

    def next_batch(r: np.random.Generator):
        # Widened per batch: the whole set as int64 and float32 would take ~0.8 GB at the defaults.
        rows = r.integers(0, len(tokens), cfg.batch_size)
        return (torch.from_numpy(tokens[rows].astype(np.int64)),
                (torch.from_numpy(indices[rows].astype(np.int64)), torch.from_numpy(probs[rows].astype(np.float32))), None)

    fit(ssm, next_batch, TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                                     warmup=max(1, min(50, cfg.steps // 10)), seed=cfg.seed), desc="distill")
    report["held_out_after"] = held_out()
    report["draft_temperature_scale_folded"] = DRAFT_TEMPERATURE_SCALE
    save_checkpoint(fold_draft_temperature(ssm, DRAFT_TEMPERATURE_SCALE), out_dir, llm_dir, tokenizer=False)
    if (Path(ssm_dir) / DRAFT_VOCAB).is_file():   # the same SSM, so the same tokens to draft from
        shutil.copy(Path(ssm_dir) / DRAFT_VOCAB, out_dir / DRAFT_VOCAB)
    (out_dir / "distillation.json").write_text(json.dumps(report, indent=2))
    for when in ("before", "after"):
        print(f"held out, {when}: " + ", ".join(f"{k} {v:.3f}" for k, v in report[f"held_out_{when}"].items()),
              "(T=0: greedy agreement; else sum min(p, q))", flush=True)
    return report
