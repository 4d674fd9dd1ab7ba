"""The NATS server configuration that gives each jetrouter role only the subjects it needs.

NATS access is the trust boundary (design.md §12): whoever can publish on ``<ns>.kv.<id>`` can
tell every router what engine ``<id>`` caches. One account holds every identity (JetStream
streams are per account); each identity gets publish/subscribe permissions from its role:

* **engine** (a simulated engine or a bridge in front of a real one), id ``W``: publish only its
  own ``<ns>.kv.W`` (through JetStream: the stream-info call it makes at start-up and the publish
  itself, whose ack comes back on its inbox) and its load gauges ``<ns>.load.W``; receive only
  re-announce requests for itself or for all. It cannot create, update or purge streams, cannot
  touch the router or control streams, the heartbeat/lease buckets or the snapshot store.
* **replica**, id ``R``: its own router and heartbeat subjects, the control subjects, the heartbeat
  and lease KV buckets, the snapshot object store, and the JetStream API calls on the jetrouter
  streams only
  (no stream deletion, nothing outside jetrouter's streams). Because any replica may become the
  leader, it also holds rights one would rather not give
  (docs/decisions/0025-nats-trust-boundary-by-role.md lists them):
  ``ReplicaLost`` on *other* replicas' router subjects, ``WorkerRetired`` on engines' KV
  subjects, purging the streams (snapshot → purge), ``<ns>.control.reset`` (the leader carries
  out ``POST /admin/reset``), and creating/updating the jetrouter streams (set-up at start).
* **admin**: everything, including stream deletion; the identity for operators' tools.

:func:`render` writes the configuration (users with plain or ``$ENV``-referenced passwords or
NKey public keys, optional TLS); ``deploy/nats/`` holds the rendering used by ``compose.yaml``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from eventlog.names import ANY, Names, check_token

ROLES = ("admin", "replica", "engine")
ACCOUNT = "JETROUTER"
DEFAULT_NAMES = Names()


@dataclass(frozen=True, slots=True)
class Identity:
    """One NATS user. ``password`` is a literal, or ``$NAME`` to read it from the server's
    environment; ``nkey`` is the user's public NKey (``U...``) instead of a password."""

    user: str
    role: str
    ident: str = ""  # replica id or worker id (admin: unused)
    password: str | None = field(default=None, repr=False)
    nkey: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.role != "admin":
            check_token(self.ident, f"{self.role} id")
        if (self.password is None) == (self.nkey is None):
            raise ValueError(f"identity {self.user}: give exactly one of password or nkey")


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    allow_responses: bool = True  # may answer requests it received (re-announce, admin verbs)


def jetrouter_streams(names: Names) -> tuple[str, ...]:
    """Every JetStream stream jetrouter uses: the three event streams and the three buckets."""
    return (*(names.stream(k) for k in ("kv", "router", "control")),
            f"KV_{names.replicas_bucket}", f"KV_{names.leases_bucket}",
            f"OBJ_{names.snapshot_bucket}")


