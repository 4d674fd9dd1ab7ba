"""`jetrouter up --secure`: credentials, certificates and a locked-down nats-server configuration.

Everything lives under ``<data-dir>/secure/``, readable by the owner only:

* ``tls/ca.pem`` (kept across restarts, so clients keep trusting it), ``tls/server.pem`` + key;
* ``users/<name>.password`` — one random password per identity: ``admin``, each replica, each
  engine (the user name is the replica or worker id);
* ``nats.conf`` — accounts, users and per-role permissions from :mod:`eventlog.natsconf`.

Children get ``--nats-user NAME --nats-password-file FILE --nats-tls-ca FILE`` and ``tls://``
URLs, so no secret appears in their command lines.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eventlog.connect import NatsOptions
from eventlog.names import Names
from eventlog.natsconf import ServerTls, identities_for, render
from eventlog.pki import Pki

ADMIN_USER = "admin"


@dataclass(frozen=True, slots=True)
class SecureSetup:
    directory: Path
    config_file: Path
    ca_file: Path
    users: dict[str, Path]  # user name -> password file

    def client_options(self, user: str) -> NatsOptions:
        """Options of identity ``user`` (servers filled in by the caller)."""
        return NatsOptions(user=user, password_file=str(self.users[user]),
                           tls_ca=str(self.ca_file))

    def describe(self) -> dict[str, str]:
        return {"config": str(self.config_file), "ca": str(self.ca_file),
                "admin_user": ADMIN_USER, "admin_password_file": str(self.users[ADMIN_USER]),
                "users_dir": str(self.directory / "users")}


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def prepare(directory: Path, replica_ids: Sequence[str], worker_ids: Sequence[str], *,
            names: Names, hosts: Sequence[str] = ("localhost",),
            ips: Sequence[str] = ("127.0.0.1",)) -> SecureSetup:
    """Make (or refresh) the CA, server certificate, passwords and server configuration.
    Passwords are new on every call: every process of the cluster starts again with them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    pki = Pki(directory / "tls")
    pki.create_ca()
    server = pki.issue("server", dns=tuple(hosts), ips=tuple(ips))
    users_dir = directory / "users"
    users_dir.mkdir(exist_ok=True)
    passwords: dict[str, str] = {}
    users: dict[str, Path] = {}
    for user in (ADMIN_USER, *replica_ids, *worker_ids):
        passwords[user] = secrets.token_urlsafe(24)
        users[user] = users_dir / f"{user}.password"
        _write_private(users[user], passwords[user] + "\n")
    config = directory / "nats.conf"
    text = render(identities_for(replica_ids, worker_ids, passwords=passwords,
                                 admin_user=ADMIN_USER),
                  names=names,
                  tls=ServerTls(str(server.cert), str(server.key), str(pki.ca.cert)),
                  header="# written by `jetrouter up --secure`; passwords change every start")
    _write_private(config, text)
    return SecureSetup(directory, config, pki.ca.cert, users)
