"""`specinfer boost-tune`: SpecInfer's collective boost-tuning of several small SSMs for one LLM.

The data is the LLM's own behaviour: prompts cut from the training split, each followed by the LLM's
greedy continuation or by its own sample (temperature 1: text the corpus does not have, which is
what an SSM meets on prompts from elsewhere), and at every position the LLM's greedy next token as
the label (what greedy verification accepts). SSM 1
learns all of it. A prompt on whose continuation SSM 1 already agrees with the LLM (a share of
tokens >= ``agree_threshold``) is dropped; SSM 2, starting from SSM 1's weights, trains on the rest;
and so on. Each SSM thus covers the cases the ones before it miss, which is what a merged token
tree rewards. (SpecInfer describes the method; it published neither code nor weights for it.)
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .corpus import Corpus
from .train import TrainConfig, encode_files, fit, save_checkpoint


@dataclass
class BoostConfig:
    """The defaults are the committed demo SSMs (about 0.63M parameters each)."""
    num_ssms: int = 3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 192
    prompts: int = 4096          # followed by the LLM's greedy continuation
    sampled_prompts: int = 4096  # followed by the LLM's sample at ``temperature``
    temperature: float = 1.0
    test_prompts: int = 256
    prompt_len: int = 64
    new_tokens: int = 64
    steps: int = 3000        # SSM 1; later SSMs fine-tune for half as many
    batch_size: int = 32
    lr: float = 3e-3
    agree_threshold: float = 0.75
    tree_prompts: int = 32   # held-out prompts decoded speculatively for the acceptance figure (0: skip)
    seed: int = 0


def llm_continuations(model, stream: np.ndarray, count: int, prompt_len: int, new_tokens: int,
                      rng: np.random.Generator, temperature: float = 0.0, batch: int = 64,
                      desc: str = "LLM continuations"):
    """``count`` prompts cut at random from ``stream``, each with the LLM's continuation: greedy at
    temperature 0, else sampled at ``temperature`` (with ``rng``'s seed).

    Returns (tokens, labels), both ``[count, prompt_len + new_tokens]``: labels[:, t] is the LLM's
    greedy next token after tokens[:, :t + 1] (in a greedy continuation, simply the next token).
    """
    import torch
    from tqdm import tqdm

    starts = rng.integers(0, len(stream) - prompt_len, count)
    prompts = np.stack([stream[s:s + prompt_len] for s in starts]).astype(np.int64)
    tokens, labels = [], []
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    model.eval()
    with torch.inference_mode():
        for i in tqdm(range(0, count, batch), desc=desc, unit="batch"):
            x = torch.from_numpy(prompts[i:i + batch])
            out = model(x, use_cache=True)
            steps, past = [out.logits.argmax(-1)], out.past_key_values
            seq = [x]
            for _ in range(new_tokens):
                if temperature > 0:
                    probs = torch.softmax(out.logits[:, -1].float() / temperature, -1)
                    nxt = torch.multinomial(probs, 1, generator=generator)
                else:
                    nxt = steps[-1][:, -1:]
                seq.append(nxt)
                out = model(nxt, past_key_values=past, use_cache=True)
                steps.append(out.logits.argmax(-1))
                past = out.past_key_values
            tokens.append(torch.cat(seq, 1).numpy())
            labels.append(torch.cat(steps, 1).numpy())
    return np.concatenate(tokens).astype(np.int32), np.concatenate(labels).astype(np.int32)


def greedy_hits(model, tokens: np.ndarray, labels: np.ndarray, prompt_len: int, batch: int = 128) -> np.ndarray:
    """``[rows, new_tokens]`` booleans: where the model's greedy token equals the label in the
    continuation (teacher-forced on the LLM's own text, as in verification)."""
    import torch

    model.eval()
    hits = []
    with torch.inference_mode():
        for i in range(0, len(tokens), batch):
            pred = model(torch.from_numpy(tokens[i:i + batch].astype(np.int64))).logits.argmax(-1).numpy()
            hits.append(pred[:, prompt_len:] == labels[i:i + batch, prompt_len:])
    model.train()
    return np.concatenate(hits)


def tree_acceptance(llm, ssms: list, prompts: list[list[int]], tree: list[int], max_new_tokens: int = 64) -> float:
    """Mean tokens per verification step of our speculative decoding (greedy) with these Runtimes."""
    from ..generate import Stats, generate_ids

    stats = Stats()
    for prompt in prompts:
        for _ in generate_ids(llm, prompt, ssms=ssms, tree=tree, max_new_tokens=max_new_tokens, stats=stats):
            pass
    return stats.mean_tokens_per_step


def _rows(tokens: np.ndarray, labels: np.ndarray, batch: int):
    import torch

    def next_batch(rng: np.random.Generator):
        rows = rng.integers(0, len(tokens), batch)
        return (torch.from_numpy(tokens[rows].astype(np.int64)), torch.from_numpy(labels[rows].astype(np.int64)),
                None)
    return next_batch


def ssm_config(llm_config, cfg: BoostConfig):
    """The LLM's config (vocabulary, RoPE, special tokens) with the SSM's sizes."""
    config = copy.deepcopy(llm_config)
    config.update(dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.hidden_size // cfg.num_heads,
                       tie_word_embeddings=True))
    return config


def boost_tune(llm_dir: str | Path, corpus: Corpus, out_dir: str | Path, cfg: BoostConfig = BoostConfig()) -> dict:
    """Train ``cfg.num_ssms`` SSMs into ``out_dir/ssm1`` ...; returns (and writes) the report."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    llm_dir, out_dir = Path(llm_dir), Path(out_dir)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    llm = transformers.AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float32)
    tok = Tokenizer.from_file(str(llm_dir / "tokenizer.json"))
    stream = encode_files(tok, corpus.texts(corpus.train))
    parts = [llm_continuations(llm, stream, n, cfg.prompt_len, cfg.new_tokens, rng, temperature, desc=desc)
             for n, temperature, desc in ((cfg.prompts, 0.0, "LLM greedy continuations"),
                                          (cfg.sampled_prompts, cfg.temperature, "LLM samples")) if n]
    train_tokens, train_labels = (np.concatenate(a) for a in zip(*parts))
    test_tokens, test_labels = llm_continuations(llm, encode_files(tok, corpus.texts(corpus.test)), cfg.test_prompts,
                                                 cfg.prompt_len, cfg.new_tokens, rng, desc="held-out continuations")
    del llm

    report: dict = {"config": asdict(cfg), "ssms": []}
    keep = np.ones(len(train_tokens), dtype=bool)
    first, held_out_hits = None, []
    for k in range(1, cfg.num_ssms + 1):
        if first is None:
            model = transformers.LlamaForCausalLM(ssm_config(transformers.AutoConfig.from_pretrained(llm_dir), cfg))
            steps = cfg.steps
        else:  # SpecInfer fine-tunes every SSM from one base; ours is SSM 1
            model, steps = copy.deepcopy(first), cfg.steps // 2
        train_cfg = TrainConfig(steps=steps, batch_size=cfg.batch_size, lr=cfg.lr if first is None else cfg.lr / 3,
                                warmup=max(1, min(100, steps // 10)), seed=cfg.seed + k)
        fit(model, _rows(train_tokens[keep], train_labels[keep], cfg.batch_size), train_cfg, desc=f"SSM {k}")
        if first is None:
            first = model
        own = greedy_hits(model, train_tokens[keep], train_labels[keep], cfg.prompt_len).mean(1)
        held_out_hits.append(greedy_hits(model, test_tokens, test_labels, cfg.prompt_len))
        dropped = np.flatnonzero(keep)[own >= cfg.agree_threshold]
        entry = {"ssm": k, "parameters": sum(p.numel() for p in model.parameters()), "train_prompts": int(keep.sum()),
                 "agreement_own_prompts": float(own.mean()), "agreement_held_out": float(held_out_hits[-1].mean()),
                 "dropped_prompts": int(len(dropped))}
        keep[dropped] = False
        report["ssms"].append(entry)
        print(f"SSM {k}: {entry['parameters'] / 1e6:.2f}M parameters, trained on {entry['train_prompts']} prompts, "
              f"agreement {entry['agreement_own_prompts']:.3f} on them, {entry['agreement_held_out']:.3f} held out; "
              f"{len(dropped)} prompts dropped, {int(keep.sum())} left", flush=True)
        save_checkpoint(model, out_dir / f"ssm{k}", llm_dir, tokenizer=False)
        if not keep.any():
            break
    # Held out, token by token: how often at least one SSM proposes the LLM's token (what merging buys).
    report["held_out_any_ssm_agrees"] = float(np.any(held_out_hits, axis=0).mean())
    report_file = out_dir / "boost_tuning.json"
    report_file.write_text(json.dumps(report, indent=2))   # before the evaluation: training is the costly part
    if cfg.tree_prompts:
        tree = [1, 1, 3, 1, 1, 1, 1, 1]
        prompts = [list(map(int, row[:cfg.prompt_len])) for row in test_tokens[:cfg.tree_prompts]]
        from ..engines.loader import load_runtime

        llm_rt = load_runtime(llm_dir, "onnxruntime")
        ssm_rts = [load_runtime(out_dir / f"ssm{e['ssm']}", "onnxruntime") for e in report["ssms"]]
        report["tree"] = ",".join(map(str, tree))
        report["tokens_per_step_ssm1"] = tree_acceptance(llm_rt, ssm_rts[:1], prompts, tree)
        report["tokens_per_step_merged"] = tree_acceptance(llm_rt, ssm_rts, prompts, tree)
        print(f"held out, tree {report['tree']}: {report['tokens_per_step_ssm1']:.2f} tokens per step with SSM 1, "
              f"{report['tokens_per_step_merged']:.2f} with all {len(ssm_rts)} merged", flush=True)
    print(f"some SSM agrees with the LLM on {report['held_out_any_ssm_agrees']:.1%} of held-out tokens", flush=True)
    report_file.write_text(json.dumps(report, indent=2))
    return report
