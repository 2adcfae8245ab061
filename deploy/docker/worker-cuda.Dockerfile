# kvshuttle GPU worker: `kvshuttle worker` (the agent) starts vLLM's gRPC server (CUDA vLLM, NIXL connector) as its
# child, registers it and keeps it registered. Installs the project with its `worker-cuda` extra: vllm (CUDA), PyPI's
# torch (CUDA 13.0 wheels, which bring the CUDA libraries), nixl, smg-grpc-servicer; every version in pyproject.toml.
#
# Base: NVIDIA's CUDA 13.0 base image, as vLLM's own image: the driver hooks for the NVIDIA container toolkit and the
# forward-compatibility libraries. On top, what vLLM's image keeps for run-time compilation (Triton's launcher
# needs a C compiler and Python.h; FlashInfer/DeepGEMM JIT kernels need nvcc and headers) and the RDMA user-space
# libraries UCX (NIXL's transport) uses for InfiniBand/RoCE. Needs a host driver for CUDA 13.0 (R580 or later).
# Build context: the repository root:
#
#   docker build -f deploy/docker/worker-cuda.Dockerfile -t ghcr.io/kvshuttle/worker-cuda:0.1.0 .

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

FROM ${CUDA_IMAGE}
# A PyPI mirror, if any (pip reads these from the environment; unset: PyPI).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
# The CUDA major-minor of CUDA_IMAGE, as NVIDIA's apt packages spell it; keep the two in step.
ARG CUDA_APT_VERSION=13-0
LABEL org.opencontainers.image.title="kvshuttle worker (CUDA)" \
      org.opencontainers.image.description="kvshuttle worker agent with CUDA vLLM and NIXL" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# Ubuntu 24.04's Python is 3.12 (vLLM 0.32 supports 3.11 to 3.14; kvshuttle needs 3.11 or later).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
      libnuma1 libibverbs1 ibverbs-providers librdmacm1 \
      cuda-nvcc-${CUDA_APT_VERSION} cuda-cudart-dev-${CUDA_APT_VERSION} cuda-nvrtc-${CUDA_APT_VERSION} \
      cuda-cuobjdump-${CUDA_APT_VERSION} libcurand-dev-${CUDA_APT_VERSION} libcublas-${CUDA_APT_VERSION} libnccl-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv
WORKDIR /tmp/kvshuttle
# The dependencies first, in a layer that only a pyproject.toml change rebuilds (versions: pyproject.toml only).
COPY pyproject.toml ./
COPY deploy/docker/requirements.py deploy/docker/
RUN python deploy/docker/requirements.py pyproject.toml worker-cuda > requirements.txt \
 && pip install --only-binary=:all: -r requirements.txt \
 && python -c "import torch; assert torch.version.cuda, 'a CPU build of torch: ' + torch.__version__"
# Then the project itself (the gRPC stubs are committed under protos/gen: no protoc here).
COPY README.md ./
COPY protos/gen/ protos/gen/
COPY control_plane/ control_plane/
COPY services/ services/
COPY workers/ workers/
RUN pip install --no-deps . \
 && python -c "import importlib.metadata as m; [m.version(d) for d in ('vllm', 'nixl', 'smg-grpc-servicer')]" \
 && kvshuttle --help >/dev/null \
 && cd / && rm -rf /tmp/kvshuttle
RUN groupadd --gid 10001 kvshuttle \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kvshuttle --shell /usr/sbin/nologin kvshuttle \
 && install -d -o 10001 -g 10001 /var/lib/kvshuttle
# Workers keep vLLM's caches, metrics and log under var/workers/<id> of the working directory; Triton, FlashInfer
# and torch keep theirs under $HOME/.cache.
WORKDIR /var/lib/kvshuttle
USER 10001:10001
# vLLM gRPC, NIXL side channel (the worker's defaults).
EXPOSE 50061 5600
ENTRYPOINT ["kvshuttle"]
CMD ["worker", "--help"]
