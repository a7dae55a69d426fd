"""A per-job certificate authority and one serving certificate, as PEM bytes.

The CA's key signs the job's certificate and is then thrown away: nobody can issue another
certificate this job's pods would trust. The certificate (EC P-256) names every address the
job's pods are dialled by (wildcards `*.<job>.<ns>.svc` cover every replica, at any scale) and
serves both ends (serverAuth and clientAuth). `cryptography` is imported here only, lazily:
the PS and worker images read PEM files and never need it.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass

VALID_DAYS = 365  # a job's certificate is never rotated under running pods
CLOCK_SKEW = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class TlsMaterial:
    ca_crt: bytes
    tls_crt: bytes
    tls_key: bytes


def job_dns_names(job: str, namespace: str) -> list[str]:
    """The names a job's pods are reached by (`<pod>.<job>.<ns>.svc`, with and without the
    cluster domain)."""
    return [f"*.{job}.{namespace}.svc", f"*.{job}.{namespace}.svc.cluster.local"]


def issue(common_name: str, dns_names: list[str], ips: list[str] = (), days: int = VALID_DAYS) -> TlsMaterial:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - CLOCK_SKEW, now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tfps CA for {common_name}"[:64])])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return TlsMaterial(
        ca_crt=ca_cert.public_bytes(pem),
        tls_crt=cert.public_bytes(pem),
        tls_key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def new_token() -> str:
    """A job's bearer token: what its PS pods demand of every caller."""
    return secrets.token_urlsafe(32)
