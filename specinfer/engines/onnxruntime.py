"""The ONNX Runtime engine: an exported folder (``specinfer export``) behind the Runtime interface.

It runs the export's ONNX Runtime lowering (``model.ort.onnx``, see
:mod:`specinfer.export.ort_lowering`): GroupQueryAttention with the token tree as an attention
bias, rotary inside, fused projections. A sequence's KV cache is one host buffer
``kv[layer, K|V, kv_head, slot, head_dim]`` of fixed capacity. Its per-layer slices are bound once,
when the sequence starts, as both the graph's ``past_*`` inputs and its ``present_*`` outputs
(onnxruntime's public IOBinding, by address): the attention kernel sees the same memory on both
sides, reads the cache in place and writes only the new tokens' rows, so no step copies the cache
and a step writes only its few small inputs (see :class:`_Binding`). The lowering is rewritten
at load time to compute logits only for the rows a call asks for (a prompt: its last token).

CPU only: ONNX Runtime's CUDA GroupQueryAttention takes neither ``attention_bias`` nor
``position_ids``; the GPU engines are ``torch-gpu`` and ``tensorrt``.
"""
from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import ModelConfig
from ..errors import SpecInferError
from ..export.draft_vocab import read_draft_vocab
from ..export.ort_lowering import LOGIT_ROWS, WEIGHTS
from . import native
from .runtime import ChainDraft, ChainSampling, Runtime, SequenceState, check_kv_dtype, check_matmul_dtype

MANIFEST = "manifest.json"
LOWEST = np.finfo(np.float32).min
SMALL_MODEL_PARAMETERS = 4_000_000


def read_manifest(onnx_dir: str | Path) -> dict:
    onnx_dir = Path(onnx_dir)
    path = onnx_dir / MANIFEST
    if not path.is_file():
        raise SpecInferError(f"no {MANIFEST} in {onnx_dir}: is it a folder written by `specinfer export`?")
    return json.loads(path.read_text())


