"""A private CA and certificates for a secured local NATS (``jetrouter up --secure``, tests).

Made with the ``openssl`` command line (present wherever Python's own ``ssl`` module is built,
and no new Python dependency): an EC P-256 CA, a server certificate for the loopback names and
optional client certificates. Private keys are written readable by the owner only.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from errors.root import JetrouterError


class CertificateNotMade(JetrouterError, RuntimeError):
    """openssl is missing or refused to make a certificate (the message says which)."""


@dataclass(frozen=True, slots=True)
class CertPair:
    cert: Path
    key: Path


def _openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise CertificateNotMade("the `openssl` command is needed to make TLS certificates "
                                 "(Debian: apt-get install openssl)")
    return found


def _run(args: list[str], cwd: Path) -> None:
    proc = subprocess.run([_openssl(), *args], cwd=cwd, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CertificateNotMade(f"openssl {args[0]} failed: {last}")


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


class Pki:
    """A CA in ``directory`` (``ca.pem``/``ca.key``) that signs server and client certificates."""

    def __init__(self, directory: Path, *, days: int = 825) -> None:
        self.dir = Path(directory)
        self.days = days
        self.ca = CertPair(self.dir / "ca.pem", self.dir / "ca.key")

    def create_ca(self, name: str = "jetrouter local CA") -> CertPair:
        """A new CA unless one is already there (a restarted cluster keeps trusting it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.ca.cert.exists() and self.ca.key.exists():
            return self.ca
        _run(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
              "-nodes", "-keyout", str(self.ca.key), "-out", str(self.ca.cert),
              "-days", str(self.days), "-subj", f"/CN={name}",
              "-addext", "basicConstraints=critical,CA:TRUE",
              "-addext", "keyUsage=critical,keyCertSign,cRLSign"], self.dir)
        _private(self.ca.key)
        return self.ca

    def issue(self, name: str, *, dns: tuple[str, ...] = ("localhost",),
              ips: tuple[str, ...] = ("127.0.0.1",), client: bool = False) -> CertPair:
        """A certificate signed by the CA: a server's (SANs ``dns``/``ips``) or a client's."""
        pair = CertPair(self.dir / f"{name}.pem", self.dir / f"{name}.key")
        csr = self.dir / f"{name}.csr"
        ext = self.dir / f"{name}.ext"
        sans = [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]
        lines = ["basicConstraints=CA:FALSE",
                 "keyUsage=critical,digitalSignature,keyEncipherment",
                 f"extendedKeyUsage={'clientAuth' if client else 'serverAuth,clientAuth'}",
                 "subjectKeyIdentifier=hash", "authorityKeyIdentifier=keyid"]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        try:
            _run(["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", str(pair.key), "-out", str(csr), "-subj", f"/CN={name}"], self.dir)
            _private(pair.key)
            _run(["x509", "-req", "-in", str(csr), "-CA", str(self.ca.cert),
                  "-CAkey", str(self.ca.key), "-set_serial", str(secrets.randbits(63)),
                  "-days", str(self.days), "-extfile", str(ext), "-out", str(pair.cert)],
                 self.dir)
        finally:
            csr.unlink(missing_ok=True)
            ext.unlink(missing_ok=True)
        return pair
