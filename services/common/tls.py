"""TLS for kvshuttle's own gRPC servers and channels, and TLS/auth for etcd: shared typed settings.

Every service takes the same flags and environment variables (mixins for its config dataclass, like
``TelemetryConfig``):

* ``TlsConfig`` (registry, scheduler, gateway): the certificate its gRPC server presents (``KVSHUTTLE_TLS_CERT`` /
  ``_KEY``), the CA client certificates must chain to (``KVSHUTTLE_TLS_CLIENT_CA``: set = mutual TLS, a client without a
  valid certificate is refused in the handshake), the largest gRPC message it takes, and everything in
  ``TlsClientConfig``.
* ``TlsClientConfig`` (also the worker agent): the CA that verifies the kvshuttle servers this process calls
  (``KVSHUTTLE_TLS_CA``: set = TLS to them), the certificate it presents to servers that require one
  (``KVSHUTTLE_TLS_CLIENT_CERT`` / ``_KEY``), and the name to verify (``KVSHUTTLE_TLS_SERVER_NAME``).
* ``EtcdSecurityConfig`` (registry, scheduler with ``--etcd-endpoints``): etcd's CA, client certificate, user name and
  password (``KVSHUTTLE_ETCD_*``).

Empty settings keep plaintext. The vLLM workers' own gRPC servers are vLLM's and stay plaintext (see docs/security.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
from kvshuttle.services.common.config import ConfigError, require, setting

DEFAULT_MAX_MESSAGE_MB = 4  # gRPC's own default for received messages


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """PEM bytes for a gRPC server; ``client_ca`` set = client certificates are required (mutual TLS)."""

    cert: bytes = dataclasses.field(repr=False)
    key: bytes = dataclasses.field(repr=False)
    client_ca: bytes | None = dataclasses.field(default=None, repr=False)
    # Under mutual TLS: authorize each call of the registry's and the scheduler's APIs by the caller's certificate
    # (services/common/caller_check.py).
    check_callers: bool = True

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """PEM bytes for a gRPC channel: the CA that verifies the server, optionally a client certificate."""

    ca: bytes = dataclasses.field(repr=False)
    cert: bytes | None = dataclasses.field(default=None, repr=False)
    key: bytes | None = dataclasses.field(default=None, repr=False)
    server_name: str = ""  # verify this name instead of the target's host

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes; ConfigError naming the setting when it is missing or holds no PEM block."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what}: {path!r} is not a PEM file")
    return data


@dataclasses.dataclass
class TlsClientConfig:
    """TLS towards kvshuttle's gRPC servers (registry, scheduler, gateway)."""

    tls_ca: str = setting("", "CA bundle (PEM) that verifies the kvshuttle gRPC servers this process calls; set: "
                              "connect with TLS, empty: plaintext", env="KVSHUTTLE_TLS_CA")
    tls_client_cert: str = setting("", "Certificate (PEM) this process presents to kvshuttle servers that require "
                                       "client certificates (mutual TLS)", env="KVSHUTTLE_TLS_CLIENT_CERT")
    tls_client_key: str = setting("", "Private key (PEM) of --tls-client-cert", env="KVSHUTTLE_TLS_CLIENT_KEY")
    tls_server_name: str = setting("", "Name to verify in the servers' certificates instead of the host of the "
                                       "address called (e.g. when calling by IP)", env="KVSHUTTLE_TLS_SERVER_NAME")

    def validate_tls_client(self) -> None:
        require(bool(self.tls_client_cert) == bool(self.tls_client_key),
                "--tls-client-cert and --tls-client-key (KVSHUTTLE_TLS_CLIENT_CERT/_KEY) go together")
        require(not self.tls_client_cert or bool(self.tls_ca),
                "--tls-client-cert needs --tls-ca (KVSHUTTLE_TLS_CA): client certificates are sent over TLS only")
        self.client_tls()  # the files must be readable PEM

    def client_tls(self) -> ClientTls | None:
        """The channel settings, or None for plaintext."""
        if not self.tls_ca:
            return None
        cert = read_pem(self.tls_client_cert, "--tls-client-cert") if self.tls_client_cert else None
        key = read_pem(self.tls_client_key, "--tls-client-key") if self.tls_client_key else None
        return ClientTls(read_pem(self.tls_ca, "--tls-ca"), cert, key, self.tls_server_name)


