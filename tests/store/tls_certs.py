"""Test certificates made with the openssl command line: a CA, a server certificate for
127.0.0.1 and a client certificate, both signed by the CA, and a second CA that signed neither."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(directory: Path) -> Certs:
    """Raises pytest.skip when there is no openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is missing (Debian package openssl); it makes the test certificates")
    d = directory
    for ca in ("ca", "other-ca"):
        _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
             "-days", "2", "-subj", f"/CN=tidekv test {ca}", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
             "-subj", f"/CN=tidekv test {who}", cwd=d)
        _run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{who}.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    return Certs(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"), str(d / "client.pem"),
                 str(d / "client.key"), str(d / "other-ca.pem"))
