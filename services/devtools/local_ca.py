"""A certificate authority of the local stack's own: one CA and a certificate per service identity, so that
`kvshuttle up`, the demo and the end-to-end tests run the registry and the scheduler under mutual TLS, with each call
authorized by the caller's Common Name (control_plane/service_access.py), as the Helm chart does by default.

Keys are P-256, certificates last ``days`` and name 127.0.0.1 and localhost. The files are written into one directory
(private keys 0600); nothing here is meant for a real deployment, which brings its own CA (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class CertFiles:
    """A certificate and its private key, as PEM files."""

    cert: str
    key: str


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)
    return str(path)


def _subject(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alt_names(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


class LocalCA:
    """A self-signed CA that issues certificates (server and client use) into ``directory``."""

    def __init__(self, directory: Path, name: str = "kvshuttle local CA", *, days: float = 7.0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.days = days
        self.key = _new_key()
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_subject(name)).issuer_name(_subject(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=days))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_file = str(self.dir / f"{name.replace(' ', '-')}.pem")
        Path(self.ca_file).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, *, server: bool = True, client: bool = True,
              hosts: tuple[str, ...] = LOOPBACK) -> CertFiles:
        """A certificate for ``common_name`` (a service identity such as ``gateway`` or ``worker:decode-0``)."""
        key = _new_key()
        now = datetime.datetime.now(datetime.UTC)
        usages = [u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client))
                  if on]
        builder = (x509.CertificateBuilder().subject_name(_subject(common_name)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=self.days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        slug = common_name.replace(" ", "-").replace(":", "_")
        cert_path = self.dir / f"{slug}.crt"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return CertFiles(str(cert_path), _write_key(key, self.dir / f"{slug}.key"))
