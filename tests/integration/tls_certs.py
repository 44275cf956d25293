"""Throwaway certificates for TLS tests (the ``cryptography`` package): a CA, and leaf
certificates it signs for 127.0.0.1 / localhost, usable as server and client certificates."""
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


@dataclass
class Ca:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    cert_file: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1))


def make_ca(directory: Path, cn: str = "tandem test CA") -> Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _validity(x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                     .public_key(key.public_key()).serial_number(x509.random_serial_number())
                     ).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True
                                     ).sign(key, hashes.SHA256())
    path = directory / f"{cn.replace(' ', '-')}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Ca(key, cert, path)


def make_leaf(ca: Ca, directory: Path, cn: str) -> tuple[Path, Path, bytes]:
    """(cert file, key file, certificate DER) for 127.0.0.1 and localhost, server and client
    use; files are replaced atomically when they exist (as a certificate rotation does)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _validity(x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.cert.subject)
                     .public_key(key.public_key()).serial_number(x509.random_serial_number()))
    cert = cert.add_extension(x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
    ).add_extension(x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
    ).sign(ca.key, hashes.SHA256())
    cert_file, key_file = directory / f"{cn}.crt", directory / f"{cn}.key"
    _replace(key_file, key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
    _replace(cert_file, cert.public_bytes(serialization.Encoding.PEM))
    return cert_file, key_file, cert.public_bytes(serialization.Encoding.DER)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