def _read_api(stream: str) -> list[str]:
    """Reading a stream: info, direct/msg gets (KV get), ephemeral consumers, acks, flow control."""
    api = "$JS.API"
    return [f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>",
            f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
            f"{api}.CONSUMER.INFO.{stream}.*", f"{api}.CONSUMER.DELETE.{stream}.*",
            f"{api}.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


def _manage_api(stream: str) -> list[str]:
    api = "$JS.API"
    return [f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.UPDATE.{stream}",
            f"{api}.STREAM.PURGE.{stream}"]


def permissions(role: str, ident: str, names: Names) -> Permissions | None:
    """The permissions of one identity (None: unrestricted, the admin)."""
    if role == "admin":
        return None
    if role == "engine":
        check_token(ident, "worker id")
        return Permissions(
            # MSG.GET: a restarted bridge reads the last message on its own subject to resume.
            # NATS cannot narrow a get to one subject, so an engine can read (not write) any
            # KV message.
            publish=(names.kv_subject(ident), names.load_subject(ident), "$JS.API.INFO",
                     f"$JS.API.STREAM.INFO.{names.stream('kv')}",
                     f"$JS.API.STREAM.MSG.GET.{names.stream('kv')}"),
            subscribe=("_INBOX.>", names.reannounce_subject(ident),
                       names.reannounce_subject("all")),
        )
    if role == "replica":
        check_token(ident, "replica id")
        api: list[str] = ["$JS.API.INFO"]
        for stream in jetrouter_streams(names):
            api += _read_api(stream) + _manage_api(stream)
        return Permissions(
            publish=(names.router_subject(ANY), names.kv_subject(ANY),
                     names.control_subject(ANY), names.admin_subject(ANY),
                     names.reannounce_subject(ANY), names.health_report_subject,
                     names.heartbeat_subject(ident), f"$KV.{names.replicas_bucket}.>",
                     f"$KV.{names.leases_bucket}.>",
                     f"$O.{names.snapshot_bucket}.>", *api),
            subscribe=("_INBOX.>", names.load_subject(ANY), names.admin_subject(ANY),
                       names.health_report_subject,
                       names.heartbeat_subject(), f"$KV.{names.leases_bucket}.>"),
        )
    raise ValueError(f"unknown role {role!r}")


def _q(value: str) -> str:
    """A quoted config string (``$`` in a bare word would be read as a variable reference)."""
    return json.dumps(value)


def _list(values: Iterable[str], indent: str) -> str:
    items = list(values)
    if not items:
        return "[]"
    inner = "".join(f"{indent}  {_q(v)}\n" for v in items)
    return f"[\n{inner}{indent}]"


def _user_block(identity: Identity, names: Names, indent: str) -> str:
    lines = [f"{indent}{{"]
    if identity.nkey is not None:
        lines.append(f"{indent}  nkey: {_q(identity.nkey)}  # {identity.user}")
    else:
        assert identity.password is not None
        pw = identity.password
        value = pw if pw.startswith("$") and pw[1:].replace("_", "").isalnum() else _q(pw)
        lines.append(f"{indent}  user: {_q(identity.user)}")
        lines.append(f"{indent}  password: {value}")
    perms = permissions(identity.role, identity.ident, names)
    if perms is not None:
        deeper = indent + "    "
        pub = f"allow: {_list(perms.publish, deeper + '  ')}"
        if perms.publish_deny:
            pub += f"\n{deeper}  deny: {_list(perms.publish_deny, deeper + '  ')}"
        lines += [f"{indent}  permissions: {{",
                  f"{deeper}publish: {{",
                  f"{deeper}  {pub}",
                  f"{deeper}}}",
                  f"{deeper}subscribe: {{",
                  f"{deeper}  allow: {_list(perms.subscribe, deeper + '  ')}",
                  f"{deeper}}}"]
        if perms.allow_responses:
            lines.append(f"{deeper}allow_responses: true")
        lines.append(f"{indent}  }}")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ServerTls:
    cert_file: str
    key_file: str
    ca_file: str | None = None
    verify_clients: bool = False  # require a client certificate signed by ca_file
    handshake_first: bool = False


def render(identities: Sequence[Identity], *, names: Names = DEFAULT_NAMES,
           tls: ServerTls | None = None, header: str = "") -> str:
    """The nats-server configuration text: one account with JetStream and these users.
    Listen addresses, store dir and cluster routes stay on the command line."""
    seen: set[str] = set()
    for identity in identities:
        if identity.user in seen:
            raise ValueError(f"user {identity.user!r} appears twice")
        seen.add(identity.user)
    out = [header.rstrip("\n")] if header else []
    out.append(f"# jetrouter roles for namespace {names.namespace!r}: admin, replica, engine")
    out.append("accounts {")
    out.append(f"  {ACCOUNT} {{")
    out.append("    jetstream: enabled")
    out.append("    users: [")
    out += [_user_block(i, names, "      ") for i in identities]
    out.append("    ]")
    out.append("  }")
    out.append("}")
    if tls is not None:
        out.append("tls {")
        out.append(f"  cert_file: {_q(tls.cert_file)}")
        out.append(f"  key_file: {_q(tls.key_file)}")
        if tls.ca_file:
            out.append(f"  ca_file: {_q(tls.ca_file)}")
        out.append(f"  verify: {'true' if tls.verify_clients else 'false'}")
        if tls.handshake_first:
            out.append("  handshake_first: true")
        out.append("  timeout: 2")
        out.append("}")
    return "\n".join(out) + "\n"


def identities_for(replica_ids: Iterable[str], worker_ids: Iterable[str], *,
                   passwords: dict[str, str], admin_user: str = "admin") -> list[Identity]:
    """admin + one replica identity per replica id + one engine identity per worker id; the user
    name is the id itself, ``passwords`` maps user name to a literal or ``$ENV`` password."""
    out = [Identity(admin_user, "admin", password=passwords[admin_user])]
    out += [Identity(r, "replica", r, password=passwords[r]) for r in replica_ids]
    out += [Identity(w, "engine", w, password=passwords[w]) for w in worker_ids]
    return out
