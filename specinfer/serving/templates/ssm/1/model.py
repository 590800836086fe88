"""ssm_<i>: one speculative model; per sequence: prefill, then each step commit + draft a tree.
Triton's dynamic batcher gives ``execute`` every request that came while the last batch ran, and
their chains are drafted in one drafter run (specinfer.serving.models.DraftModel.handle_batch).
The same with parameter drafter "lookup": the ``lookup`` draft model, which runs no model."""
import json
import os
import sys
import threading
from pathlib import Path

# Triton's Python stub embeds its own interpreter, which ignores PYTHONPATH: `specinfer serve`
# passes the package folders of its environment in SPECINFER_PYTHONPATH.
sys.path[:0] = [p for p in os.environ.get("SPECINFER_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import triton_python_backend_utils as pb  # noqa: E402

from specinfer.engines.loader import load_runtime  # noqa: E402
from specinfer.serving import triton_glue as glue  # noqa: E402
from specinfer.serving.models import DraftModel, LookupModel  # noqa: E402
from specinfer.tree_sizing import StepCost  # noqa: E402

INPUTS = ["op", "sequence_id", "caller_key", "tokens", "root", "budget", "tree", "temperature", "top_k", "top_p", "random_seed"]


class TritonPythonModel:
    def initialize(self, args):
        p = glue.parameters(args)
        key, self.name = glue.caller_key(args), args["model_name"]
        cost = StepCost.from_dict(json.loads(Path(p["step_cost"]).read_text())) if p.get("step_cost") else None
        if p.get("drafter") == "lookup":
            self.model = LookupModel(int(p["index"]), int(p["vocab_size"]), cost, p["tree"], key=key)
        else:
            runtime = load_runtime(p["model_dir"], p["engine"], threads=glue.model_threads(p))
            self.model = DraftModel(runtime, int(p["index"]), p["tree"], cost, key=key,
                                    drafts_for=p.get("drafts_for") or "all")   # absent in older repositories
        self.metrics = glue.Metrics(pb, args["model_name"], glue.metrics_seconds(p))
        self.lock = threading.Lock()
        glue.reclaim_idle(self.model, self.lock, float(p["idle_timeout"]), self.metrics)

    def execute(self, requests):
        with self.lock:
            responses = glue.handle_batch(pb, requests, INPUTS, self.model.handle_batch, self.name,
                                          self.metrics.step_seconds)
            self.metrics.update(self.model)
        return responses
