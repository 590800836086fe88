"""postprocessing: the ids of one response -> their text (context_ids make it UTF-8 safe)."""
import os
import sys

# Triton's Python stub embeds its own interpreter, which ignores PYTHONPATH: `specinfer serve`
# passes the package folders of its environment in SPECINFER_PYTHONPATH.
sys.path[:0] = [p for p in os.environ.get("SPECINFER_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import triton_python_backend_utils as pb  # noqa: E402

from specinfer import triton_glue as glue  # noqa: E402
from specinfer.request import postprocess  # noqa: E402
from specinfer.text import load_tokenizer  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(glue.parameters(args)["tokenizer_dir"])

    def execute(self, requests):
        return [glue.handle(pb, r, ["output_ids", "context_ids"], lambda t: postprocess(self.tokenizer, t))
                for r in requests]
