"""A throwaway CA and daemon certificates for TLS between peers (tests and bench/peer_tier.py)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


@dataclass
class CA:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: Path

    @classmethod
    def make(cls, tmp: Path, name: str) -> CA:
        key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        path = tmp / f"{name}.crt"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(name, key, cert, path)

    def issue(self, tmp: Path, name: str, *, dns: list[str], ips: list[str]) -> tuple[Path, Path]:
        """A certificate for a daemon, good as a server and as a client, and its key."""
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path = tmp / f"{name}.crt"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert_path, _write_key(key, tmp / f"{name}.key")


def tls_settings(ca: CA, cert: tuple[Path, Path], **more: str) -> dict[str, str]:
    """A daemon's settings (``DaemonProcess`` keywords) for TLS with ``cert``, trusting ``ca``."""
    return {
        "peer_tls_cert": str(cert[0]),
        "peer_tls_key": str(cert[1]),
        "peer_tls_ca": str(ca.path),
        **more,
    }
