"""`kvshuttle health-check` as a real process against a real grpc.health server on loopback: SERVING, NOT_SERVING,
nothing listening, a server that never answers, TLS (right CA and server name; no CA, another CA, wrong name) and
mutual TLS (with and without the client certificate)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.certs import TestCA

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
SERVER_NAME = "registry.kvshuttle.test"  # in the server certificate; 127.0.0.1 is not
SERVICE = "kvshuttle.v1.SessionRegistry"


class HealthServer:
    """A sync grpc server with only the standard HealthServicer, on a free loopback port."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None):
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if credentials is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def set(self, status: int, service: str = "") -> None:
        self.health.set(service, status)


@pytest.fixture(scope="module")
def plain() -> Iterator[HealthServer]:
    server = HealthServer()
    yield server
    server.server.stop(0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(directory / "ca"), TestCA(directory / "rogue", name="rogue CA")
    return {"ca": ca.ca_file, "rogue": rogue.ca_file, "server": ca.issue("registry", hosts=(SERVER_NAME,)),
            "client": ca.issue("probe", server=False)}


def tls_health_server(pki, mutual: bool) -> HealthServer:
    cert, key = Path(pki["server"].cert).read_bytes(), Path(pki["server"].key).read_bytes()
    client_ca = Path(pki["ca"]).read_bytes() if mutual else None
    server = HealthServer(grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                                      require_client_auth=mutual))
    server.set(health_pb2.HealthCheckResponse.SERVING)
    return server


@pytest.fixture(scope="module")
def tls_server(pki) -> Iterator[HealthServer]:
    server = tls_health_server(pki, mutual=False)
    yield server
    server.server.stop(0)


@pytest.fixture(scope="module")
def mtls_server(pki) -> Iterator[HealthServer]:
    server = tls_health_server(pki, mutual=True)
    yield server
    server.server.stop(0)


def health_check(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run the CLI without the caller's KVSHUTTLE_* settings; (exit status, its output, seconds taken)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvshuttle.services.commands", "health-check", *args], cwd=REPO,
                          env={**clean, **(env or {})}, capture_output=True, text=True, timeout=30)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def one_line(out: str) -> str:
    """The CLI's output, checked to be one line (no traceback, no gRPC log lines)."""
    assert out.endswith("\n") and out.count("\n") == 1, out
    return out


def test_serving(plain):
    plain.set(health_pb2.HealthCheckResponse.SERVING)
    rc, out, _ = health_check("--address", plain.address)
    assert (rc, out) == (0, "SERVING\n")


def test_not_serving(plain):
    plain.set(health_pb2.HealthCheckResponse.NOT_SERVING)
    rc, out, _ = health_check("--address", plain.address)
    assert (rc, out) == (1, "NOT_SERVING\n")


def test_named_service_from_env_only(plain):
    plain.set(health_pb2.HealthCheckResponse.NOT_SERVING)
    plain.set(health_pb2.HealthCheckResponse.SERVING, SERVICE)
    env = {"KVSHUTTLE_HEALTH_CHECK_ADDRESS": plain.address, "KVSHUTTLE_HEALTH_CHECK_SERVICE": SERVICE}
    assert health_check(env=env)[:2] == (0, "SERVING\n")
    rc, out, _ = health_check(env={**env, "KVSHUTTLE_HEALTH_CHECK_SERVICE": "no.such.Service"})
    assert rc == 1 and out.startswith("NOT_FOUND: ")


def test_nothing_listening_fails_fast_without_a_traceback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, took = health_check("--address", f"127.0.0.1:{port}", "--timeout-s", "2")
    assert rc == 1 and one_line(out).startswith("UNAVAILABLE: ") and took < 10


def test_a_server_that_never_answers_fails_at_the_deadline():
    with socket.socket() as s:  # accepts TCP connections (backlog) but never speaks HTTP/2
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        rc, out, took = health_check("--address", f"127.0.0.1:{s.getsockname()[1]}", "--timeout-s", "0.5")
    assert rc == 1 and one_line(out).startswith("DEADLINE_EXCEEDED: ") and took < 10


def test_tls_with_the_ca_and_server_name(pki, tls_server):
    env = {"KVSHUTTLE_TLS_CA": pki["ca"], "KVSHUTTLE_TLS_SERVER_NAME": SERVER_NAME}
    assert health_check("--address", tls_server.address, env=env)[:2] == (0, "SERVING\n")


def test_mutual_tls_needs_the_client_certificate(pki, mtls_server):
    env = {"KVSHUTTLE_TLS_CA": pki["ca"], "KVSHUTTLE_TLS_SERVER_NAME": SERVER_NAME}
    client = {"KVSHUTTLE_TLS_CLIENT_CERT": pki["client"].cert, "KVSHUTTLE_TLS_CLIENT_KEY": pki["client"].key}
    assert health_check("--address", mtls_server.address, env={**env, **client})[:2] == (0, "SERVING\n")
    rc, out, _ = health_check("--address", mtls_server.address, "--timeout-s", "2", env=env)
    assert rc == 1 and one_line(out).startswith("UNAVAILABLE: ")


@pytest.mark.parametrize("env", [
    {},  # plaintext to a TLS server
    {"KVSHUTTLE_TLS_SERVER_NAME": SERVER_NAME, "KVSHUTTLE_TLS_CA": "rogue"},  # a CA that did not sign it
    {"KVSHUTTLE_TLS_CA": "ca"},  # the right CA, but 127.0.0.1 is not the certificate's name
], ids=["no-ca", "other-ca", "wrong-name"])
def test_tls_refused(pki, tls_server, env):
    env = {k: pki[v] if k == "KVSHUTTLE_TLS_CA" else v for k, v in env.items()}
    rc, out, took = health_check("--address", tls_server.address, "--timeout-s", "2", env=env)
    assert rc == 1 and one_line(out).startswith("UNAVAILABLE: ") and took < 10
