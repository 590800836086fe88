"""Peer contenders for the benchmark: the tools people use today, on the same checkpoints and prompts.

Each contender takes Hugging Face checkpoint folders and prompts as token-id lists, decodes greedily
in this process, and returns a :class:`PeerResult`: the new token ids per prompt (EOS included when
generated, at most ``max_new_tokens``), the wall time of generation alone (model loading and
conversion excluded; one short untimed warm-up call first), and, where the tool reports it, the
tokens emitted per verification step (accepted draft tokens plus the target's own token, as
:class:`specinfer.generate.Stats` counts them). A contender that cannot run returns
``unavailable`` with the reason instead of raising, so one broken tool does not sink a benchmark.

- ``transformers greedy`` / ``transformers assisted``: ``model.generate`` in fp32 on torch.
- ``onnxruntime-genai greedy`` / ``onnxruntime-genai speculative``: ONNX Runtime GenAI (package
  ``onnxruntime-genai``, tested with 0.18.0) on checkpoints converted by its model builder (fp32, CPU).

:class:`PeerProcess` runs contenders in a Python process of their own instead (the bench does so
for transformers', whose torch slows ONNX Runtime in the same process).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

PathLike = str | Path
EosIds = int | Sequence[int] | None

# Hugging Face's own defaults for assisted generation (GenerationConfig in transformers 5.x), set
# explicitly on the assistant so a checkpoint's generation_config.json cannot change them.
HF_NUM_ASSISTANT_TOKENS = 20
HF_ASSISTANT_SCHEDULE = "constant"
HF_ASSISTANT_CONFIDENCE = 0.4


@dataclass
class PeerResult:
    name: str
    outputs: list[list[int]] | None  # new token ids per prompt; None when unavailable
    seconds: float                   # wall time of generation only
    new_tokens: int
    tokens_per_step: list[int] = field(default_factory=list)  # emitted tokens per verification step, if reported
    unavailable: str = ""            # why the contender could not run ("" when it ran)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def _unavailable(name: str, error: BaseException | str) -> PeerResult:
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return PeerResult(name, None, 0.0, 0, unavailable=reason)


def _done(name: str, outputs: list[list[int]], seconds: float, steps: list[int] | None = None) -> PeerResult:
    return PeerResult(name, outputs, seconds, sum(len(o) for o in outputs), steps or [])


def eos_ids(checkpoint: PathLike, eos_id: EosIds = None) -> list[int]:
    """``eos_id`` as a list, or the checkpoint's config.json ``eos_token_id`` (an id or a list) when None."""
    if eos_id is None:
        eos_id = json.loads((Path(checkpoint) / "config.json").read_text()).get("eos_token_id")
    if eos_id is None:
        return []
    return [int(eos_id)] if isinstance(eos_id, int) else [int(e) for e in eos_id]


# ---------------------------------------------------------------------------------------------
# transformers


def _hf_model(checkpoint: PathLike):
    import torch
    import transformers

    # The bench prints a table: no weight-loading bars or advice from transformers around it.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # The committed checkpoints are fp16; everything here runs in fp32 (`torch_dtype` is deprecated in 5.x).
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    # A fresh generation config: a checkpoint's generation_config.json (sampling defaults, a
    # repetition penalty, ...) would otherwise fill in whatever generate() is not told, and greedy
    # output would no longer be the model's plain argmax decoding.
    model.generation_config = transformers.GenerationConfig()
    return model


