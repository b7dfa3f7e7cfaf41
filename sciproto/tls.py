"""Server-side TLS settings, and the loopback test that decides whether a
plaintext server is allowed to start."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sciproto.config import ConfigError


def read_pem(path: Path, setting: str) -> bytes:
    """The bytes of a PEM file, or a ConfigError naming the setting to fix."""
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{setting}: cannot read {path}: {error.strerror}") from error


class TlsServerConfig(BaseModel):
    """The server's certificate and, for mutual TLS, the CA that signs clients."""

    model_config = ConfigDict(extra="forbid")

    cert: Path = Field(..., description="PEM certificate chain of the server (leaf first)")
    key: Path = Field(..., description="PEM private key of the server")
    client_ca: Path | None = Field(None, description="PEM bundle of CAs whose client certificates are accepted")
    require_client_cert: bool = Field(False, description="Mutual TLS: refuse clients without a certificate signed by client_ca")

    @model_validator(mode="after")
    def _client_ca_for_mutual_tls(self) -> TlsServerConfig:
        if self.require_client_cert and self.client_ca is None:
            raise ValueError("tls.require_client_cert is true but tls.client_ca is not set: "
                             "give the CA bundle that signs client certificates")
        if self.client_ca is not None and not self.require_client_cert:
            # gRPC would then accept any client certificate without verifying it.
            raise ValueError("tls.client_ca is set but tls.require_client_cert is not: set "
                             "require_client_cert: true for mutual TLS, or drop client_ca")
        return self

    def credentials(self) -> grpc.ServerCredentials:
        key = read_pem(self.key, "server.tls.key")
        cert = read_pem(self.cert, "server.tls.cert")
        client_ca = read_pem(self.client_ca, "server.tls.client_ca") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=self.require_client_cert
        )


def is_loopback(host: str) -> bool:
    """True when `host` only accepts connections from this machine.
    "0.0.0.0", "::" and "" mean every interface, and other host names may
    resolve anywhere, so they count as remote."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
