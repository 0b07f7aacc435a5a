"""Test certificates made with the openssl command line: a CA, a server certificate for
127.0.0.1 and a client certificate, both signed by the CA, and a second CA that signed neither;
``issue_client_cert`` signs more client certificates with the CA."""

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


def issue_client_cert(certs: Certs, name: str, subject: str) -> tuple[str, str]:
    """One more client certificate signed by ``certs.ca``, with ``subject`` (e.g. "/O=tidekv", a
    subject without a Common Name); returns its (certificate, key) paths."""
    d = Path(certs.ca).parent
    _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
         cwd=d)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    return str(d / f"{name}.pem"), str(d / f"{name}.key")
