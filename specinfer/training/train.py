"""`specinfer train`: a byte-level BPE tokenizer and a small Llama LLM on the stdlib corpus.

Plain PyTorch: random windows of the concatenated training files, AdamW with warm-up and cosine
decay, bf16 autocast on CPU (AMX where the CPU has it), a fixed seed. The result is an ordinary
Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer.json).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .corpus import Corpus

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """A byte-level BPE tokenizer (no prefix space, no BOS: code is not prose); ``<|endoftext|>`` = 0
    separates files in training and ends generation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
         "model_max_length": 1024, "clean_up_tokenization_spaces": False}, indent=2))
    return tok


def encode_files(tok, texts: list[str]) -> np.ndarray:
    """All files as one int32 stream, each followed by ``<|endoftext|>``."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
    return np.asarray(ids, dtype=np.int32)


@dataclass
class TrainConfig:
    """One training run; the defaults are the committed demo LLM."""
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    vocab_size: int = 8192
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1400
    lr: float = 1.5e-3
    warmup: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 200


def llama_config(cfg: TrainConfig, max_positions: int = 1024):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=max_positions,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def random_windows(data: np.ndarray, batch: int, seq_len: int):
    """A batch sampler of language-modelling windows from a token stream."""
    import torch

    def next_batch(rng: np.random.Generator):
        starts = rng.integers(0, len(data) - seq_len - 1, batch)
        x = torch.from_numpy(np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64))
        return x[:, :-1], x[:, 1:], None
    return next_batch


def evaluate(model, data: np.ndarray, seq_len: int, batch: int = 16, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy over consecutive windows of held-out data."""
    import torch

    n = min(max_windows, (len(data) - 1) // seq_len)
    x = torch.from_numpy(data[:n * seq_len + 1].astype(np.int64))
    inputs, labels = x[:-1].view(n, seq_len), x[1:].view(n, seq_len)
    model.eval()
    losses = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(0, n, batch):
            logits = model(inputs[i:i + batch]).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[i:i + batch].flatten(),
                                                            reduction="sum").item())
    model.train()
    return sum(losses) / (n * seq_len)


def fit(model, next_batch, cfg: TrainConfig, checkpoint_dir: Path | None = None,
        test: np.ndarray | None = None, desc: str = "train", log: list | None = None) -> None:
    """The training loop shared by the LLM and the SSMs. ``next_batch(rng)`` gives (inputs, labels,
    loss mask or None); labels are the next tokens, or soft targets as (tokens, probabilities), each
    ``[batch, seq, k]``: the loss is then the cross-entropy against those probabilities. Resumes
    from the trainer state in ``checkpoint_dir``; evaluates on ``test``."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps)))))
    start = 0
    state_path = checkpoint_dir / "trainer_state.pt" if checkpoint_dir else None
    if state_path and state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        rng.bit_generator.state = state["rng"]
        start = state["step"]
    model.train()
    bar = tqdm(range(start, cfg.steps), desc=desc, initial=start, total=cfg.steps, unit="step")
    began, loss_avg = time.perf_counter(), None
    for step in bar:
        inputs, labels, mask = next_batch(rng)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs).logits
        if isinstance(labels, tuple):   # soft targets: a teacher's top tokens and their probabilities
            tokens, probs = labels
            losses = -(torch.log_softmax(logits.float(), -1).gather(-1, tokens) * probs).sum(-1).flatten()
        else:
            losses = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        loss = losses.mean() if mask is None else (losses * mask.flatten()).sum() / mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_avg:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
        done = step + 1
        if test is not None and (done % cfg.eval_every == 0 or done == cfg.steps):
            held_out = evaluate(model, test, cfg.seq_len)
            bar.write(f"{desc} step {done}: train loss {loss_avg:.3f}, held-out loss {held_out:.3f}")
            if log is not None:
                log.append({"step": done, "train_loss": loss_avg, "test_loss": held_out,
                            "seconds": time.perf_counter() - began})
        if state_path and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            state_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "rng": rng.bit_generator.state, "step": done}, state_path)
    bar.close()


def save_checkpoint(model, out_dir: Path, tokenizer_dir: Path, dtype: str = "float16", tokenizer: bool = True) -> Path:
    """An ordinary HF checkpoint folder, weights in ``dtype``, with the tokenizer files beside them
    (SSMs go without: they share the LLM's, and the committed models must stay small)."""
    import shutil

    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(out_dir)
    model.float()
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer else ():
        if (tokenizer_dir / name).resolve() != (out_dir / name).resolve():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def train_llm(corpus: Corpus, out_dir: str | Path, cfg: TrainConfig = TrainConfig(),
              work_dir: str | Path | None = None) -> Path:
    """Tokenizer, then the LLM; ``work_dir`` keeps the resumable trainer state (default: beside out)."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir else out_dir.with_name(out_dir.name + ".work")
    torch.manual_seed(cfg.seed)
    if (work / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    else:
        print(f"training a {cfg.vocab_size}-token byte-level BPE on {len(corpus.train)} files ...", flush=True)
        tok = train_tokenizer(corpus.texts(corpus.train), cfg.vocab_size, work)
    train_ids, test_ids = encode_files(tok, corpus.texts(corpus.train)), encode_files(tok, corpus.texts(corpus.test))
    model = transformers.LlamaForCausalLM(llama_config(cfg))
    params = sum(p.numel() for p in model.parameters())
    print(f"LLM: {params / 1e6:.1f}M parameters; corpus: {len(train_ids) / 1e6:.2f}M training tokens, "
          f"{len(test_ids) / 1e6:.2f}M held-out; {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens "
          f"({cfg.steps * cfg.batch_size * cfg.seq_len / len(train_ids):.1f} epochs)", flush=True)
    log: list[dict] = []
    fit(model, random_windows(train_ids, cfg.batch_size, cfg.seq_len), cfg, work, test=test_ids, desc="LLM", log=log)
    save_checkpoint(model, out_dir, work)
    (out_dir / "training.json").write_text(json.dumps(
        {"config": asdict(cfg), "parameters": params, "train_tokens": int(len(train_ids)),
         "test_tokens": int(len(test_ids)), "train_files": len(corpus.train), "test_files": len(corpus.test),
         "log": log}, indent=2))
    return out_dir
