"""Certificates and TLS contexts.

Sits beside the transports (node server, client runtime, pool): ``init_certs`` makes a private
CA and node/pool/client certificates with ``cryptography``; ``server_context`` and
``client_context`` turn them into ``ssl.SSLContext`` objects (TLS 1.2+, clients verify the
server's certificate and host name; a server given a client CA requires client certificates).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DIR = Path(os.environ.get("GPUWIRE_CERT_DIR", Path.home() / ".config" / "gpuwire" / "certs"))
VALID_DAYS = 825


class TLSConfigError(Exception):
    """TLS files are missing or unusable; the message names the file and the fix."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpuwire"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)


def _alt_names(hosts: list[str]) -> list:
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def init_certs(directory: Path | str = DEFAULT_DIR, hosts: list[str] | None = None, force: bool = False) -> dict:
    """Create ca.pem (+ key) and node/pool/client certificates signed by it. Returns paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_path = directory / "ca.pem"
    if ca_path.exists() and not force:
        raise TLSConfigError(f"{ca_path} already exists; pass --force to replace the whole set")
    hosts = hosts or ["127.0.0.1", "::1", "localhost"]
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(_name("gpuwire CA")).issuer_name(_name("gpuwire CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / "ca-key.pem", ca_key)
    paths = {"ca": str(ca_path)}
    for role, usage in (("node", ExtendedKeyUsageOID.SERVER_AUTH), ("pool", ExtendedKeyUsageOID.SERVER_AUTH),
                        ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(f"gpuwire {role}")).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if role != "client":
            builder = builder.add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        (directory / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(directory / f"{role}-key.pem", key)
        paths[role] = str(directory / f"{role}.pem")
        paths[f"{role}_key"] = str(directory / f"{role}-key.pem")
    return paths


def _require(path, what: str) -> str:
    if not path or not Path(path).is_file():
        raise TLSConfigError(f"{what} {path!r} does not exist; create certificates with `gpuwire certs init`")
    return str(path)


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(_require(cert, "certificate"), _require(key, "key"))
        if client_ca:
            context.load_verify_locations(_require(client_ca, "client CA"))
            context.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as exc:
        raise TLSConfigError(f"cannot use {cert} / {key}: {exc}") from None
    return context


def client_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(_require(ca, "CA certificate"))
        if cert:
            context.load_cert_chain(_require(cert, "client certificate"), _require(key, "client key"))
    except ssl.SSLError as exc:
        raise TLSConfigError(f"cannot use TLS files ({ca}, {cert}): {exc}") from None
    return context


def client_context_from_env() -> ssl.SSLContext | None:
    """GPUWIRE_TLS_CA (and for mutual TLS GPUWIRE_TLS_CERT + GPUWIRE_TLS_KEY), else None."""
    ca = os.environ.get("GPUWIRE_TLS_CA")
    if not ca:
        return None
    return client_context(ca, os.environ.get("GPUWIRE_TLS_CERT") or None, os.environ.get("GPUWIRE_TLS_KEY") or None)


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
