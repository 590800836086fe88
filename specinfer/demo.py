"""`make demo`: the whole path on the embedded default, ONNX Runtime on CPU.

checkpoint -> ONNX export (TreeAttention op) -> ONNX Runtime -> incremental and speculative
generation -> the same text, with speed and acceptance statistics.

Until the trained demo models land (they are trained here on the Python standard library), the demo
makes its models itself: a random-weight Llama 3 style LLM and, as its SSM, the LLM's own first
layer, with a byte-level BPE tokenizer trained on a few stdlib files. The text is therefore not
meaningful; what the demo shows is the path and the exactness (speculative == incremental).
"""
from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from .checkpoints import truncate_layers
from .engines.loader import cache_dir
from .generate import Stats
from .sampling import SamplingParams

DEMO_DIR = cache_dir() / "demo"


def make_demo_models(root: Path) -> tuple[Path, Path]:
    """A random LLM (4 layers) and an SSM made of its first layer, as checkpoint folders."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    llm, ssm = root / "llm", root / "ssm"
    if (llm / "config.json").is_file() and (ssm / "config.json").is_file():
        return llm, ssm
    llm.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f).read_text() for f in ("textwrap.py", "string.py", "bisect.py", "heapq.py")]
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(llm / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True, rope_theta=500000.0)
    transformers.LlamaForCausalLM(config).save_pretrained(llm)
    truncate_layers(llm, ssm, 1)
    return llm, ssm


def demo_exports(root: Path) -> tuple[Path, Path]:
    """The demo LLM and SSM, exported (made and exported on first use)."""
    from .export import export_model

    llm_ckpt, ssm_ckpt = make_demo_models(root / "checkpoints")
    exports = []
    for name, ckpt in (("llm", llm_ckpt), ("ssm", ssm_ckpt)):
        out = root / "onnx" / name
        if not (out / "manifest.json").is_file():
            export_model(ckpt, out, max_context=1024)
        exports.append(out)
    return exports[0], exports[1]


def main(argv: list[str] | None = None) -> None:
    from .pipeline import Pipeline

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dir", type=Path, default=DEMO_DIR)
    a = p.parse_args(argv)

    llm, ssm = demo_exports(a.dir)
    runs = {"incremental": Pipeline(llm), "speculative": Pipeline(llm, ssms=[ssm])}
    texts = {}
    for name, pipe in runs.items():
        stats = Stats()
        print(f"\n== {name} ==\n{a.prompt}", end="", flush=True)
        texts[name] = "".join(print(piece, end="", flush=True) or piece
                              for piece in pipe.stream(a.prompt, a.max_tokens, SamplingParams(), stats))
        print(f"\n-- {stats.summary()}")
    same = texts["incremental"] == texts["speculative"]
    print(f"\nspeculative output identical to incremental: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