def _hf_generate(model, prompts, max_new_tokens, eos, threads, name, **kwargs) -> PeerResult:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class StepSizes(BaseStreamer):
        """Records how many tokens each decoding step appends (generate() first puts the prompt)."""

        def __init__(self):
            self.sizes: list[int] = []
            self.prompt_seen = False

        def put(self, value):
            if self.prompt_seen:
                self.sizes.append(int(value.shape[-1]))
            self.prompt_seen = True

        def end(self):
            pass

    config = model.config
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    options = dict(do_sample=False, num_beams=1, eos_token_id=eos or None, pad_token_id=pad, **kwargs)
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            def run(prompt, n, streamer=None):
                ids = torch.tensor([list(prompt)], dtype=torch.long)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     streamer=streamer, **options)
                return [int(t) for t in out[0, ids.shape[1]:]]  # strip the prompt

            run(prompts[0], 2)  # warm-up, untimed
            outputs, steps, seconds = [], [], 0.0
            for prompt in prompts:
                streamer = StepSizes() if "assistant_model" in kwargs else None
                start = time.perf_counter()
                outputs.append(run(prompt, max_new_tokens, streamer))
                seconds += time.perf_counter() - start
                if streamer is not None:
                    steps += streamer.sizes
    finally:
        torch.set_num_threads(saved_threads)
    return _done(name, outputs, seconds, steps)


def transformers_greedy(llm_dir: PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        eos_id: EosIds = None, threads: int | None = None) -> PeerResult:
    """``model.generate(do_sample=False)`` on the LLM in fp32, one prompt at a time (batch 1).
    ``threads`` sets torch's intra-op threads for the run (None: torch's current setting).
    No verification steps, so ``tokens_per_step`` stays empty."""
    name = "transformers greedy"
    try:
        model = _hf_model(llm_dir)
        return _hf_generate(model, prompts, max_new_tokens, eos_ids(llm_dir, eos_id), threads, name)
    except Exception as e:  # a peer that cannot run is reported, not raised
        return _unavailable(name, e)


def transformers_assisted(llm_dir: PathLike, ssm_dir: PathLike, prompts: Sequence[Sequence[int]],
                          max_new_tokens: int, eos_id: EosIds = None, threads: int | None = None,
                          num_assistant_tokens: int = HF_NUM_ASSISTANT_TOKENS,
                          assistant_confidence_threshold: float = HF_ASSISTANT_CONFIDENCE) -> PeerResult:
    """Hugging Face assisted generation: ``model.generate(..., assistant_model=ssm, do_sample=False)``.

    The assistant runs with Hugging Face's defaults unless told, set explicitly on its generation
    config so a checkpoint's generation_config.json cannot change them: ``num_assistant_tokens=20``,
    ``num_assistant_tokens_schedule="constant"`` and ``assistant_confidence_threshold=0.4``: the
    assistant stops drafting as soon as its chosen token's probability falls below 0.4 (its
    confidence threshold is re-tuned from the acceptance history only when scikit-learn is
    installed), so a weak assistant drafts about one token a step whatever ``num_assistant_tokens``
    is. ``assistant_confidence_threshold=0`` turns that off: fixed chains of
    ``num_assistant_tokens``, like onnxruntime-genai's ``max_draft_tokens``. Drafts are chains
    verified greedily: the output is the LLM's own greedy output.

    transformers keeps no acceptance statistics, but generate() hands each verification step's new
    tokens (accepted drafts plus the LLM's token, cut at EOS or the length limit) to its
    ``streamer`` in one ``put`` call: ``tokens_per_step`` is the size of each of those.
    """
    name = "transformers assisted"
    try:
        model, assistant = _hf_model(llm_dir), _hf_model(ssm_dir)
        assistant.generation_config.num_assistant_tokens = num_assistant_tokens
        assistant.generation_config.num_assistant_tokens_schedule = HF_ASSISTANT_SCHEDULE
        assistant.generation_config.assistant_confidence_threshold = assistant_confidence_threshold
        return _hf_generate(model, prompts, max_new_tokens, eos_ids(llm_dir, eos_id), threads, name,
                            assistant_model=assistant)
    except Exception as e:
        return _unavailable(name, e)


# ---------------------------------------------------------------------------------------------
# a process of their own


