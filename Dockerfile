# specinfer on NVIDIA's Triton Inference Server container (GPU hosts).
# Not built on our CI machines (no Docker engine there); CI lints this file with hadolint.
#   docker build -t specinfer .
#   docker run --gpus all -p 8000-8002:8000-8002 -v /path/to/models:/models specinfer
# /models/llm and /models/ssm_0, /models/ssm_1, ... are Hugging Face checkpoint folders.
ARG TRITON_VERSION=25.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

WORKDIR /opt/specinfer
COPY pyproject.toml README.md ./
COPY specinfer ./specinfer
COPY docker/entrypoint.sh /usr/local/bin/specinfer-entrypoint

# torch, transformers and onnxscript export the checkpoints; tensorrt and polygraphy build engines.
RUN pip install --no-cache-dir -e ".[export,triton,tensorrt,gpu]" && chmod +x /usr/local/bin/specinfer-entrypoint

ENV SPECINFER_CACHE=/cache
EXPOSE 8000 8001 8002
ENTRYPOINT ["/usr/local/bin/specinfer-entrypoint"]
