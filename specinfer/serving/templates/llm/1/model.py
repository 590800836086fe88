"""llm: the target model; per sequence: prefill, then each step verify the merged tree and commit.

Triton's dynamic batcher gives ``execute`` every request that came while the last batch ran, and
they run as one batch: one LLM call verifies all their trees (specinfer.serving.models.VerifyModel).
"""
import os
import sys

# Triton's Python stub embeds its own interpreter, which ignores PYTHONPATH: `specinfer serve`
# passes the package folders of its environment in SPECINFER_PYTHONPATH.
sys.path[:0] = [p for p in os.environ.get("SPECINFER_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import triton_python_backend_utils as pb  # noqa: E402

import threading  # noqa: E402

from specinfer.engines.loader import load_runtime  # noqa: E402
from specinfer.serving import triton_glue as glue  # noqa: E402
from specinfer.serving.models import VerifyModel  # noqa: E402

INPUTS = ["op", "sequence_id", "caller_key", "tokens", "tree_tokens", "tree_parents", "proposal_node", "proposal_ssm",
          "proposal_rank", "proposal_q_row", "proposal_q", "temperature", "top_k", "top_p", "random_seed", "rule",
          "max_tokens"]


class TritonPythonModel:
    def initialize(self, args):
        p = glue.parameters(args)
        self.model = VerifyModel(load_runtime(p["model_dir"], p["engine"], threads=glue.model_threads(p),
                                              kv_dtype=p.get("kv_dtype", "float32"),
                                              matmul_dtype=p.get("matmul_dtype", "float32")),
                                 key=glue.caller_key(args), kv_budget=int(p["kv_budget"]) if p["kv_budget"] else None,
                                 prefill_chunk_tokens=int(p["prefill_chunk_tokens"]), warm=glue.WARM_BATCHES)
        self.metrics = glue.Metrics(pb, args["model_name"], glue.metrics_seconds(p))
        self.lock = threading.Lock()
        glue.reclaim_idle(self.model, self.lock, float(p["idle_timeout"]), self.metrics)

    def execute(self, requests):
        with self.lock:
            responses = glue.handle_batch(pb, requests, INPUTS, self._verify, "llm", self.metrics.step_seconds)
            self.metrics.update(self.model)
        return responses

    def _verify(self, inputs):
        answers = self.model.handle_batch(inputs)
        for out in answers:
            if isinstance(out, dict) and len(out["accepted_tokens"]):
                self.metrics.accepted.observe(len(out["accepted_tokens"]))  # accepted speculation + bonus
        return answers
