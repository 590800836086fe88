#!/bin/sh
# Export /models/llm and /models/ssm_*, build TensorRT engines when TensorRT can, write the model
# repository and serve it on all interfaces of the container.
set -eu
MODELS=${MODELS:-/models}
TREE=${TREE:-1,1,3,1,1,1,1,1}
WORK=${SPECINFER_CACHE:-/cache}
mkdir -p "$WORK"
set -- --llm "$WORK/onnx/llm"
specinfer export "$MODELS/llm" -o "$WORK/onnx/llm" --dtype fp16
for ssm in "$MODELS"/ssm_*; do
  [ -d "$ssm" ] || continue
  name=$(basename "$ssm")
  specinfer export "$ssm" -o "$WORK/onnx/$name" --dtype fp16
  set -- "$@" --ssm "$WORK/onnx/$name"
done
if python3 -c "import tensorrt" 2>/dev/null && specinfer build --help >/dev/null 2>&1; then
  specinfer build "$WORK/onnx/llm" -o "$WORK/engines/llm"
  for dir in "$WORK"/onnx/ssm_*; do
    [ -d "$dir" ] && specinfer build "$dir" -o "$WORK/engines/$(basename "$dir")"
  done
  set -- "$@" --engines "$WORK/engines"
fi
specinfer repo "$@" --tree "$TREE" -o "$WORK/repo"
exec specinfer serve "$WORK/repo" --host 0.0.0.0
