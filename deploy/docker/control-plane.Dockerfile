# kvshuttle control plane: the session registry, the transfer scheduler and the gateway in one image. The subcommand
# is the container's args:
#
#   docker run IMAGE registry  --listen 0.0.0.0:50051 --etcd-endpoints etcd:2379
#   docker run IMAGE scheduler --listen 0.0.0.0:50052 --registry registry:50051
#   docker run IMAGE gateway   --http-listen 0.0.0.0:8000 --grpc-listen 0.0.0.0:50053 --model-dir /models/tiny ...
#
# The project without its worker extras: no torch, no vLLM. Build context: the repository root (see README.md here):
#
#   docker build -f deploy/docker/control-plane.Dockerfile -t ghcr.io/kvshuttle/control-plane:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with the project and its dependencies -------------------------------------------
FROM ${PYTHON_IMAGE} AS build
# A PyPI mirror, if any (pip reads these from the environment; unset: PyPI).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# The dependencies first, in a layer that only a pyproject.toml change rebuilds (versions: pyproject.toml only).
COPY pyproject.toml ./
COPY deploy/docker/requirements.py deploy/docker/
RUN python deploy/docker/requirements.py pyproject.toml > /tmp/requirements.txt \
 && pip install --only-binary=:all: -r /tmp/requirements.txt
# Then the project itself (the gRPC stubs are committed under protos/gen: no protoc here).
COPY README.md ./
COPY protos/gen/ protos/gen/
COPY control_plane/ control_plane/
COPY services/ services/
COPY workers/ workers/
# The development tools (local stack, embedded etcd launcher, demo, benches: kvshuttle.services.devtools) stay out of
# this image; `kvshuttle demo` etc. then say so.
RUN pip install --no-deps . \
 && rm -r "$(python -c 'import kvshuttle.services.devtools as m, os; print(os.path.dirname(m.__file__))')" \
 && kvshuttle --help >/dev/null \
 && python -c 'import kvshuttle.services.gateway.server, kvshuttle.services.registry.server, kvshuttle.services.scheduler.server'

# ---- final: the interpreter and the virtual environment, nothing else ----------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvshuttle control plane" \
      org.opencontainers.image.description="kvshuttle session registry, transfer scheduler and gateway" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
RUN groupadd --gid 10001 kvshuttle \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kvshuttle --shell /usr/sbin/nologin kvshuttle \
 && install -d -o 10001 -g 10001 /var/lib/kvshuttle
COPY --from=build /opt/venv /opt/venv
WORKDIR /var/lib/kvshuttle
USER 10001:10001
# registry, scheduler, gateway gRPC, gateway HTTP (the defaults; every service listens on loopback unless told).
EXPOSE 50051 50052 50053 8000
ENTRYPOINT ["kvshuttle"]
CMD ["--help"]
