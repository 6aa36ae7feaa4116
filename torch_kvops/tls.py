"""TLS files shared by the control channel (control.py) and the vLLM side channel:
this engine's certificate and key, and the CA that signed the fleet's certificates.
Both ends verify each other (mutual TLS); clients also check the server's name or IP
against its certificate (subjectAltName)."""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths: ``cert_file`` and ``key_file`` of this engine, ``ca_file`` of the fleet."""

    cert_file: str
    key_file: str
    ca_file: str

    def server_context(self) -> ssl.SSLContext:
        """Server side: presents our certificate and requires one from the client."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.load_verify_locations(self.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: only fleet members connect
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """Client side: verifies the server's certificate and name, presents ours."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.load_verify_locations(self.ca_file)
        return ctx


def tls_files(cert_file: str, key_file: str, ca_file: str) -> Optional[TlsFiles]:
    """TlsFiles when all three are given, None when none is; an error otherwise."""
    given = [bool(cert_file), bool(key_file), bool(ca_file)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("TLS needs tls_cert_file, tls_key_file and tls_ca_file together")
    return TlsFiles(cert_file, key_file, ca_file)
