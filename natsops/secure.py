"""`jetrouter up --secure`: credentials, certificates and a locked-down nats-server configuration.

Everything lives under ``<data-dir>/secure/``, readable by the owner only:

* ``tls/ca.pem`` (kept across restarts, so clients keep trusting it), ``tls/server.pem`` + key;
* ``users/<name>.password`` — one random password per identity: ``admin``, each replica, each
  engine (the user name is the replica or worker id);
* ``nats.conf`` — accounts, users and per-role permissions from :mod:`natsops.natsconf`.

Children get ``--nats-user NAME --nats-password-file FILE --nats-tls-ca FILE`` and ``tls://``
URLs, so no secret appears in their command lines.

For Docker Compose (``compose.secure.yaml``), ``python -m natsops.secure compose`` writes the same
kind of material into ``deploy/nats/secrets/`` (git-ignored): a CA, a server certificate for
``nats1``..``nats3``, one password file per compose identity and ``passwords.conf``, which the
committed ``deploy/nats/jetrouter.conf`` includes. :func:`compose_config` renders that committed
file (a test keeps it equal).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eventlog.connect import NatsOptions
from eventlog.names import Names
from natsops.natsconf import ServerTls, identities_for, render
from natsops.pki import CertificateNotMade, Pki

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


# --- Docker Compose ------------------------------------------------------------------------------

COMPOSE_REPLICAS = ("r1", "r2", "r3")
# vllm1: the bridge of the `vllm` profile publishes as that engine; vllm-prefill and
# vllm-decode: the bridges of the `vllm-pd` profile.
COMPOSE_WORKERS = ("w1", "w2", "w3", "w4", "vllm1", "vllm-prefill", "vllm-decode")
COMPOSE_NATS = ("nats1", "nats2", "nats3")
CONTAINER_DIR = "/etc/nats"  # where compose.secure.yaml mounts deploy/nats


def _variable(user: str) -> str:
    return "PW_" + user.upper().replace("-", "_")


def compose_config(names: Names | None = None) -> str:
    """deploy/nats/jetrouter.conf: compose's identities, passwords read from the generated
    ``secrets/passwords.conf``, TLS files under the container's /etc/nats/secrets/."""
    users = (ADMIN_USER, *COMPOSE_REPLICAS, *COMPOSE_WORKERS)
    tls_dir = f"{CONTAINER_DIR}/secrets/tls"
    header = "\n".join([
        "# nats-server configuration for",
        "#   docker compose -f compose.yaml -f compose.secure.yaml up -d",
        "# Rendered by natsops/secure.py compose_config() (a test keeps this file equal to it):",
        "# one account, one user per replica (r1-r3) and engine (w1-w4, the vLLM bridges) with",
        "# only the subjects its role needs (natsops/natsconf.py says which and why), an",
        "# unrestricted admin user, TLS for clients. No secret is here: `python -m natsops.secure",
        "# compose` writes them to deploy/nats/secrets/ (git-ignored), which defines $PW_* below.",
        "# Cluster routes stay plain TCP inside the compose network.",
        'include "secrets/passwords.conf"',
    ])
    return render(identities_for(COMPOSE_REPLICAS, COMPOSE_WORKERS,
                                 passwords={u: "$" + _variable(u) for u in users},
                                 admin_user=ADMIN_USER),
                  names=names or Names(),
                  tls=ServerTls(f"{tls_dir}/server.pem", f"{tls_dir}/server.key",
                                f"{tls_dir}/ca.pem"),
                  header=header)


def prepare_compose(deploy_nats: Path) -> Path:
    """Write deploy/nats/secrets/: CA, server certificate for the compose NATS services,
    one password file per identity and passwords.conf. Returns the secrets directory."""
    secrets_dir = Path(deploy_nats) / "secrets"
    secrets_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(secrets_dir, 0o700)  # the files inside stay readable by the containers' users
    pki = Pki(secrets_dir / "tls")
    pki.create_ca("jetrouter compose CA")
    server = pki.issue("server", dns=(*COMPOSE_NATS, "localhost"), ips=("127.0.0.1",))
    os.chmod(server.key, 0o644)  # read by nats-server inside its container
    users_dir = secrets_dir / "users"
    users_dir.mkdir(exist_ok=True)
    lines = ["# generated by `python -m natsops.secure compose`; included by ../jetrouter.conf"]
    for user in (ADMIN_USER, *COMPOSE_REPLICAS, *COMPOSE_WORKERS):
        password = secrets.token_urlsafe(24)
        path = users_dir / f"{user}.password"
        path.write_text(password + "\n")
        os.chmod(path, 0o644)
        lines.append(f'{_variable(user)}: "{password}"')
    conf = secrets_dir / "passwords.conf"
    conf.write_text("\n".join(lines) + "\n")
    os.chmod(conf, 0o644)
    return secrets_dir


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m natsops.secure",
                                description="credentials and certificates for compose.secure.yaml")
    p.add_argument("what", choices=("compose",))
    p.add_argument("--deploy-dir", type=Path, default=Path(__file__).resolve().parents[1]
                   / "deploy" / "nats", help="deploy/nats of the checkout (default)")
    args = p.parse_args(argv)
    try:
        out = prepare_compose(args.deploy_dir)
    except CertificateNotMade as exc:
        print(f"python -m natsops.secure: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote CA, server certificate (nats1..nats3) and passwords to {out}\n"
          f"admin password: {out / 'users' / 'admin.password'}\n"
          "start: docker compose -f compose.yaml -f compose.secure.yaml up -d --build")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
