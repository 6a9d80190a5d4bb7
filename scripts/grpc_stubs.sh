#!/usr/bin/env bash
# Regenerate the gRPC API's Python modules from src/ruvllm/grpc/ruvllm.proto with grpcio-tools (a test
# dependency): ruvllm_pb2.py (+ .pyi) and ruvllm_pb2_grpc.py, written beside the .proto unless an
# output folder is given. They are committed, so serving needs only grpcio and protobuf
# (docs/decisions.md); tests/server/test_grpc.py regenerates them into a scratch folder and checks
# that the committed ones are the same.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-src}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I src --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  src/ruvllm/grpc/ruvllm.proto
