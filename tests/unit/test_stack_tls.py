"""The local stack's mutual TLS (services/devtools/stack.py, local_ca.py): which certificate and settings each
service gets, without starting anything. The running stack's enforcement is tests/e2e/test_security.py's."""

from __future__ import annotations

from cryptography import x509
from cryptography.x509.oid import NameOID
from kvshuttle.services.devtools.stack import Stack, StackConfig


def common_name(path: str) -> str:
    cert = x509.load_pem_x509_certificate(open(path, "rb").read())
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def issuer(path: str) -> str:
    cert = x509.load_pem_x509_certificate(open(path, "rb").read())
    return cert.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def test_each_service_gets_a_certificate_of_its_own_identity_and_only_servers_require_clients(tmp_path):
    stack = Stack(StackConfig(work_dir=str(tmp_path)))
    assert stack.ca is not None and stack.ca.dir == tmp_path / "tls"
    registry = stack._tls_env("registry", ["registry", "--listen", "127.0.0.1:1"])
    assert common_name(registry["KVSHUTTLE_TLS_CERT"]) == "registry"
    assert registry["KVSHUTTLE_TLS_CLIENT_CA"] == registry["KVSHUTTLE_TLS_CA"] == stack.ca.ca_file
    assert registry["KVSHUTTLE_TLS_CLIENT_CERT"] == registry["KVSHUTTLE_TLS_CERT"]
    assert common_name(stack._tls_env("scheduler", ["scheduler"])["KVSHUTTLE_TLS_CERT"]) == "scheduler"

    gateway = stack._tls_env("gateway", ["gateway"])  # calls them; its public gRPC API stays as configured
    assert common_name(gateway["KVSHUTTLE_TLS_CLIENT_CERT"]) == "gateway"
    assert "KVSHUTTLE_TLS_CERT" not in gateway and "KVSHUTTLE_TLS_CLIENT_CA" not in gateway

    worker = stack._tls_env("worker", ["worker", "--role", "decode", "--worker-id", "decode-7"])
    assert common_name(worker["KVSHUTTLE_TLS_CLIENT_CERT"]) == "worker:decode-7"
    assert "KVSHUTTLE_TLS_CERT" not in worker
    assert issuer(worker["KVSHUTTLE_TLS_CLIENT_CERT"]) == stack.ca.name
    assert (tmp_path / "tls" / "worker_decode-7.key").stat().st_mode & 0o077 == 0  # private keys: owner only

    assert stack._tls_env("demo", ["demo"]) == {}  # not a service
    admin = stack.client_tls()
    assert admin is not None and admin.cert == open(stack.certificate("admin").cert, "rb").read()
    assert stack.grpcurl_args()[:2] == ["-cacert", stack.ca.ca_file]
    assert stack.certificate("gateway") == stack.certificate("gateway")  # issued once


def test_tls_false_runs_plaintext_and_has_no_certificates(tmp_path):
    stack = Stack(StackConfig(work_dir=str(tmp_path), tls=False))
    assert stack.ca is None and not (tmp_path / "tls").exists()
    assert stack._tls_env("registry", ["registry"]) == {} and stack.client_tls_env() == {}
    assert stack.client_tls() is None and stack.grpcurl_args() == ["-plaintext"]
