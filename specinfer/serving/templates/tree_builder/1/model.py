"""tree_builder: merge the SSMs' trees into one (shared prefixes, node budget), root first."""
import os
import sys

# Triton's Python stub embeds its own interpreter, which ignores PYTHONPATH: `specinfer serve`
# passes the package folders of its environment in SPECINFER_PYTHONPATH.
sys.path[:0] = [p for p in os.environ.get("SPECINFER_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import triton_python_backend_utils as pb  # noqa: E402

from specinfer.serving import triton_glue as glue  # noqa: E402
from specinfer.serving.models import build_tree  # noqa: E402

FIELDS = ["tree_tokens", "tree_parents", "proposal_node", "proposal_ssm", "proposal_rank", "proposal_q_row", "proposal_q"]


class TritonPythonModel:
    def initialize(self, args):
        p = glue.parameters(args)
        self.num_ssms, self.vocab_size = int(p["num_ssms"]), int(p["vocab_size"])
        self.inputs = ["root", "budget"] + [f"{f}_{i}" for i in range(self.num_ssms) for f in FIELDS]

    def merge(self, t):
        trees = [{f: t[f"{f}_{i}"] for f in FIELDS} for i in range(self.num_ssms)]
        return build_tree(int(t["root"][0]), trees, int(t["budget"][0]), self.vocab_size)

    def execute(self, requests):
        return [glue.handle(pb, r, self.inputs, self.merge, "tree_builder", batched=True) for r in requests]
