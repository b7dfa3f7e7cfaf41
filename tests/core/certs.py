"""Throwaway certificate authorities and certificates for TLS tests, made
with the `openssl` command line (valid one day, EC P-256)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True)
class CertAndKey:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("the TLS tests need the `openssl` command: install it (e.g. apt-get install openssl)")
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> CertAndKey:
    """A self-signed CA certificate and its key."""
    ca = CertAndKey(directory / f"{name}.pem", directory / f"{name}.key")
    _openssl("req", "-x509", *EC_KEY, "-keyout", str(ca.key), "-out", str(ca.cert), "-days", "1",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return ca


def issue(ca: CertAndKey, directory: Path, name: str, *, client: bool = False) -> CertAndKey:
    """A leaf certificate signed by `ca`: for a server on localhost /
    127.0.0.1, or for a client (mutual TLS)."""
    leaf = CertAndKey(directory / f"{name}.pem", directory / f"{name}.key")
    request = directory / f"{name}.csr"
    extensions = directory / f"{name}.ext"
    usage = "clientAuth" if client else "serverAuth"
    extensions.write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n")
    _openssl("req", *EC_KEY, "-keyout", str(leaf.key), "-out", str(request), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(request), "-CA", str(ca.cert), "-CAkey", str(ca.key),
             "-set_serial", str(secrets.randbits(63)), "-days", "1", "-out", str(leaf.cert),
             "-extfile", str(extensions))
    return leaf