def session_options(threads: int | None):
    """CPU session options for models that take turns on few cores: on the process's shared
    thread pool (``threads`` None), or on a pool of ``threads`` of its own if the process has no
    shared pool yet.

    The shared pool is the fast way. Its workers spin-wait between kernels and stay warm while the
    models take turns: blocked workers made every one of the LLM's ~190 small kernels pay a
    wake-up (its step took twice as long on 2 cores), and pools of their own, spinning, fight for
    the cores when models alternate (two threads for the SSM beside the LLM's pool made the LLM's
    step 3x slower). Measured with an SSM draft between LLM calls, as in decoding, on 2 cores: LLM
    8 tokens 3.2-3.4 ms and SSM draft of 8 1.3 ms on the shared pool, against 3.7-4.0 and 1.9-2.0
    ms with a spinning pool of 2 for the LLM and one thread for the SSM, and 5.3-5.6 and 2.0 ms
    with no spinning at all. A pool of its own spins within a run only (:func:`pool_entries`).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Shapes change every call (the tree, the bias): a memory pattern planned for one shape is never
    # reused, and planning it each call cost a small model up to a third of its step.
    options.enable_mem_pattern = False
    # No memory arena: a tensor's memory goes back to the C heap when its run ends, where an arena
    # keeps the most its largest run needed for the session's life. Measured on the embedded LLM
    # (int8 products; LLM and SSM 1 through the scheduler, 1 and 16 streams, `/tmp/s57/noarena.py`):
    # 195 MB with a session for every batch size up to 16 against 265 with arenas, 282-306 after
    # the streams against 385-423, and 231-258 once the heap's free pages are given back against
    # 345-384; the same speed (two runtimes in one process, runs alternated, `/tmp/s57/ab_arena.py`:
    # a token, a chain of 8, 16 sequences' trees or chains, a prompt of 600, all within 2%; with
    # no native kernels, MLAS's float32 products, within 5%, the arena-free ones faster). So an
    # idle server keeps its sessions (:meth:`OrtRuntime.trim`) and gives the heap back alone.
    options.enable_cpu_mem_arena = False
    # Once the shared pool exists ONNX Runtime allows no session a pool of its own: threads given
    # then are ignored.
    if (threads is None and _share_thread_pool()) or _shared_pool == [True]:
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        for key, value in pool_entries(options.intra_op_num_threads).items():
            options.add_session_config_entry(key, value)
    return options


def open_session(model: "str | Path | bytes", threads: int | None = None, weights_dir: Path | None = None,
                 libraries: Sequence[Path] = (), initializers: "dict[str, object] | None" = None):
    """An ONNX Runtime CPU session with :func:`session_options`. Every session specinfer makes goes
    through these options: once the process's shared pool exists, ONNX Runtime refuses any session
    with a pool of its own (another library's sessions in the same process then need
    ``use_per_session_threads = False``). ``weights_dir``: where the external weights of a model
    given as bytes are (a graph rewritten at load time keeps its export's weights file)."""
    import onnxruntime as ort

    options = session_options(threads)
    for library in libraries:   # custom-op libraries the model's nodes need (native.py)
        options.register_custom_ops_library(str(library))
    if weights_dir is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    return ort.InferenceSession(str(model) if isinstance(model, Path) else model, options,
                                providers=["CPUExecutionProvider"])


_shared_pool: list[bool] = []   # whether this process's shared pool exists, once tried


def _share_thread_pool() -> bool:
    """Make the process's shared ONNX Runtime pool (every core, spinning) on first use."""
    if not _shared_pool:
        import onnxruntime as ort

        try:
            ort.set_global_thread_pool_sizes(os.cpu_count() or 1, 1)
            _shared_pool.append(True)
        except Exception:   # an embedding process made its environment otherwise: pools of our own
            _shared_pool.append(False)
    return _shared_pool[0]


def pool_entries(threads: int) -> dict[str, str]:
    """Session config entries for a pool of ``threads`` of its own: its workers spin within a run,
    where each of the ~190 small kernels would otherwise pay a wake-up, and stop when the run ends
    (``session.force_spinning_stop``, which ONNX Runtime applies to a session's own pool only),
    so that between runs they leave the cores to whatever runs next. Without the stop, pools of
    their own spun through each other's runs: the embedded LLM and SSM 1 on pools of 2 made 386-394
    tokens/s against 834-930 on the shared pool (`specinfer bench --no-peers --num-prompts 12
    --max-tokens 96 --tree dynamic --threads 2`, dynamic SSM 1 + lookup, 2 rounds); with it,
    783-944. One thread: no workers, nothing to spin."""
    if threads <= 1:
        return {"session.intra_op.allow_spinning": "0"}
    return {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}


def default_threads(config: ModelConfig) -> int:
    """Intra-op threads for a model on a pool of its own (how the onnxruntime-genai peer runs):
    one for a small one, whose pool would fight the LLM's for the cores, else every core."""
    c = config
    params = c.vocab_size * c.hidden_size + c.num_layers * c.hidden_size * (
        (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim + 3 * c.intermediate_size)
    return 1 if params < SMALL_MODEL_PARAMETERS else (os.cpu_count() or 1)


def threads_beside_others(onnx_dir: str | Path) -> int:
    """Intra-op threads for a model served in a process of its own beside other models' processes
    (``llm`` and each ``ssm_<i>`` behind the ensemble), on a pool of its own: :func:`default_threads`,
    so a small SSM runs on one thread and the LLM on every core, whose workers stop spinning when a
    run ends (:func:`pool_entries`). On the process's shared pool, which spins on between runs:
    - a small SSM's workers fought the ``lookup`` model running beside it and the ``llm`` process
      for the 2 cores: one stream behind the ensemble made 120-149 tokens/s with it against
      203-300 on one thread (the ``llm`` model's step took 7-12 ms against 6-7);
    - the ``llm``'s workers held a core while the step's other hops ran: one stream behind the
      ensemble made 358 / 358 tokens/s speculative and 156 / 143 incremental, against 406 / 370
      and 173 / 158 on a pool of its own (`specinfer client bench --protocol grpc --model ensemble
      --stream --concurrency 1,16 --requests 32 --max-tokens 64`, served in turn; 16 streams
      within the noise)."""
    return default_threads(ModelConfig.from_dict(read_manifest(onnx_dir)["config"]))


class OrtRuntime(Runtime):
    """Runtime over an exported folder's ONNX Runtime lowering, on the CPU.

    Several sequences' score calls run as one session run of the lowering rewritten for that many
    sequences (:func:`~specinfer.export.ort_lowering.batch_sequences`): the weights are read once
    for all their tokens. One such session is made per size in :data:`BATCH_SIZES`, on first use
    (~0.1 s); a batch runs on the smallest that holds it, the spare slots given one token each on
    a scratch cache (~0.4 ms a slot). Every session prepacks its weights as the single-sequence
    one does, which keeps a sequence's logits bit for bit what it gets alone (MLAS's prepacked
    GEMM computes a row the same way whatever the other rows; unpacked, logits differed by 1e-5,
    enough to flip a near tie under greedy decoding); and unpacked, a run repacks every weight,
    which doubled a batch of 4 trees of 4 (11.1 ms against 6.2). :meth:`trim` drops them (the
    scheduler does, once idle).

    The weights are one copy for all the sessions (:meth:`_share_weights`): the native kernels'
    packed weights, the embeddings and whatever else is large, given to each session as ONNX
    Runtime initializers it reads in place. A session of its own copy cost the embedded LLM 48-56
    MB each (625 MB with a session for 7 batch sizes and the drafter, now 199 MB; int8 products
    397 -> 172 MB), and a step read weights other sessions had left out of the cache: an LLM
    chain of 8 after a tree 2.10 ms, against 1.85 after a chain (now 1.74 and 1.72;
    `/tmp/s53/switch.py`).
    Only MLAS's own prepacked copies stay per session (a MatMul the native kernels do not take)."""

    slot_axis = 3               # kv[layer, K|V, kv_head, slot, head_dim]
    initial_slots = 64          # a sequence's buffer doubles from here as it grows
    spare_sequences = 2         # a request's, and the one started before its end (a scheduler's next)

    def __init__(self, onnx_dir: str | Path, threads: int | None = None, max_context: int | None = None,
                 kv_dtype: str = "float32", matmul_dtype: str = "float32"):
        import onnx

        from ..export.ort_lowering import ORT_ONNX, output_names, select_logit_rows

        self.dir = Path(onnx_dir)
        self.manifest = read_manifest(self.dir)
        lowered = self.manifest.get("ort_onnx")
        if lowered is None or not (self.dir / lowered).is_file():
            raise SpecInferError(f"{self.dir} has no ONNX Runtime lowering ({ORT_ONNX}): it was exported by an older "
                                 f"specinfer; export the checkpoint again")
        config = ModelConfig.from_dict(self.manifest["config"])
        limit = self.manifest["max_context"]
        super().__init__(config, min(max_context or limit, limit))
        self.threads = threads   # None: the process's shared pool
        check_kv_dtype(kv_dtype)
        if kv_dtype == "float16" and native.library() is None:
            raise SpecInferError("float16 KV caches need the native kernels (Linux x86-64 with AVX2, FMA and F16C, a C "
                                 "compiler, SPECINFER_NATIVE not 0); use float32")
        # Float16 caches: half the bytes a step reads from them (a batch of many sequences reads them
        # from memory), twice the tokens in a KV budget; K and V rounded to float16 as written.
        self.kv_dtype = np.dtype(kv_dtype)
        self.kv_itemsize = self.kv_dtype.itemsize
        check_matmul_dtype(matmul_dtype)
        native.require_products(matmul_dtype)
        self.matmul_dtype = matmul_dtype
        # The native products' weights: float16 where the stored ones are exactly float16 (float32 products)
        self._products = "float16" if matmul_dtype == "float32" else matmul_dtype
        # (weight name, shape, ONNX type) -> (its values, an OrtValue of them) for every session
        self._shared: dict[tuple, tuple[np.ndarray, object]] = {}
        self._f16_weights: dict[str, object] = {}   # weight name + suffix -> packed for the native MatMuls, or None
        self._draft_panels: dict[str, object] = {}  # weight name -> packed for the native drafter
        # Logits only for the rows asked for (a prompt: its last), the graph rewritten here.
        self._lowered = select_logit_rows(onnx.load(self.dir / lowered, load_external_data=False))
        self.native_ops: set[str] = set()   # the native ops its sessions run (set by _open)
        self.sessions_copy_weights = False   # whether a session keeps weights of its own (set by _open)
        self.session = self._open(self._lowered)
        names = output_names(config.num_layers)[1:]
        self._kv_names = [(f"past_key.{i}", f"past_value.{i}", names[2 * i], names[2 * i + 1])
                          for i in range(config.num_layers)]
        # The drafters (greedy and sampled), each opened at its first draft: a target LLM never drafts.
        self._drafters = {"draft": self.manifest.get("draft_onnx"), "sampled_draft": self.manifest.get("sampled_draft_onnx")}
        self._drafters["chain"] = self._drafters["draft"]   # greedy decoding's chains: its tokens only
        # Sampled decoding's chains: the greedy drafter drawing each token (native.sampled_decoding)
        self._drafters["sampled_chain"] = self._drafters["draft"] if native.library() is not None else None
        self.draft_depth = self.manifest.get("draft_depth", 1) if self._drafters["draft"] else 1
        self.draft_candidates = self.manifest.get("draft_candidates", self.draft_candidates)
        self.draft_vocab = read_draft_vocab(self.dir, config.vocab_size)   # its drafters score these only
        self.samples_chains = self._drafters["sampled_chain"] is not None and self.draft_vocab is None
        self._draft_graphs: dict[str, object] = {}            # kind -> the export's drafter graph
        self._draft_sessions: dict[tuple[str, int], object] = {}   # (kind, steps) -> its session
        # (kind, steps, batch size) -> the batched drafter's session, binding and each slot's cache
        self._draft_batches: dict[tuple[str, int, int], tuple[object, _Binding, dict]] = {}
        self._draft_scratch: SequenceState | None = None   # the batched drafter's spare slots' cache
        # batch size -> its session, its binding and the cache each slot has bound (made on first use)
        self._batched: dict[int, tuple[object, _Binding, dict]] = {}
        self._scratch: SequenceState | None = None   # the spare slots' cache

    def _open(self, graph, tokens_only: bool = False):
        """A session of ``graph``, the lowering or a rewrite of it made here (its weights are the
        export's file), on the native kernels where they run (:mod:`~specinfer.engines.native`):
        a small model's drafter as one node, MatMuls by float16-exact weights (with the residual norms
        and the MLP's activation inside them), and the attention, over float16 caches where asked.
        ``tokens_only``: a greedy drafter that decodes, its probabilities cut away."""
        library = native.library()
        half = self.kv_dtype == np.float16
        if library is not None:
            if not half:   # the drafter node reads float32 caches only
                graph = native.use_draft_chain(graph, self.dir, self._draft_panels)
            graph = native.use_f16_weights(graph, self.dir, self._f16_weights, products=self._products)
            graph = native.use_swiglu(graph, self._f16_weights)
            graph = native.use_skip_norms(graph)
            graph = native.use_slot_attention(native.use_tree_attention(graph))
        if half:
            graph = native.use_f16_kv(graph)
            if graph is None:
                raise SpecInferError(f"{self.dir}: this model's attention cannot run on float16 KV caches; use float32")
        if tokens_only:   # after the native drafter node took the whole drafter, if it did
            from ..export.ort_lowering import tokens_only as cut_to_tokens

            graph = cut_to_tokens(graph)
        ops = native.native_ops(graph)
        self.native_ops |= ops
        self.sessions_copy_weights = self.sessions_copy_weights or copies_weights(graph)
        graph, shared = self._share_weights(graph)
        return open_session(graph.SerializeToString(), self.threads, weights_dir=self.dir,
                            libraries=[library] if ops else [], initializers=shared)

    def _share_weights(self, graph):
        """``graph`` with its large initializers as placeholders (no data), and those initializers
        as OrtValues, one per weight for all this runtime's sessions (ONNX Runtime's
        ``add_initializer``: each session reads the runtime's copy in place). A weight is known by
        its name, shape and type, which name the same values in every rewrite of the export's
        graphs (the batched, the drafters, the native kernels' packing of one weight)."""
        import onnx
        import onnxruntime as ort
        from onnx import numpy_helper

        values, placeholders = {}, []
        end = (self.dir / WEIGHTS).stat().st_size
        for init in graph.graph.initializer:
            if int(np.prod(init.dims)) < SHARED_MIN_VALUES:
                continue
            key = (init.name, tuple(init.dims), init.data_type)
            if key not in self._shared:
                array = numpy_helper.to_array(init, base_dir=str(self.dir))
                if array.dtype.name == "bfloat16":   # ml_dtypes' type, which ONNX Runtime takes as its bits
                    array = array.view(np.uint16)
                array = _aligned_copy(array)
                self._shared[key] = (array, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, init.data_type))
            values[init.name] = self._shared[key][1]
            array_bytes = self._shared[key][0].nbytes
            placeholder = onnx.TensorProto(name=init.name, dims=init.dims, data_type=init.data_type,
                                           data_location=onnx.TensorProto.EXTERNAL)
            # ONNX Runtime checks that the file exists, and reads nothing of it for an initializer
            # given to the session; should anything read it, it reads past the file's end: an error,
            # never another weight's bytes.
            for field, text in (("location", WEIGHTS), ("offset", str(end)), ("length", str(array_bytes))):
                placeholder.external_data.add(key=field, value=text)
            placeholders.append(placeholder)
        if not values:
            return graph, values
        out = onnx.ModelProto()
        out.CopyFrom(graph)
        kept = [init for init in out.graph.initializer if init.name not in values]
        del out.graph.initializer[:]
        out.graph.initializer.extend(kept + placeholders)
        return out, values

    def _allocate(self, capacity: int) -> np.ndarray:
        c = self.config
        head_dim = self.manifest.get("ort_head_dim", c.head_dim)   # padded to a multiple of 16
        return aligned_array((c.num_layers, 2, c.num_kv_heads, capacity, head_dim), self.kv_dtype, zeroed=True)

    def _bind_cache(self, session, seq: SequenceState, presents: list[list[str]]) -> "_Binding":
        """A binding of ``session`` with the sequence's cache bound as its past and as every one of
        ``presents`` (per layer, its key and value output names) the session has: made once per
        sequence."""
        binding = _Binding(session)
        _bind_kv(binding.io, seq, [(pk, pv) for pk, pv, *_ in self._kv_names], _outputs_of(session, presents))
        return binding

    def draft_chain(self, seq_id, tokens, depth: int, noise: np.ndarray | None = None) -> ChainDraft:
        """One session run of the export's drafter (``draft.ort.onnx``, or ``draft_sampled.ort.onnx``
        given ``noise``), cut to the ``depth`` steps asked (:func:`truncate_drafter`), when it fits;
        else one Runtime call per token (the base class)."""
        return self._chain(seq_id, tokens, depth, noise, "draft" if noise is None else "sampled_draft")

    def decode_chain(self, seq_id, tokens, depth: int, sampling: ChainSampling | None = None) -> list[int]:
        """:meth:`draft_chain`'s greedy tokens from the greedy drafter cut to its tokens
        (:func:`~specinfer.export.ort_lowering.tokens_only`); sampled, the tokens drawn by that
        drafter drawing each step's token (:func:`~specinfer.engines.native.sampled_decoding`)."""
        kind = "chain" if sampling is None else "sampled_chain"
        return self._chain(seq_id, tokens, depth, None, kind, sampling).tokens

    def _chain(self, seq_id, tokens, depth: int, noise: np.ndarray | None, kind: str,
               sampling: ChainSampling | None = None) -> ChainDraft:
        """One sequence's chain by the drafter of ``kind`` where it fits, else the base class's."""
        seq = self._get(seq_id)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not self._drafter_fits(seq, tokens, depth, depth, noise, kind):
            if kind == "sampled_chain":
                return _tokens_only(super().decode_chain(seq_id, tokens, depth, sampling))
            return super().draft_chain(seq_id, tokens, depth, noise)
        self._before_draft(seq_id, seq, tokens, depth)
        if (kind, depth) not in seq.bindings:
            from ..export.ort_lowering import drafter_presents_by_layer

            presents = drafter_presents_by_layer(self.config.num_layers, depth)
            seq.bindings[kind, depth] = self._bind_cache(self._draft_session(kind, depth), seq, presents)
        binding = seq.bindings[kind, depth]
        end = seq.length + seq.pending + len(tokens)   # every new token sees all slots before its own
        binding.feed("input_ids", tokens[None])
        binding.set("seqlens_k", end - 1)
        binding.set("total_sequence_length", end, ())
        if noise is not None:
            for j in range(depth):
                binding.feed(f"draft_noise.{j}", np.ascontiguousarray(noise[j], np.float32).reshape(1, 1, -1), fresh=True)
        if sampling is not None:
            _feed_sampling(binding, depth, {0: sampling}, 1)
        outputs = binding.outputs_of(self._draft_outputs(kind, depth))
        binding.session.run_with_iobinding(binding.io)
        self._after_draft(seq, len(tokens), depth)
        return _drawn(_chain_draft([o[0] for o in outputs], depth, sampled=noise is not None))

    def draft_chains(self, calls) -> list[ChainDraft]:
        """Several sequences' chains in one run of the drafter rewritten for that many sequences
        (:func:`~specinfer.export.ort_lowering.batch_drafter`), greedy and sampled ones apart, each
        drafted as deep as the deepest of its kind (the extra tokens are left pending, which the
        contract allows). A call that does not fit the drafter runs alone (:meth:`draft_chain`).
        A bad call fails the batch before any sequence changes."""
        return self._chains(calls, decoding=False)

    def decode_chains(self, calls) -> list[list[int]]:
        """:meth:`draft_chains` of decoding chains, greedy ones and sampled ones apart, their tokens
        only: greedy from the drafter cut to them, sampled from the one drawing each token."""
        calls = [(*call[:3], call[3] if len(call) > 3 else None) for call in calls]
        return [draft.tokens for draft in self._chains(calls, decoding=True)]

    def _chains(self, calls, decoding: bool) -> list[ChainDraft]:
        """Chains of several sequences, ``(seq_id, tokens, depth, extra)`` each: ``extra`` a draft's
        noise (None: greedy), or with ``decoding`` a decoding chain's sampling (None: greedy)."""
        def kind_of(extra) -> str:
            if decoding:
                return "chain" if extra is None else "sampled_chain"
            return "draft" if extra is None else "sampled_draft"

        def alone(call) -> ChainDraft:
            seq_id, tokens, depth, extra = call
            return self._chain(seq_id, tokens, depth, None if decoding else extra, kind_of(extra),
                               extra if decoding else None)

        if len(calls) == 1:   # one sequence (decoding alone): no batch to group or check
            return [alone(calls[0])]
        self._check_distinct(calls)
        for seq_id, tokens, _, _ in calls:
            self._check_pending_chain(seq_id)
            self._check_tokens(np.asarray(tokens, dtype=np.int64).reshape(-1))
        groups: dict[str, list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault(kind_of(call[3]), []).append(i)
        depth = {kind: max(calls[i][2] for i in members) for kind, members in groups.items()}
        out: list = [None] * len(calls)
        for kind, members in groups.items():
            members = [i for i in members if self._drafter_fits(
                self._get(calls[i][0]), np.asarray(calls[i][1]).reshape(-1), calls[i][2], depth[kind],
                None if decoding else calls[i][3], kind)]
            if len(members) < 2:
                continue
            for first in range(0, len(members), BATCH_SIZES[-1]):
                chunk = members[first:first + BATCH_SIZES[-1]]
                for i, draft in zip(chunk, self._draft_batch(kind, [calls[i] for i in chunk], depth[kind])):
                    out[i] = draft
        return [draft if draft is not None else alone(call) for draft, call in zip(out, calls)]

    def _drafter_fits(self, seq: SequenceState, tokens: np.ndarray, depth: int, run_depth: int,
                      noise: np.ndarray | None, kind: str) -> bool:
        """Whether the drafter of ``kind`` drafts this chain in one run of ``run_depth`` steps."""
        return not (self._drafters.get(kind) is None or not 1 <= depth <= run_depth <= self.draft_depth
                    or seq.length + seq.pending + len(tokens) + run_depth - 1 > seq.limit
                    or (noise is not None and noise.shape[1] != self.draft_candidates))

    def _before_draft(self, seq_id, seq: SequenceState, tokens: np.ndarray, run_depth: int) -> None:
        self._grow(seq, seq.length + seq.pending + len(tokens) + run_depth - 1)
        self._check_pending_chain(seq_id)
        self._check_tokens(tokens)

    @staticmethod
    def _after_draft(seq: SequenceState, num_tokens: int, run_depth: int) -> None:
        """The sequence's pending chain after a drafter run: the chain before, the tokens, every
        draft token but the last."""
        n = seq.pending + num_tokens + run_depth - 1
        seq.parents, seq.depths = list(range(-1, n - 1)), list(range(n))

    def _draft_outputs(self, kind: str, rows: int) -> tuple:
        """A drafter's outputs for ``rows`` (steps x sequences): greedy, each step's two likeliest
        tokens, their logits and its mass (decoding: the tokens alone); sampled, its candidates,
        their logits and the draw."""
        if kind in ("chain", "sampled_chain"):   # its tokens only: the two likeliest, or the one drawn
            return (("draft_tokens", (1, rows, 2 if kind == "chain" else 1), np.int64),)
        if kind == "draft":
            k, last = 2, ("draft_mass", (1, rows, 1), np.float32)
        else:
            k, last = self.draft_candidates, ("draft_choice", (1, rows, 1), np.int64)
        return (("draft_tokens", (1, rows, k), np.int64), ("draft_logits", (1, rows, k), np.float32), last)

    def _draft_batch(self, kind: str, calls: list[tuple], depth: int) -> list[ChainDraft]:
        """One run of the drafter of ``kind`` for ``depth`` steps over several sequences' chains."""
        from ..export.ort_lowering import batch_drafter, drafter_presents_by_layer

        size = next(b for b in BATCH_SIZES if b >= len(calls))
        seqs, chains = [], []
        for seq_id, tokens, _, _ in calls:
            seq, tokens = self._get(seq_id), np.asarray(tokens, dtype=np.int64).reshape(-1)
            self._before_draft(seq_id, seq, tokens, depth)
            seqs.append(seq)
            chains.append(tokens)
        # Spare slots draft from one token on a scratch cache of their own.
        scratch = self._draft_scratch = self._draft_scratch or SequenceState(self._allocate(self.draft_depth), 1, 1)
        key = (kind, depth, size)
        entry = self._draft_batches.get(key)   # (read once: a trim may clear the dict meanwhile)
        if entry is None:
            session = self._open(batch_drafter(self._draft_graph(kind, depth), size), tokens_only=kind == "chain")
            entry = self._draft_batches[key] = (session, _Binding(session), {})
        _, binding, bound = entry
        slots = _bind_slots(binding.io, bound, seqs, scratch, size, lambda slot: (
            [(f"{pk}.{slot}", f"{pv}.{slot}") for pk, pv, *_ in self._kv_names],
            _outputs_of(binding.session, drafter_presents_by_layer(self.config.num_layers, depth, f".{slot}"))))
        in_slot = [np.zeros(1, np.int64)] * size   # slot -> its chain
        ends = [1] * size                          # slot -> its sequence's length after the chain
        for seq, chain, slot in zip(seqs, chains, slots):
            in_slot[slot], ends[slot] = chain, seq.length + seq.pending + len(chain)
        sizes = np.asarray([len(c) for c in in_slot], dtype=np.int64)
        binding.feed("input_ids", np.concatenate(in_slot)[None])
        binding.feed("slot_tokens", sizes)
        binding.feed("last_rows", np.cumsum(sizes) - 1)
        for slot, end in enumerate(ends):
            binding.set(f"seqlens_k.{slot}", end - 1)
            binding.set(f"total_sequence_length.{slot}", end, ())
        if kind == "sampled_chain":
            _feed_sampling(binding, depth, {slot: call[3] for slot, call in zip(slots, calls)}, size)
        if kind == "sampled_draft":   # each sequence's noise for its steps; zeros past them
            noise = np.zeros((depth, size, self.draft_candidates), np.float32)
            for slot, (_, _, d, call_noise) in zip(slots, calls):
                noise[:d, slot] = call_noise[:d]
            for j in range(depth):
                binding.feed(f"draft_noise.{j}", noise[j][None])
        outputs = binding.outputs_of(self._draft_outputs(kind, depth * size))
        binding.session.run_with_iobinding(binding.io)
        drafts = []
        for seq, chain, slot, (_, _, d, _) in zip(seqs, chains, slots, calls):
            self._after_draft(seq, len(chain), depth)
            rows = [o[0].reshape(depth, size, -1)[:d, slot] for o in outputs]
            drafts.append(_drawn(_chain_draft(rows, d, sampled=kind == "sampled_draft")))
        return drafts

    def _draft_session(self, kind: str, steps: int):
        """The drafter of ``kind`` cut to ``steps`` steps, opened at its first use."""
        if (kind, steps) not in self._draft_sessions:
            self._draft_sessions[kind, steps] = self._open(self._draft_graph(kind, steps), tokens_only=kind == "chain")
        return self._draft_sessions[kind, steps]

    def _draft_graph(self, kind: str, steps: int):
        """The export's drafter of ``kind`` cut to ``steps`` steps (:func:`truncate_drafter`)."""
        import onnx

        from ..export.ort_lowering import truncate_drafter

        source = "draft" if kind in ("chain", "sampled_chain") else kind   # decoding's chains: the greedy drafter
        if source not in self._draft_graphs:
            self._draft_graphs[source] = onnx.load(self.dir / self._drafters[source], load_external_data=False)
        graph = truncate_drafter(self._draft_graphs[source], steps)   # (greedy decoding's is cut at _open)
        return native.sampled_decoding(graph) if kind == "sampled_chain" else graph

    def _forward(self, seq: SequenceState, tokens, positions, visible, last_only: bool = False) -> np.ndarray:
        start = seq.length + seq.pending          # the new tokens' first slot
        if "score" not in seq.bindings:
            seq.bindings["score"] = self._bind_cache(self.session, seq, [names[2:] for names in self._kv_names])
        binding = seq.bindings["score"]
        if _numbered_by_the_kernel(start, positions):
            # A tree there goes in as its first node, then the rest.
            first = self._run(binding, 0, tokens[:1], positions[:1], visible[:1, :1], last_only)
            rest = self._run(binding, 1, tokens[1:], positions[1:], visible, last_only)
            return rest if last_only else np.concatenate([first, rest])
        return self._run(binding, start, tokens, positions, visible, last_only)

    def _run(self, binding: "_Binding", start: int, tokens, positions, visible, last_only: bool) -> np.ndarray:
        t = len(tokens)
        binding.feed("input_ids", tokens[None])
        binding.feed("position_ids", positions[None])
        rows = (t - 1 if last_only else 0, t)
        if binding.rows != rows:   # the same rows step after step (an incremental step's one)
            binding.feed(LOGIT_ROWS, np.arange(*rows, dtype=np.int64), fresh=True)
            binding.rows = rows
        _feed_attention(binding, start, tokens, positions, visible)
        return binding.run((1, 1 if last_only else t, self.config.vocab_size))[0]

    def _move(self, seq: SequenceState, src: np.ndarray, dst: np.ndarray) -> None:
        # Advanced indexing gathers every source before it writes: overlapping moves are safe.
        seq.kv[:, :, :, dst] = seq.kv[:, :, :, src]

    # --- many sequences in one run ---------------------------------------------------------------------
    def _forward_many(self, calls, last_only) -> list[np.ndarray]:
        # Such a call (see _forward) runs alone.
        alone = [i for i, (seq, _, positions, _) in enumerate(calls)
                 if _numbered_by_the_kernel(seq.length + seq.pending, positions)]
        together = [i for i in range(len(calls)) if i not in alone]
        out: list = [None] * len(calls)
        for i in alone:
            out[i] = self._forward(*calls[i], last_only[i])
        if len(together) == 1:
            out[together[0]] = self._forward(*calls[together[0]], last_only[together[0]])
        elif together:
            for i, logits in zip(together, self._run_batch([calls[i] for i in together], [last_only[i] for i in together])):
                out[i] = logits
        return out

    def _run_batch(self, calls, last_only) -> list[np.ndarray]:
        if len(calls) > BATCH_SIZES[-1]:
            step = BATCH_SIZES[-1]
            return [out for i in range(0, len(calls), step)
                    for out in self._run_batch(calls[i:i + step], last_only[i:i + step])]
        n, size = len(calls), next(b for b in BATCH_SIZES if b >= len(calls))
        scratch = self._scratch = self._scratch or SequenceState(self._allocate(1), 1, 1)
        binding, slots = self._bind_batch(size, [seq for seq, *_ in calls], scratch)
        # Each call in its slot; the spare slots score one token on the scratch cache.
        held: list = [None] * size   # slot -> its call's index
        for i, slot in enumerate(slots):
            held[slot] = i
        spare = (scratch, np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones((1, 1), bool))
        in_slot = [spare if i is None else calls[i] for i in held]
        sizes = [len(tokens) for _, tokens, _, _ in in_slot]
        binding.feed("input_ids", np.concatenate([tokens for _, tokens, _, _ in in_slot])[None])
        binding.feed("position_ids", np.concatenate([positions for _, _, positions, _ in in_slot])[None])
        binding.feed("slot_tokens", np.asarray(sizes, dtype=np.int64))
        # Logits of each call's tokens (a prompt's last only), in slot order; none for the spare slots.
        ends = np.cumsum(sizes)
        rows = [np.arange(end - 1 if last_only[i] else end - t, end)
                for end, t, i in zip(ends, sizes, held) if i is not None]
        binding.feed(LOGIT_ROWS, np.concatenate(rows), fresh=True)
        for slot, (seq, tokens, positions, visible) in enumerate(in_slot):
            _feed_attention(binding, seq.length + seq.pending, tokens, positions, visible, f".{slot}")
        logits = binding.run((1, sum(map(len, rows)), self.config.vocab_size))
        pieces = np.split(logits[0], np.cumsum([len(r) for r in rows])[:-1])
        out: list = [None] * n
        for i, piece in zip([i for i in held if i is not None], pieces):
            out[i] = piece
        return out

    def _bind_batch(self, size: int, seqs: list[SequenceState], spare: SequenceState):
        """The binding of the session for batches of ``size``, with each sequence's cache bound
        as its slot's past and present (the spare slots' ``spare``'s), and each sequence's slot.
        One binding per session, kept: see :func:`_bind_slots`."""
        from ..export.ort_lowering import batch_sequences, slot_names

        entry = self._batched.get(size)   # (read once: a trim may clear the dict meanwhile)
        if entry is None:
            session = self._open(batch_sequences(self._lowered, size))
            entry = self._batched[size] = (session, _Binding(session), {})
        _, binding, bound = entry

        def names(slot: int):
            inputs, outputs = slot_names(self.config.num_layers, slot)
            return list(zip(inputs[3::2], inputs[4::2])), [[k, v] for k, v in zip(outputs[::2], outputs[1::2])]
        return binding, _bind_slots(binding.io, bound, seqs, spare, size, names)

    @property
    def batch_sessions(self) -> list[int]:
        """The batch sizes that have a session now."""
        return sorted(self._batched)

    @property
    def draft_sessions(self) -> list[tuple[str, int]]:
        """The one-sequence drafters that have a session now, as (kind, steps)."""
        return sorted(self._draft_sessions)

    @property
    def batch_drafters(self) -> list[tuple[str, int, int]]:
        """The batched drafters that have a session now, as (kind, steps, batch size)."""
        return sorted(self._draft_batches)

    def trim(self) -> None:
        """Drop the spare slots' caches; and where a session keeps weights of its own
        (:func:`copies_weights`: MLAS prepacks a MatMul's weight per session where the native
        kernels do not take it, 48-56 MB a session for the embedded LLM), the batched sessions and
        the drafters' too, the next batch of a size opening its session again (~0.1 s). Sessions
        that share every weight (:meth:`_share_weights`) stay: with no memory arena
        (:func:`session_options`) they hold ~2 MB each, where opening them again made every burst
        after an idle spell slow (16 streams of the embedded pair: 9 sessions opened in 0.61 s,
        1485-1651 tokens/s against ~4000 warm; `/tmp/s57/cold.py`). A sequence open meanwhile
        goes on with the sessions it was bound to (its bindings hold them) until it ends, and is
        then freed, not kept as a spare. The shared weights stay."""
        super().trim()
        self._scratch = None
        self._draft_scratch = None
        if self.sessions_copy_weights:
            self._batched.clear()
            self._draft_sessions.clear()
            self._draft_batches.clear()


def copies_weights(model) -> bool:
    """Whether a session of ``model`` keeps a copy of weights of its own: ONNX Runtime prepacks
    the constant weight of a MatMul or Gemm for each session (MLAS's packed layout), where the
    native kernels have not taken the product."""
    constants = {init.name for init in model.graph.initializer}
    return any(node.domain in ("", "ai.onnx") and node.op_type in ("MatMul", "Gemm") and len(node.input) > 1
               and node.input[1] in constants for node in model.graph.node)


def aligned_array(shape: tuple[int, ...], dtype, zeroed: bool = False, alignment: int = 64) -> np.ndarray:
    """An array on memory that starts on a cache line, as ONNX Runtime places what it allocates
    itself; ``zeroed``: filled with zeros, else left as allocated (for an output a run writes whole).
    numpy aligns its arrays to 16 bytes only: a KV cache bound from one could start 16, 32 or 48
    bytes past a line, as the heap placed it, and every 64-byte load of the native attention then
    straddled two lines (a 16-token tree over 256 cached tokens, 66 against 49 us a layer on 2
    cores). Zeros come as ``np.zeros``'s do, pages zeroed as first touched: a sequence's cache
    costs memory only as it fills."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffer = (np.zeros if zeroed else np.empty)(nbytes + alignment, np.uint8)
    start = -buffer.ctypes.data % alignment
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    """``array`` copied to memory that starts on a cache line (:func:`aligned_array`)."""
    out = aligned_array(array.shape, array.dtype)
    out[...] = array
    return out


SHARED_MIN_VALUES = 16384   # initializers this large are one copy for all of a runtime's sessions

# Batch sizes with a session of their own (a batch runs on the smallest that holds it; a larger
# one in chunks of the largest): each costs its arena once used (the weights are shared).
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def _numbered_by_the_kernel(start: int, positions: np.ndarray) -> bool:
    """Whether a call of several tokens on an empty cache is one GroupQueryAttention would number
    0..T-1 itself (it takes it for a prompt and ignores position_ids), wrongly for a tree."""
    return start == 0 and len(positions) > 1 and bool((positions != np.arange(len(positions))).any())


_session_outputs: "weakref.WeakKeyDictionary[object, frozenset[str]]" = weakref.WeakKeyDictionary()


def _outputs_of(session, presents: list[list[str]]) -> list[list[str]]:
    """``presents`` (per layer, output names) without those ``session`` lacks: the native drafter
    node has one present a layer where its graph had one a step (native.use_draft_chain)."""
    names = _session_outputs.get(session)
    if names is None:
        names = _session_outputs[session] = frozenset(o.name for o in session.get_outputs())
    return [[name for name in layer if name in names] for layer in presents]


def _bind_kv(io, seq: SequenceState, pasts: list[tuple[str, str]], presents: list[list[str]]) -> None:
    """Bind the sequence's cache in place: layer i's key and value as inputs ``pasts[i]`` and as
    every one of outputs ``presents[i]`` (key and value names alternating). By OrtValues over the
    cache's memory, made once a buffer (``seq.bindings``, cleared when it moves): binding one costs
    ONNX Runtime 0.34 us where binding by address cost 2.3, and the LLM's batched chain binds ~100
    a sequence (9,000 in a run of 32 requests on 16 streams: 34 ms of its 370, now 15)."""
    import onnxruntime as ort

    kv, values = seq.kv, seq.bindings.get(KV_VALUES, (None, None))
    if values[0] is not kv:   # made for this very buffer
        shape = (1,) + kv.shape[2:]
        values = seq.bindings[KV_VALUES] = (kv, [[ort.OrtValue.ortvalue_from_numpy(kv[layer, kind].reshape(shape))
                                                  for kind in range(2)] for layer in range(kv.shape[0])])
    values = values[1]
    for layer, names in enumerate(pasts):
        for kind, past in enumerate(names):
            value = values[layer][kind]
            io.bind_ortvalue_input(past, value)
            for present in presents[layer][kind::2]:
                io.bind_ortvalue_output(present, value)


KV_VALUES = "kv values"   # seq.bindings' entry: (the cache, the OrtValues over it) (_bind_kv)
KV_KEY = "kv key"         # seq.bindings' entry: the cache's address and shape (_buffer_key)


def _buffer_key(seq: SequenceState) -> tuple:
    """The address and shape of the sequence's cache, which :func:`_bind_slots` knows a slot's
    binding by; worked out once a buffer (``seq.bindings`` is cleared when the cache moves), as
    ``ndarray.ctypes.data`` costs ~0.9 us and a batch of 16 asked it ~40 times."""
    key = seq.bindings.get(KV_KEY)
    if key is None:
        key = seq.bindings[KV_KEY] = (seq.kv.ctypes.data, seq.kv.shape)
    return key


def _bind_slots(io, bound: dict, seqs: list[SequenceState], spare: SequenceState, size: int, names) -> list[int]:
    """Give each of ``seqs`` a slot of a batched session of ``size`` slots, with its cache bound
    there (``names(slot)``: the slot's pasts and presents, as :func:`_bind_kv` takes them), and
    bind ``spare``'s cache in the slots left; returns each sequence's slot.

    ``bound`` (slot -> the address and shape of the buffer bound there, kept with the binding)
    keeps a sequence in the slot it had, and the spare cache in its slots, so a batch binds only
    the caches new to the session: binding a slot's 2 x layers buffers costs ~0.15 ms, and
    holds the GIL (16 streams behind Triton, with slots given in arrival order, binding was ~18%
    of the time the fused model's process held the GIL)."""
    key = _buffer_key
    where = {k: slot for slot, k in bound.items()}
    slots: list = [None] * len(seqs)
    free = set(range(size))
    for i, seq in enumerate(seqs):
        slot = where.get(key(seq))
        if slot in free:
            slots[i] = slot
            free.discard(slot)
    # A new sequence takes a slot bound to neither it nor the spare cache first.
    order = sorted(free, key=lambda slot: (bound.get(slot) == key(spare), slot))
    for i, slot in enumerate(slots):
        if slot is None:
            slots[i] = order.pop(0)
    held = dict(zip(slots, seqs))
    for slot in range(size):
        seq = held.get(slot, spare)
        if bound.get(slot) != key(seq):
            _bind_kv(io, seq, *names(slot))
            bound[slot] = key(seq)
    return slots


def _chain_draft(outputs: list[np.ndarray], depth: int, sampled: bool) -> ChainDraft:
    """A drafter's outputs for one sequence (rows: its steps; read before the next run) as a
    :class:`ChainDraft` of its first ``depth`` steps: greedy, the two likeliest tokens and their
    probabilities from their logits and the mass (decoding's drafter: the tokens alone); sampled,
    the candidates, their logits and the token drawn."""
    if len(outputs) == 1:
        return ChainDraft(outputs[0][:depth, 0].tolist(), [], [], [], [], [])
    drafted, top, last = outputs[0][:depth], outputs[1][:depth], outputs[2][:depth, 0]
    if sampled:
        return ChainDraft(drafted[np.arange(depth), last].tolist(), [], [], [], list(drafted.copy()), list(top.copy()))
    probability = np.exp(top - top[:, :1]) / last[:, None]
    return ChainDraft(drafted[:, 0].tolist(), probability[:, 0].tolist(),
                      drafted[:, 1].tolist(), probability[:, 1].tolist(), [], [])


def _tokens_only(tokens: list[int]) -> ChainDraft:
    """A decoding chain's tokens as a :class:`ChainDraft`."""
    return ChainDraft(tokens, [], [], [], [], [])


def _drawn(draft: ChainDraft) -> ChainDraft:
    """``draft``, refused where a token is -1: a sampled decoding chain's row of logits had no mass
    to draw from (not finite)."""
    if draft.tokens and min(draft.tokens) < 0:
        raise SpecInferError("the LLM's logits have no mass to sample from (they are not finite)")
    return draft


def _feed_sampling(binding: "_Binding", depth: int, samplings: dict, size: int) -> None:
    """A sampled decoding chain's inputs for ``size`` slots (``samplings``: slot -> its
    :class:`ChainSampling`): each slot's temperature and its uniform at each step; a spare slot,
    or a step past a chain's uniforms, draws at temperature 1 and uniform 0.5 what no one reads."""
    from ..export.ort_lowering import SAMPLING_TEMPERATURE, SAMPLING_UNIFORM

    temperature, uniform = np.ones((1, size)), np.full((depth, 1, size), 0.5)
    for slot, sampling in samplings.items():
        temperature[0, slot] = sampling.temperature
        steps = min(depth, len(sampling.uniforms))
        uniform[:steps, 0, slot] = sampling.uniforms[:steps]
    binding.feed(SAMPLING_TEMPERATURE, temperature)
    for j in range(depth):
        binding.feed(f"{SAMPLING_UNIFORM}.{j}", uniform[j])


class _Binding:
    """An IOBinding that keeps its small inputs and its logits bound from one run to the next.

    Binding costs 3-20 us a tensor, and a one-token step spent ~280 us outside ONNX Runtime, most
    of it binding and allocating: so an input whose shape is bound already gets its new values
    written into the bound array, and a run's logits go to the buffer the last run wrote once its
    caller has let go of that one (a fresh buffer cost a 16-token tree ~60-80 us: its allocation,
    and ONNX Runtime faulting in its 0.5 MB of new pages)."""

    def __init__(self, session):
        # Runs on the session it was made with: a sequence bound before a trim reopened the
        # runtime's session keeps the old one until it ends.
        self.session, self.io = session, session.io_binding()
        self.inputs: dict[str, np.ndarray] = {}   # name -> the array bound, the binding's own
        self.logits: np.ndarray | None = None
        self.outputs: dict[str, np.ndarray] = {}
        self.rows: tuple[int, int] | None = None  # the logit rows bound (single-sequence runs)

    def set(self, name: str, value: int, shape: tuple[int, ...] = (1,)) -> None:
        """Write ``value`` into int32 input ``name`` of one element (bound on first use)."""
        bound = self.inputs.get(name)
        if bound is None:
            self.feed(name, np.full(shape, value, dtype=np.int32), fresh=True)
        else:
            bound[...] = value

    def feed(self, name: str, array: np.ndarray, fresh: bool = False) -> None:
        """Bind ``array`` as input ``name`` (its values: a ``fresh`` array, no one else's, is bound
        as it is, any other copied)."""
        bound = self.inputs.get(name)
        if bound is not None and bound.shape == array.shape:
            np.copyto(bound, array)
            return
        self.inputs[name] = bound = array if fresh else np.array(array)
        self.io.bind_cpu_input(name, bound)

    def outputs_of(self, specs) -> list[np.ndarray]:
        """Outputs of fixed shapes, ``(name, shape, dtype)`` each: bound once, rewritten every run."""
        if not self.outputs:
            for name, shape, dtype in specs:
                self.outputs[name] = array = aligned_array(shape, dtype)
                self.io.bind_output(name, "cpu", 0, array.dtype.type, shape, array.ctypes.data)
        return [self.outputs[name] for name, _, _ in specs]

    def run(self, logits_shape: tuple[int, ...]) -> np.ndarray:
        """Run the binding's session; returns the logits: the bound array itself, which stays the
        caller's as long as it holds it or any view of it (the next run then binds a fresh one)."""
        if self.logits is None or self.logits.shape != logits_shape or self._logits_held():
            self.logits = aligned_array(logits_shape, np.float32)
            self.io.bind_output("logits", "cpu", 0, np.float32, logits_shape, self.logits.ctypes.data)
        self.session.run_with_iobinding(self.io)
        return self.logits

    def _logits_held(self) -> bool:
        """Whether anything but this binding refers to the logits it returned, or to their memory
        (every view of them refers to the buffer that owns it: ``base``). Unheld, each is referred
        to once: compared with what ``sys.getrefcount`` says of such an array (:data:`_ONE_REF`),
        not with a constant, as what it counts besides varies by Python version."""
        return sys.getrefcount(self.logits) > _ONE_REF[0] or sys.getrefcount(self.logits.base) > _ONE_REF[1]


def _one_ref() -> tuple[int, int]:
    """What ``sys.getrefcount`` says of an array one attribute holds, and of the buffer one view
    holds (read as :meth:`_Binding._logits_held` reads them)."""
    holder = _Binding.__new__(_Binding)
    holder.logits = aligned_array((1,), np.float32)
    return sys.getrefcount(holder.logits), sys.getrefcount(holder.logits.base)


_ONE_REF = _one_ref()


def _feed_attention(binding: _Binding, start: int, tokens: np.ndarray, positions: np.ndarray, visible: np.ndarray,
                    suffix: str = "") -> None:
    """One sequence's attention inputs for its new ``tokens`` written from slot ``start``: the
    prefix's columns are visible to every new token, the tree's follow the ancestor bits. A chain
    straight after the prefix (a prompt, an incremental step: no earlier pending node, the last
    token at depth t - 1) needs no bias, GroupQueryAttention being causal itself."""
    t, n = len(tokens), len(visible)
    bias = np.zeros((1, 1, t, start + t), dtype=np.float32)
    if not (n == t and positions[-1] == start + t - 1):
        bias[0, 0, :, start + t - n:] = np.where(visible[n - t:], 0.0, LOWEST)
    binding.feed("attention_bias" + suffix, bias, fresh=True)
    binding.set("seqlens_k" + suffix, start + t - 1)
    binding.set("total_sequence_length" + suffix, start + t, ())