class PeerProcess:
    """Peer contenders called in a Python process of their own, started at the first call and
    reused for the next (each keeps its timing: generation alone, measured in that process).

    Why: torch in the same process slows ONNX Runtime's runs there, ours more than
    onnxruntime-genai's. Interleaved on 8 of aiohttp's prompts, 128 tokens, 3 rounds, our
    incremental decoding made 0.84-0.89 of onnxruntime-genai greedy's tokens/s with transformers
    greedy run between them in the process, 0.92-0.94 with it run in a process of its own, and
    0.92-0.96 with no transformers at all (the cause is not known: Python's garbage collector took
    7 ms a round, and a pause after each transformers run changed nothing). A user runs one tool
    per process; so does the bench.

    ``call(name, ...)`` runs the function ``name`` of this module there (one of :data:`RUNS`), which
    returns a :class:`PeerResult`; a process that dies makes the result ``unavailable``.
    """

    RUNS = ("transformers_greedy", "transformers_assisted")

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def call(self, name: str, *args, **kwargs) -> PeerResult:
        if name not in self.RUNS:
            raise ValueError(f"{name} is not one of the peers a PeerProcess runs: {', '.join(self.RUNS)}")
        if self._process is None or self._process.poll() is not None:
            # -c, not -m: the results' classes must be this module's, not __main__'s.
            self._process = subprocess.Popen([sys.executable, "-c", "from specinfer.peers import _serve; _serve()"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            pickle.dump((name, args, kwargs), self._process.stdin)
            self._process.stdin.flush()
            return pickle.load(self._process.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            self.close()
            return _unavailable(name.replace("_", " "), f"its process ended ({type(e).__name__}; "
                                                        f"exit code {self._exit_code})")

    @property
    def _exit_code(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def close(self) -> None:
        """End the process (it finishes the call it is in)."""
        if self._process is not None:
            if self._process.stdin:
                try:
                    self._process.stdin.close()
                except OSError:
                    pass
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve() -> None:
    """A :class:`PeerProcess`'s loop: a call read from stdin, its result written to stdout, until
    stdin closes."""
    channel_in, channel_out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # whatever a library prints must not enter the channel
    while True:
        try:
            name, args, kwargs = pickle.load(channel_in)
        except EOFError:
            return
        result = globals()[name](*args, **kwargs) if name in PeerProcess.RUNS else \
            _unavailable(name, "not a peer a PeerProcess runs")
        pickle.dump(result, channel_out)
        channel_out.flush()


# ---------------------------------------------------------------------------------------------
# onnxruntime-genai


def _default_work_dir() -> Path:
    from .cache import cache_dir

    return cache_dir() / "ortgenai"


def _checkpoint_key(checkpoint: Path) -> str:
    """Changes whenever the checkpoint's weights or config change, or with the builder's version."""
    import onnxruntime_genai as og

    files = sorted(checkpoint.glob("*.safetensors")) + [checkpoint / "config.json"]
    stamp = [str(checkpoint.resolve()), og.__version__, "fp32", "cpu"] + [
        f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.is_file()]
    return hashlib.sha1("|".join(stamp).encode()).hexdigest()[:16]


def ortgenai_convert(checkpoint: PathLike, work_dir: PathLike | None = None,
                     tokenizer_dir: PathLike | None = None) -> Path:
    """The checkpoint converted by onnxruntime-genai's model builder (fp32, CPU), cached in ``work_dir``.

    The builder insists on a tokenizer in the folder; an SSM checkpoint without one (ours share the
    LLM's) is converted from a staging folder that adds ``tokenizer_dir``'s tokenizer files."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {checkpoint}: not a Hugging Face checkpoint folder")
    root = Path(work_dir) if work_dir else _default_work_dir()
    out = root / _checkpoint_key(checkpoint)
    if (out / "genai_config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the cache and rename at the end, so a failed or concurrent build leaves no half folder.
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        source = checkpoint
        if not (checkpoint / "tokenizer.json").is_file() and tokenizer_dir is not None:
            source = Path(tmp) / "checkpoint"
            _link_folder(checkpoint, source)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (Path(tokenizer_dir) / name).is_file() and not (source / name).exists():
                    shutil.copy2(Path(tokenizer_dir) / name, source / name)
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source),
                   "-o", str(Path(tmp) / "model"), "-p", "fp32", "-e", "cpu", "-c", str(Path(tmp) / "hf_cache")]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"onnxruntime-genai model builder failed on {checkpoint}: {' | '.join(tail)}")
        try:
            os.replace(Path(tmp) / "model", out)
        except OSError:
            if not (out / "genai_config.json").is_file():  # not just another process winning the race
                raise
    return out


def _link_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:  # no hard links on this file system
                shutil.copy2(f, dst / f.name)


def ortgenai_speculative_folder(llm_onnx: Path, ssm_onnx: Path, work_dir: Path) -> Path:
    """A folder whose genai_config.json is the LLM's plus a ``model.draft`` decoder block (the SSM's).

    onnxruntime-genai 0.18 resolves both model files relative to this folder and refuses paths
    with ``..`` ("Config path must not contain path traversal"), so the two conversions are
    hard-linked into ``target/`` and ``draft/`` beneath it (each keeps its external-data file).
    """
    out = work_dir / f"spec-{llm_onnx.name}-{ssm_onnx.name}"
    if (out / "genai_config.json").is_file():
        return out
    _link_folder(llm_onnx, out / "target")
    _link_folder(ssm_onnx, out / "draft")
    config = json.loads((llm_onnx / "genai_config.json").read_text())
    draft = json.loads((ssm_onnx / "genai_config.json").read_text())["model"]["decoder"]
    config["model"]["decoder"]["filename"] = "target/" + config["model"]["decoder"]["filename"]
    config["model"]["draft"] = copy.deepcopy(draft) | {"filename": "draft/" + draft["filename"]}
    tmp = out / "genai_config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, out / "genai_config.json")
    return out


@functools.lru_cache(maxsize=2)   # the greedy peer's and the speculative one's
def _ortgenai_model(folder: Path, eos: tuple[int, ...], threads: int | None, draft: bool, draft_threads: int = 1):
    """The model with our run settings laid over its genai_config.json (the files stay untouched),
    loaded once per process and reused, as our engine's Runtime is across a bench's prompts. (A
    model made afresh for each prompt ran faster than one reused, which no other contender gets:
    interleaved on 8 of aiohttp's prompts, greedy 713 / 758 / 908 tokens/s against 686 / 710 / 887,
    speculative chain 4 1120 / 1113 / 1181 against 1084 / 1087 / 1177; our Runtime made afresh
    gained nothing.)"""
    import onnxruntime_genai as og

    from .engines.onnxruntime import pool_entries

    # Threads as our ONNX Runtime engine sets them: all cores unless told (and a draft model, small,
    # one: see default_threads), no inter-op pool, spin-waiting within a run for a pool. Keys
    # genai_config does not know become session config entries.
    def session(n: int) -> dict:
        return {"intra_op_num_threads": n, "inter_op_num_threads": 1, **pool_entries(n)}

    model = {"decoder": {"session_options": session(threads or os.cpu_count() or 1)}}
    if draft:
        model["draft"] = {"session_options": session(draft_threads)}
    if eos:
        model["eos_token_id"] = list(eos) if len(eos) > 1 else eos[0]
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": model}))
    return og.Model(config)


def _ortgenai_generate(model, prompts, max_new_tokens, eos, name, draft_tokens=None) -> PeerResult:
    import numpy as np
    import onnxruntime_genai as og

    def run(prompt, n, steps=None):
        """New tokens of one prompt, and the seconds spent outside statistics polling."""
        prompt = [int(t) for t in prompt]
        start = time.perf_counter()
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + n)
        if draft_tokens:
            params.set_speculative_options(max_draft_tokens=draft_tokens)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))  # token ids: its tokenizer is never used
        polling, rounds = 0.0, []
        while not generator.is_done():
            generator.generate_next_token()
            if steps is not None:
                # Each call delivers one token; the running round counter says which verification
                # step it came from (the acceptance-length histogram stays zero outside its Engine).
                t = time.perf_counter()
                rounds.append(generator.get_speculative_stats()["rounds"])
                polling += time.perf_counter() - t
        new = [int(t) for t in generator.get_sequence(0)[len(prompt):]]
        # The sequence leaves out the EOS that ended it; the last generated token still names it.
        last = int(generator.get_next_tokens()[0])
        if len(new) < n and last in eos:
            new.append(last)
        seconds = time.perf_counter() - start - polling
        if steps is not None:
            steps += [count for _, count in sorted(Counter(rounds).items())]
        return new, seconds

    run(prompts[0], 2)  # warm-up, untimed
    outputs, steps, seconds = [], ([] if draft_tokens else None), 0.0
    for prompt in prompts:
        new, s = run(prompt, max_new_tokens, steps)
        outputs.append(new)
        seconds += s
    return _done(name, outputs, seconds, steps)


def ortgenai_greedy(llm_dir: PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    eos_id: EosIds = None, work_dir: PathLike | None = None,
                    threads: int | None = None) -> PeerResult:
    """onnxruntime-genai's Generator loop, greedy (``do_sample=False``, ``max_length`` = prompt +
    ``max_new_tokens``), on the LLM converted by its model builder (``-p fp32 -e cpu``, cached in
    ``work_dir``). Prompts go in as token ids (``append_tokens``). ``threads``: intra-op threads of
    its ONNX Runtime session (None: all cores, as our engine). ``tokens_per_step`` stays empty."""
    name = "onnxruntime-genai greedy"
    try:
        folder = ortgenai_convert(llm_dir, work_dir)
        eos = eos_ids(llm_dir, eos_id)
        return _ortgenai_generate(_ortgenai_model(folder, tuple(eos), threads, draft=False), prompts, max_new_tokens,
                                  eos, name)
    except Exception as e:  # ImportError included: onnxruntime-genai not installed
        return _unavailable(name, e)


def ortgenai_speculative(llm_dir: PathLike, ssm_dir: PathLike, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int, eos_id: EosIds = None, work_dir: PathLike | None = None,
                         draft_tokens: int = 8, threads: int | None = None) -> PeerResult:
    """onnxruntime-genai's speculative decoding with the SSM as draft model, greedy.

    How 0.18 does it: a ``model.draft`` decoder block in genai_config.json (beside
    ``model.decoder``) turns base speculative decoding on; ``GeneratorParams.set_speculative_options
    (max_draft_tokens=K)`` (1..16) sets the draft length. Each round the draft proposes a chain of
    K tokens, the target verifies them in one multi-token pass and keeps the agreeing prefix plus
    its own token; greedy output equals the target's greedy output. Both models must share the
    vocabulary and execution provider (the builder's CPU conversions do); batch 1, no beams.

    ``tokens_per_step``: tokens delivered per round, from the ``rounds`` counter of
    ``Generator.get_speculative_stats()`` read after every token (the polling time is taken out of
    ``seconds``); its ``acceptance_length_histogram`` stays all zeros on the Generator path in 0.18.
    """
    name = "onnxruntime-genai speculative"
    try:
        if not 1 <= draft_tokens <= 16:
            raise ValueError(f"onnxruntime-genai drafts 1 to 16 tokens per round, not {draft_tokens}")
        root = Path(work_dir) if work_dir else _default_work_dir()
        folder = ortgenai_speculative_folder(ortgenai_convert(llm_dir, root), ortgenai_convert(ssm_dir, root, tokenizer_dir=llm_dir),
                                             root)
        eos = eos_ids(llm_dir, eos_id)
        from .config import load_config
        from .engines.onnxruntime import default_threads

        model = _ortgenai_model(folder, tuple(eos), threads, draft=True, draft_threads=default_threads(load_config(ssm_dir)))
        return _ortgenai_generate(model, prompts, max_new_tokens, eos, name, draft_tokens)
    except Exception as e:
        return _unavailable(name, e)
