"""llm: the target model; per sequence: prefill, then each step verify the merged tree and commit.

Triton's dynamic batcher gives ``execute`` every request that came while the last batch ran; each
runs on a pool thread, and the model's scheduler verifies all their trees in one LLM call
(specinfer.serving.models.VerifyModel).
"""
import os
import sys

# Triton's Python stub embeds its own interpreter, which ignores PYTHONPATH: `specinfer serve`
# passes the package folders of its environment in SPECINFER_PYTHONPATH.
sys.path[:0] = [p for p in os.environ.get("SPECINFER_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import triton_python_backend_utils as pb  # noqa: E402

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from specinfer.engines.loader import load_runtime  # noqa: E402
from specinfer.serving import triton_glue as glue  # noqa: E402
from specinfer.serving.models import VerifyModel  # noqa: E402

INPUTS = ["op", "sequence_id", "caller_key", "tokens", "tree_tokens", "tree_parents", "proposal_node", "proposal_ssm",
          "proposal_rank", "proposal_q_row", "proposal_q", "temperature", "top_k", "top_p", "random_seed", "rule",
          "max_tokens"]
# Pool threads: each request of a batch holds one while it waits for its LLM call (at most
# max_batch_size, 64, at once).
THREADS = 64


class TritonPythonModel:
    def initialize(self, args):
        p = glue.parameters(args)
        # No gathering in the scheduler: Triton's batcher has gathered what came while the last batch ran.
        self.model = VerifyModel(load_runtime(p["model_dir"], p["engine"], threads=int(p["threads"]) or None),
                                 key=glue.caller_key(args), kv_budget=int(p["kv_budget"]) if p["kv_budget"] else None,
                                 gather_seconds=0.0,
                                 batch_tree_tokens=int(p["batch_tree_tokens"]),
                                 prefill_chunk_tokens=int(p["prefill_chunk_tokens"]))
        self.metrics = glue.Metrics(pb, args["model_name"])
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="llm")
        glue.reclaim_idle(self.model, self.metrics.lock, float(p["idle_timeout"]), self.metrics)

    def run(self, t):
        out = glue.timed(lambda: self.model.handle(t), self.metrics.step_seconds, self.metrics.lock)
        with self.metrics.lock:
            if len(out["accepted_tokens"]):
                self.metrics.accepted.observe(len(out["accepted_tokens"]))  # accepted speculation + bonus
            self.metrics.update(self.model)
        return out

    def execute(self, requests):
        answers = [self.pool.submit(glue.handle, pb, r, INPUTS, self.run, "llm", batched=True) for r in requests]
        return [a.result() for a in answers]
