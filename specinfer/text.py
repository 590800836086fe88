"""Text in and out: the checkpoint's own ``tokenizer.json`` and UTF-8-safe streaming detokenization."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from .errors import SpecInferError


def load_tokenizer(model_dir: str | Path):
    """The Hugging Face fast tokenizer saved beside a checkpoint or an export."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise SpecInferError(f"no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))


class TextStream:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Byte-level BPE tokens can end inside a multi-byte character; such a tail decodes to U+FFFD, so
    it is held back until a later token completes it. Only a short window of ids is decoded each
    time (the text before ``prefix`` is final), which keeps a long stream O(n).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are emitted and decode to stable text
        self.read = 0    # ids before this are emitted
        # The last emitted piece as ids: its text is decode(context + ids) minus decode(context).
        self.window: tuple[list[int], list[int]] = ([], [])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids: Iterable[int]) -> str:
        """Add tokens; return the text that is now final."""
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.window = (self.ids[self.prefix:self.read], self.ids[self.read:])
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of a stream)."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.window = (self.ids[self.prefix:self.read], self.ids[self.read:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


def decode_piece(tokenizer, context: list[int], ids: list[int]) -> str:
    """The text that ``ids`` add after ``context`` (stateless; see :attr:`TextStream.window`)."""
    before = tokenizer.decode(list(context), skip_special_tokens=True)
    return tokenizer.decode(list(context) + list(ids), skip_special_tokens=True)[len(before):]


def shown_prompt(prompt: str, out) -> str:
    """The prompt as a terminal shows it before its continuation: dimmed, so that the eye sees where
    the generation begins (plain when ``out`` is not a terminal or NO_COLOR is set; the caller
    decides whether a pipe gets the prompt at all)."""
    import os

    if out.isatty() and not os.environ.get("NO_COLOR"):
        return f"\033[2m{prompt}\033[0m"
    return prompt
