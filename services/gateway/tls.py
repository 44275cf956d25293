"""TLS on the gateway's public listeners (gRPC and HTTP) from PEM files, re-read when they
change, so a renewed certificate (cert-manager, a rotated Kubernetes Secret) is served to new
connections without a restart. Connections already open keep the certificate they began with.

- gRPC: ``grpc.dynamic_ssl_server_credentials``; gRPC core asks the fetcher at each new
  connection's handshake, which returns a new configuration only when the files' ``stat``
  changed (and the new pair loads).
- HTTP (uvicorn): one ``ssl.SSLContext`` for the listener; ``CertReloader.poll`` (every
  ``POLL_S`` seconds, on the event loop) calls ``load_cert_chain`` on it when the files
  changed: OpenSSL copies the chain into each connection at its handshake, so new connections
  get the new one. The client CA (``tls_client_ca_file``) is loaded once on HTTP (OpenSSL can
  add CAs to a context, not drop them): changing it needs a restart there; gRPC re-reads it.

A pair that does not load (a half-written update, a key that does not match) is logged and
the previous one kept; at start-up it raises ValueError naming the setting.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

import grpc

from services.auth import read_pem

log = logging.getLogger(__name__)

POLL_S = 1.0  # seconds between checks of the HTTP listener's certificate files


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of the gateway's public listeners; ``client_ca_file``: mutual TLS."""
    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @classmethod
    def from_settings(cls, cert: str | None, key: str | None, client_ca: str | None) -> TlsFiles | None:
        """None when TLS is off. Raises ValueError naming the setting that is missing."""
        if not cert and not key:
            if client_ca:
                raise ValueError("gateway.tls_client_ca_file: needs tls_cert_file and tls_key_file")
            return None
        if not cert or not key:
            missing = "gateway.tls_cert_file" if not cert else "gateway.tls_key_file"
            raise ValueError(f"{missing}: required with the other one (TLS needs both)")
        return cls(cert, key, client_ca or None)

    def signature(self) -> tuple:
        """What changes when any file is replaced (``stat`` through symlinks). Raises OSError."""
        paths = [self.cert_file, self.key_file, *([self.client_ca_file] if self.client_ca_file else [])]
        return tuple((s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size)
                     for s in (os.stat(p) for p in paths))

    def load_into(self, context: ssl.SSLContext) -> None:
        """The cert chain and key into ``context``. Raises ValueError naming the setting."""
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"gateway.tls_cert_file / gateway.tls_key_file: cannot load "
                             f"{self.cert_file!r} with {self.key_file!r}: {exc}") from None


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Credentials for the public gRPC listener that follow changes to ``files``. Raises
    ValueError at start when they cannot be loaded."""
    state: dict = {"bad": None}

    def configuration() -> grpc.ServerCertificateConfiguration:
        files.load_into(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))  # the pair matches
        ca = read_pem(files.client_ca_file, "gateway.tls_client_ca_file") if files.client_ca_file else None
        return grpc.ssl_server_certificate_configuration(
            [(read_pem(files.key_file, "gateway.tls_key_file"),
              read_pem(files.cert_file, "gateway.tls_cert_file"))], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:  # gRPC core's thread
        signature = None
        try:
            signature = files.signature()
            if signature in (state["signature"], state["bad"]):
                return None
            config = configuration()
        except (OSError, ValueError) as exc:
            if signature is not None:  # logged once per bad version of the files
                log.error("gRPC TLS: keeping the previous certificate: %s", exc)
            state["bad"] = signature
            return None
        state["signature"] = signature
        log.info("gRPC TLS: certificate files changed, new connections use them")
        return config

    initial = configuration()
    state["signature"] = files.signature()
    return grpc.dynamic_ssl_server_credentials(
        initial, fetch, require_client_authentication=files.client_ca_file is not None)


class CertReloader:
    """The HTTP listener's ``SSLContext`` (``context``), reloaded by ``poll`` when the files
    change. Raises ValueError at construction when they cannot be loaded."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        files.load_into(self.context)
        self._signature = files.signature()
        self._bad: tuple | None = None  # files that did not load
        if files.client_ca_file:
            self.context.verify_mode = ssl.CERT_REQUIRED
            try:
                self.context.load_verify_locations(cafile=files.client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"gateway.tls_client_ca_file: cannot load "
                                 f"{files.client_ca_file!r}: {exc}") from None

    def check(self) -> bool:
        """Reload the chain if the files changed; True when it did."""
        signature = None
        try:
            signature = self.files.signature()
            if signature in (self._signature, self._bad):
                return False
            probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.files.load_into(probe)  # never leave the live context half-loaded
            self.files.load_into(self.context)
        except (OSError, ValueError) as exc:
            if signature is not None:  # logged once per bad version of the files
                log.error("HTTP TLS: keeping the previous certificate: %s", exc)
            self._bad = signature
            return False
        self._signature = signature
        log.info("HTTP TLS: certificate files changed, new connections use them")
        return True

    async def poll(self, interval_s: float = POLL_S) -> None:
        """``check`` every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.check()