@dataclasses.dataclass
class TlsConfig(TlsClientConfig):
    """TLS (optionally mutual) for this service's gRPC server, its channels to the other services, and the largest
    gRPC message it takes."""

    tls_cert: str = setting("", "Certificate (PEM) this service's gRPC server presents; set: serve TLS only, "
                                "empty: plaintext", env="KVSHUTTLE_TLS_CERT")
    tls_key: str = setting("", "Private key (PEM) of --tls-cert", env="KVSHUTTLE_TLS_KEY")
    tls_client_ca: str = setting("", "CA bundle (PEM) client certificates must chain to; set: mutual TLS (clients "
                                     "without a valid certificate are refused)", env="KVSHUTTLE_TLS_CLIENT_CA")
    authorize_callers: bool = setting(True, "Under mutual TLS, allow each call of the registry's and the scheduler's "
                                            "APIs only to the service identities its method is for (the client "
                                            "certificate's Common Name: registry, scheduler, gateway, worker, admin; "
                                            "docs/security.md); off: any certificate of the CA may call anything",
                                      env="KVSHUTTLE_AUTHORIZE_CALLERS")
    grpc_max_message_mb: int = setting(DEFAULT_MAX_MESSAGE_MB, "Largest gRPC message this service's server accepts "
                                                               "or sends, in MiB (larger: RESOURCE_EXHAUSTED)",
                                       env="KVSHUTTLE_GRPC_MAX_MESSAGE_MB")

    def validate_tls(self) -> None:
        require(bool(self.tls_cert) == bool(self.tls_key),
                "--tls-cert and --tls-key (KVSHUTTLE_TLS_CERT/_KEY) go together")
        require(not self.tls_client_ca or bool(self.tls_cert),
                "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key: the server must speak TLS")
        require(1 <= self.grpc_max_message_mb <= 2047, "--grpc-max-message-mb must be between 1 and 2047")
        self.validate_tls_client()
        self.server_tls()

    def server_tls(self) -> ServerTls | None:
        """The server settings, or None for plaintext."""
        if not self.tls_cert:
            return None
        client_ca = read_pem(self.tls_client_ca, "--tls-client-ca") if self.tls_client_ca else None
        return ServerTls(read_pem(self.tls_cert, "--tls-cert"), read_pem(self.tls_key, "--tls-key"), client_ca,
                         check_callers=self.authorize_callers)

    @property
    def max_message_bytes(self) -> int:
        return self.grpc_max_message_mb << 20


@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    """How to reach etcd: TLS (``ca`` set; ``cert``/``key`` for client-certificate auth) and/or user + password."""

    ca: bytes | None = dataclasses.field(default=None, repr=False)
    cert: bytes | None = dataclasses.field(default=None, repr=False)
    key: bytes | None = dataclasses.field(default=None, repr=False)
    server_name: str = ""
    username: str = ""
    password: str = dataclasses.field(default="", repr=False)


@dataclasses.dataclass
class EtcdSecurityConfig:
    """TLS and authentication towards etcd."""

    etcd_ca: str = setting("", "CA bundle (PEM) that verifies etcd's certificate; set: connect to etcd with TLS",
                           env="KVSHUTTLE_ETCD_CA")
    etcd_cert: str = setting("", "Client certificate (PEM) for etcd (--client-cert-auth)", env="KVSHUTTLE_ETCD_CERT")
    etcd_key: str = setting("", "Private key (PEM) of --etcd-cert", env="KVSHUTTLE_ETCD_KEY")
    etcd_server_name: str = setting("", "Name to verify in etcd's certificate (default: the first endpoint's host)",
                                    env="KVSHUTTLE_ETCD_SERVER_NAME")
    etcd_username: str = setting("", "etcd user (etcd auth enabled); the password comes from KVSHUTTLE_ETCD_PASSWORD "
                                     "or --etcd-password-file", env="KVSHUTTLE_ETCD_USERNAME")
    etcd_password: str = setting("", "Password of --etcd-username (prefer the env var or the file: flags show in "
                                     "process lists)", env="KVSHUTTLE_ETCD_PASSWORD", secret=True)
    etcd_password_file: str = setting("", "File whose first line is the password of --etcd-username",
                                      env="KVSHUTTLE_ETCD_PASSWORD_FILE")

    def validate_etcd_security(self) -> None:
        require(bool(self.etcd_cert) == bool(self.etcd_key),
                "--etcd-cert and --etcd-key (KVSHUTTLE_ETCD_CERT/_KEY) go together")
        require(not self.etcd_cert or bool(self.etcd_ca), "--etcd-cert needs --etcd-ca (KVSHUTTLE_ETCD_CA)")
        require(not (self.etcd_password and self.etcd_password_file),
                "give --etcd-password or --etcd-password-file, not both")
        require(bool(self.etcd_username) or not (self.etcd_password or self.etcd_password_file),
                "an etcd password needs --etcd-username (KVSHUTTLE_ETCD_USERNAME)")
        self.etcd_security()

    def etcd_security(self) -> EtcdSecurity | None:
        """The settings for ``EtcdStore``, or None for plaintext without auth."""
        if not (self.etcd_ca or self.etcd_username):
            return None
        password = self.etcd_password
        if self.etcd_password_file:
            try:
                lines = Path(self.etcd_password_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"--etcd-password-file: cannot read {self.etcd_password_file!r}: "
                                  f"{exc.strerror or exc}") from None
            password = lines[0] if lines else ""
        return EtcdSecurity(
            ca=read_pem(self.etcd_ca, "--etcd-ca") if self.etcd_ca else None,
            cert=read_pem(self.etcd_cert, "--etcd-cert") if self.etcd_cert else None,
            key=read_pem(self.etcd_key, "--etcd-key") if self.etcd_key else None,
            server_name=self.etcd_server_name, username=self.etcd_username, password=password)
