"""A throwaway certificate authority for a local stack (`epd up --tls`) and for tests.

`LocalCa` makes a CA key and certificate and issues leaf certificates whose subject common name is
`epd-<role>` (the role `libs.rpc.security` checks) and whose subject alternative names cover the
addresses the peer is reached at (loopback by default). Keys are EC P-256; certificates last a day.
Real deployments bring their own CA (cert-manager, a service mesh's, ...): only the CN convention
matters here.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from libs.rpc.security import CN_PREFIX, TlsMaterial

_LOOPBACK = ("127.0.0.1", "localhost")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


@dataclass(frozen=True)
class LocalCa:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str = "epd local CA") -> LocalCa:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, role: str, names: tuple[str, ...] = _LOOPBACK) -> TlsMaterial:
        """A certificate for `role` (CN `epd-<role>`), valid for server and client use at `names`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CN_PREFIX + role)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(_san(names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return TlsMaterial(ca=self.pem, cert=cert.public_bytes(serialization.Encoding.PEM), key=_pem_key(key))


def write_material(material: TlsMaterial, directory: Path, stem: str) -> tuple[Path, Path, Path]:
    """Write CA, certificate and key (mode 0600) as `ca.pem`, `<stem>.pem`, `<stem>.key`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, cert, key = directory / "ca.pem", directory / f"{stem}.pem", directory / f"{stem}.key"
    ca.write_bytes(material.ca)
    cert.write_bytes(material.cert)
    key.touch(mode=0o600)
    key.write_bytes(material.key)
    return ca, cert, key
