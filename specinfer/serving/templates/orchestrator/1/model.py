"""ensemble (and ensemble_fused, ensemble_sync, by the repository's layout): the orchestrator.
Tokenize, prefill, then one speculation step after another until a stop condition, streaming text
as tokens are accepted (decoupled) or answering once (not decoupled).

mode "ensemble": each step is one BLS call of the spec_step ensemble (ssm_<i> -> tree_builder -> llm).
mode "fused": the models run in this process (the repository's only copy of them in its default
layout), every request's steps batched by one scheduler
(specinfer/scheduler.py: one LLM call verifies the trees of all running requests; KV under a budget).
mode "relay" (the default layout's ensemble_sync): no models; each unary request is passed to the
decoupled orchestrator ``relay_to`` by BLS and its one answer returned (Triton refuses unary infer
on decoupled models), so that its requests join the same scheduler.
Requests run on threads of their own, so one instance serves many sequences at once. A client's
cancel, or the server stopping, ends a request's loop at its next step and frees its sequences.
"""
import os
import sys

# Triton's Python stub embeds its own interpreter, which ignores PYTHONPATH: `specinfer serve`
# passes the package folders of its environment in SPECINFER_PYTHONPATH.
sys.path[:0] = [p for p in os.environ.get("SPECINFER_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import triton_python_backend_utils as pb  # noqa: E402

import uuid  # noqa: E402

from specinfer.engines.loader import load_runtime, onnx_folder  # noqa: E402
from specinfer.engines.onnxruntime import read_manifest  # noqa: E402
from specinfer.errors import RequestError, ServerStopping  # noqa: E402
from specinfer.serving import triton_glue as glue  # noqa: E402
from specinfer.scheduler import Scheduler, warm_for_requests  # noqa: E402
from specinfer.serving.orchestrator import Orchestrator, RemoteSpeculator, merge_responses  # noqa: E402
from specinfer.speculate import parse_tree  # noqa: E402
from specinfer.text import load_tokenizer  # noqa: E402

INPUTS = ["text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "random_seed", "end_id",
          "stop_words", "exclude_input_in_output", "tree", "rule"]


class TritonPythonModel:
    def initialize(self, args):
        p = glue.parameters(args)
        self.name = args["model_name"]
        self.decoupled = glue.is_decoupled(pb, args)
        tree, ssm_dirs = p["tree"], [d for d in p["ssm_dirs"].split(os.pathsep) if d]
        sampling_dirs = [d for d in p.get("sampling_ssm_dirs", "").split(os.pathsep) if d]
        lookup = p.get("lookup") == "1"   # the dynamic tree also drafts by lookup (the `lookup` model)
        budget = int(p["budget"])
        self.stream_interval = float(p.get("stream_interval", glue.STREAM_INTERVAL))   # absent in older repositories
        self.relay_to = p["relay_to"] if p["mode"] == "relay" else None
        make = None   # a relay makes no speculators: its orchestrator only reads requests
        if p["mode"] == "fused":
            # The models in this process, every request's steps batched by one scheduler.
            threads = int(p["threads"]) or None
            llm = load_runtime(p["llm_dir"], p["engine"], threads=threads, kv_dtype=p.get("kv_dtype", "float32"),
                               matmul_dtype=p.get("matmul_dtype", "float32"))
            ssms = [load_runtime(d, p["engine"], threads=threads) for d in ssm_dirs]   # SSMs: float32 caches
            sampling_ssms = [load_runtime(d, p["engine"], threads=threads) for d in sampling_dirs]
            scheduler = Scheduler(llm, ssms, sampling_ssms=sampling_ssms,
                                  kv_budget=int(p["kv_budget"]) if p["kv_budget"] else None,
                                  batch_tree_tokens=int(p["batch_tree_tokens"]),
                                  prefill_chunk_tokens=int(p["prefill_chunk_tokens"]), warm=glue.WARM_BATCHES)
            warm_for_requests(llm, ssms, sampling_ssms, parse_tree(tree), lookup)   # at load, not in a first request
            self.metrics = glue.Metrics(pb, args["model_name"], glue.metrics_seconds(p))   # what llm and ssm_<i> report otherwise
            # The scheduler's thread shares the GIL with two threads per request; after each model run
            # it waits for it at most this long (Python's default is 5 ms). Measured, 16 streams:
            # 1029-1073 tokens/s at 0.1-1 ms against 924-949 at 5 ms (docs/batching.md).
            sys.setswitchinterval(glue.FUSED_SWITCH_INTERVAL)
            max_context, eos_ids, vocab = llm.max_context, list(llm.config.eos_token_ids), llm.vocab_size
            make = lambda req, stats: glue.MeteredSpeculator(
                scheduler.speculator(req.max_tokens, req.params, parse_tree(req.tree or tree), rule=req.rule,
                                     lookup=lookup, stats=stats, budget=budget), self.metrics, scheduler)
        else:
            manifest = read_manifest(onnx_folder(p["llm_dir"]))
            max_context, eos_ids = manifest["max_context"], list(manifest["config"]["eos_token_ids"])
            vocab = manifest["config"]["vocab_size"]
        if p["mode"] == "ensemble":
            # Every drafter: each ssm_<i> knows whether it drafts for greedy or sampled requests.
            names = [f"ssm_{i}" for i in range(len(ssm_dirs) + len(sampling_dirs))] + (["lookup"] if lookup else [])
            call = lambda model, inputs: glue.bls(pb, model, inputs)
            key = glue.caller_key(args)
            make = lambda req, stats: RemoteSpeculator(call, names, uuid.uuid4().hex, max_context, req.params,
                                                       req.tree or tree, stats, key=key, rule=req.rule,
                                                       max_tokens=req.max_tokens)
        self.orchestrator = Orchestrator(load_tokenizer(p["tokenizer_dir"]), max_context, eos_ids, vocab, make, budget)
        # Which specinfer this stub imported (SPECINFER_PYTHONPATH's first), for whoever reads the log.
        pb.Logger.log_info(f"{self.name}: specinfer from {os.path.dirname(os.path.dirname(glue.__file__))}")

    def execute(self, requests):
        # Every request runs on a thread of its own (kept for the next request: glue.Workers) and
        # answers through its response sender, so that a long generation never holds up another
        # request (a non-decoupled model sends one response).
        for r in requests:
            glue.WORKERS.submit(self.run, r)
        return None

    def ended(self, cancelled=lambda: False) -> bool:
        """Whether a request's loop should end now: its client cancelled, or the server is stopping."""
        if glue.stopping():
            raise ServerStopping(f"{ServerStopping.PREFIX}: the request ended early")
        return cancelled()

    def run(self, request):
        # Responses go out from a thread of their own, so that this loop never waits for Triton.
        responses = glue.ResponseStream(pb, request, merge_responses, self.name, self.stream_interval)
        try:
            inputs = glue.read(request, INPUTS)
            if not self.decoupled and inputs.get("stream") is not None and bool(inputs["stream"].reshape(-1)[0]):
                raise RequestError("streaming needs a decoupled model: use ensemble or ensemble_fused")
            if self.relay_to:   # checked here, as the relayed request's errors come back as internal ones
                self.orchestrator.read_request(inputs)
                responses.send(glue.relay(pb, self.relay_to, inputs, merge_responses), final=True)
                return
            for tensors, final in self.orchestrator.run(inputs, lambda: self.ended(lambda: responses.cancelled)):
                if final or self.decoupled:
                    responses.send(tensors, final)
        except Exception as e:  # noqa: BLE001 - the request fails, the server keeps serving
            responses.fail(e)
