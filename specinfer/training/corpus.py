"""The demo corpus: the Python source of the interpreter's own standard library (PSF licensed).

The file list is fixed by sorted relative path. Kept out entirely: tests (``test/``, ``tests/``),
``idlelib/`` and ``turtledemo/`` (GUI apps), ``encodings/`` (generated code-page tables),
``pydoc_data/`` (one 700 kB string of prose), ``site-packages/``. Of the rest, every 20th file in
sorted order (index % 20 == 19) is the held-out test split, used only for evaluation and prompts.
"""
from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = {"test", "tests", "idlelib", "turtledemo", "encodings", "pydoc_data",
                 "site-packages", "dist-packages", "__pycache__"}
TEST_EVERY = 20


@dataclass
class Corpus:
    root: Path
    train: list[Path]
    test: list[Path]

    @staticmethod
    def texts(files: list[Path]) -> list[str]:
        return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def stdlib_corpus(root: str | Path | None = None) -> Corpus:
    """The train/test split of the stdlib under ``root`` (default: this interpreter's)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py")
                    if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    test = [f for i, f in enumerate(files) if i % TEST_EVERY == TEST_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % TEST_EVERY != TEST_EVERY - 1]
    return Corpus(root, train, test)


_DEF = re.compile(r"^[ \t]*(async[ \t]+)?def [A-Za-z_]\w*\(.*:[ \t]*$")


def code_prompts(files: list[Path], count: int, context_lines: int = 12, per_file: int = 3,
                 max_chars: int = 600) -> list[str]:
    """Prompts ending in a one-line ``def ...:`` header, each with the lines before it as context:
    the model must write the body. Deterministic: files in order, the first ``per_file`` defs each,
    then a second round, until ``count`` prompts."""
    candidates: list[list[str]] = []
    for f in files:
        lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
        found = []
        for i, line in enumerate(lines):
            if _DEF.match(line):
                prompt = "\n".join(lines[max(0, i - context_lines):i + 1]) + "\n"
                if len(prompt) <= max_chars:
                    found.append(prompt)
        candidates.append(found)
    prompts: list[str] = []
    for round_ in range(0, max((len(c) for c in candidates), default=0), per_file):
        for found in candidates:
            prompts += found[round_:round_ + per_file]
            if len(prompts) >= count:
                return prompts[:count]
    return prompts
