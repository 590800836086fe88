"""llm: the target model; per sequence: prefill, then each step verify the merged tree and commit."""
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
          "proposal_rank", "proposal_q_row", "proposal_q", "temperature", "top_k", "top_p", "random_seed", "rule"]


class TritonPythonModel:
    def initialize(self, args):
        p = glue.parameters(args)
        self.model = VerifyModel(load_runtime(p["model_dir"], p["engine"], threads=int(p["threads"]) or None),
                                 key=glue.caller_key(args))
        self.metrics = glue.Metrics(pb, args["model_name"])
        self.lock = threading.Lock()
        glue.reclaim_idle(self.model, self.lock, float(p["idle_timeout"]), self.metrics)

    def run(self, t):
        out = glue.timed(lambda: self.model.handle(t), self.metrics.step_seconds)
        if len(out["accepted_tokens"]):
            self.metrics.accepted.observe(len(out["accepted_tokens"]))  # accepted speculation + bonus
        return out

    def execute(self, requests):
        with self.lock:
            out = [glue.handle(pb, r, INPUTS, self.run, "llm") for r in requests]
            self.metrics.update(self.model)
        return out
