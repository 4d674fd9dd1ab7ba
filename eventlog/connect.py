"""One place that knows how a jetrouter process connects to NATS (design.md §12).

NATS carries every fact, so every process — replica, projector, engine, bridge, `up` — connects
with the same options: servers plus credentials (a ``.creds`` file, an NKey seed file,
user/password, or a token) and TLS (CA, client certificate/key, ``tls://`` URLs, TLS handshake
first). :data:`NATS_SECURITY` declares those flags once (see :mod:`settings.flags`);
:func:`options_from_args` reads them back; :func:`connect` hands them to ``nats.connect``.

Secrets are best given as files (``--nats-password-file``, ``--nats-token-file``, ``--nats-creds``,
``--nats-nkey``) or as ``JETROUTER_NATS_PASSWORD`` / ``JETROUTER_NATS_TOKEN`` in the environment,
so they do not show in ``ps``; child processes get literal secrets through their environment
(:meth:`NatsOptions.child_env`), never their argv.

A configuration mistake — a wrong password, an unknown user, a certificate the CA does not sign —
is not a reason to retry: nats-py would loop forever (``max_reconnect_attempts=-1``). While the
first connection is being made, :func:`connect` turns those errors into one
:class:`NatsConnectFatal` whose message names the cause and the flags to check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from errors.root import JetrouterError
from settings.flags import Group, Option, add_options

log = logging.getLogger("jetrouter.nats")



class _QuietTlsClose(logging.Filter):
    """asyncio warns on every TLS connection nats-py closes ("returning true from
    eof_received() has no effect when using ssl"); it means nothing for us and would be the
    only line on stderr next to a one-line error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


logging.getLogger("asyncio").addFilter(_QuietTlsClose())

PASSWORD_ENV = "JETROUTER_NATS_PASSWORD"
TOKEN_ENV = "JETROUTER_NATS_TOKEN"


class NatsOptionsInvalid(JetrouterError, ValueError):
    """The options cannot work (a missing file, a key without its certificate, ...)."""


class NatsConnectFatal(JetrouterError, RuntimeError):
    """Connecting cannot succeed by retrying: authentication or TLS verification failed."""


def split_servers(url: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"nats://a:4222,nats://b:4222"`` (what ``--nats-url`` takes) as a tuple of URLs."""
    parts = url.split(",") if isinstance(url, str) else list(url)
    return tuple(p.strip() for p in parts if p.strip())


@dataclass(frozen=True, slots=True)
class NatsOptions:
    """How to reach and authenticate to NATS. Paths are read at connect time (a rotated file is
    picked up by the next process start); literal ``password``/``token`` are for the environment
    and for tests."""

    servers: tuple[str, ...] = ()
    creds_file: str | None = None  # JWT + NKey seed (.creds), decentralised auth
    nkey_seed_file: str | None = None  # NKey user seed
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    tls_handshake_first: bool = False

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise NatsOptionsInvalid("--nats-tls-cert and --nats-tls-key go together")
        if self.password and self.password_file:
            raise NatsOptionsInvalid("give --nats-password or --nats-password-file, not both")
        if self.token and self.token_file:
            raise NatsOptionsInvalid("give --nats-token or --nats-token-file, not both")
        if (self.password or self.password_file) and not self.user:
            raise NatsOptionsInvalid("--nats-password needs --nats-user")

    def with_servers(self, url: str | list[str] | tuple[str, ...]) -> NatsOptions:
        return replace(self, servers=split_servers(url))

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_handshake_first
                    or any(s.startswith("tls://") for s in self.servers))

    def auth_hint(self) -> str:
        """The flags a failed authentication should make the user check."""
        if self.creds_file:
            return f"check --nats-creds ({self.creds_file})"
        if self.nkey_seed_file:
            return f"check --nats-nkey ({self.nkey_seed_file})"
        if self.user:
            return (f"check --nats-user ({self.user}) and "
                    f"{'--nats-password-file' if self.password_file else '--nats-password'}")
        if self.token or self.token_file:
            return "check --nats-token / --nats-token-file"
        return ("the server wants credentials: give --nats-creds, --nats-nkey, "
                "--nats-user/--nats-password-file or --nats-token-file")

    # --- handing the options to a child process ------------------------------------------------

    def child_argv(self) -> list[str]:
        """Flags that reproduce these options, secrets excepted (see :meth:`child_env`)."""
        out: list[str] = []
        for flag, value in (("--nats-creds", self.creds_file),
                            ("--nats-nkey", self.nkey_seed_file),
                            ("--nats-user", self.user),
                            ("--nats-password-file", self.password_file),
                            ("--nats-token-file", self.token_file),
                            ("--nats-tls-ca", self.tls_ca),
                            ("--nats-tls-cert", self.tls_cert),
                            ("--nats-tls-key", self.tls_key),
                            ("--nats-tls-hostname", self.tls_hostname)):
            if value:
                out.append(f"{flag}={value}")
        if self.tls_handshake_first:
            out.append("--nats-tls-handshake-first")
        return out

    def child_env(self) -> dict[str, str]:
        """Literal secrets for a child's environment (argv is visible to every local user)."""
        env: dict[str, str] = {}
        if self.password:
            env[PASSWORD_ENV] = self.password
        if self.token:
            env[TOKEN_ENV] = self.token
        return env


# --- command line ----------------------------------------------------------------------------


NATS_SECURITY = Group(
    "NATS security",
    Option("nats-creds", metavar="FILE",
           help="NATS credentials file (.creds: user JWT + NKey seed)"),
    Option("nats-nkey", metavar="FILE", help="NATS NKey user seed file"),
    Option("nats-user", help="NATS user name"),
    Option("nats-password", help=f"NATS password (visible in ps: prefer --nats-password-file "
                                 f"or {PASSWORD_ENV})"),
    Option("nats-password-file", metavar="FILE", help="file holding the NATS password"),
    Option("nats-token", help=f"NATS auth token (prefer --nats-token-file or {TOKEN_ENV})"),
    Option("nats-token-file", metavar="FILE", help="file holding the NATS auth token"),
    Option("nats-tls-ca", metavar="FILE",
           help="CA certificate(s) that sign the NATS servers' certificates"),
    Option("nats-tls-cert", metavar="FILE",
           help="client certificate for NATS servers that verify clients"),
    Option("nats-tls-key", metavar="FILE", help="private key of --nats-tls-cert"),
    Option("nats-tls-hostname",
           help="name to verify the server certificate against (default: the URL's host)"),
    Option("nats-tls-handshake-first", bool,
           help="start TLS before the NATS INFO (servers with handshake_first)"),
)
"""How every process authenticates to NATS and checks its TLS. ``--nats-url`` stays with each
verb: its default differs (an engine without one publishes no events, `up` starts its own)."""

NAMESPACE = Option("namespace", default="jr",
                   help="prefix of every stream, subject and bucket; every process of one "
                        "cluster uses the same")


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    """The NATS security flags, for parsers built outside the ``jetrouter`` verbs (the
    projector child process, tests)."""
    add_options(parser, [NATS_SECURITY])


def options_from_args(args: argparse.Namespace, *, url: str | None = None,
                      environ: Mapping[str, str] | None = None,
                      check: bool = True) -> NatsOptions:
    """``NatsOptions`` from parsed flags (``url`` defaults to ``args.nats_url``). Literal secrets
    missing from the flags are taken from ``JETROUTER_NATS_PASSWORD`` / ``_TOKEN`` (what a
    parent passes to a child); ``api/cli.py`` already did that for the ``jetrouter`` verbs.
    ``check=False`` skips :func:`check_files` (``jetrouter check-config`` validates command
    lines whose files exist only inside containers)."""
    env = os.environ if environ is None else environ
    get = lambda name: getattr(args, name, None)  # noqa: E731 - verbs without a flag give None
    options = NatsOptions(
        servers=split_servers(url if url is not None else (get("nats_url") or "")),
        creds_file=get("nats_creds"),
        nkey_seed_file=get("nats_nkey"),
        user=get("nats_user"),
        password=get("nats_password") or (None if get("nats_password_file")
                                          else env.get(PASSWORD_ENV) or None),
        password_file=get("nats_password_file"),
        token=get("nats_token") or (None if get("nats_token_file")
                                    else env.get(TOKEN_ENV) or None),
        token_file=get("nats_token_file"),
        tls_ca=get("nats_tls_ca"),
        tls_cert=get("nats_tls_cert"),
        tls_key=get("nats_tls_key"),
        tls_hostname=get("nats_tls_hostname"),
        tls_handshake_first=bool(get("nats_tls_handshake_first")),
    )
    if check:
        check_files(options)
    return options


def check_files(options: NatsOptions) -> None:
    """Every named file exists and is readable: a typo is reported before any connection."""
    for flag, path in (("--nats-creds", options.creds_file),
                       ("--nats-nkey", options.nkey_seed_file),
                       ("--nats-password-file", options.password_file),
                       ("--nats-token-file", options.token_file),
                       ("--nats-tls-ca", options.tls_ca), ("--nats-tls-cert", options.tls_cert),
                       ("--nats-tls-key", options.tls_key)):
        if path and not os.access(path, os.R_OK):
            raise NatsOptionsInvalid(f"{flag} {path}: no such readable file")


# --- connecting ------------------------------------------------------------------------------


def _read_secret(path: str) -> str:
    return Path(path).read_text().strip()


def ssl_context(options: NatsOptions) -> ssl.SSLContext | None:
    """A verifying client context for the given CA and client certificate; None without TLS
    options (nats-py then uses the system CAs for ``tls://`` URLs)."""
    if not (options.tls_ca or options.tls_cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=options.tls_ca)
    if options.tls_cert and options.tls_key:
        ctx.load_cert_chain(options.tls_cert, options.tls_key)
    return ctx


def connect_kwargs(options: NatsOptions) -> dict[str, Any]:
    """The ``nats.connect`` keyword arguments these options stand for (files read now)."""
    kw: dict[str, Any] = {"servers": list(options.servers) or ["nats://127.0.0.1:4222"]}
    if options.creds_file:
        kw["user_credentials"] = options.creds_file
    if options.nkey_seed_file:
        kw["nkeys_seed"] = options.nkey_seed_file
    if options.user:
        kw["user"] = options.user
        password = options.password or (_read_secret(options.password_file)
                                        if options.password_file else None)
        if password is not None:
            kw["password"] = password
    token = options.token or (_read_secret(options.token_file) if options.token_file else None)
    if token:
        kw["token"] = token
    ctx = ssl_context(options)
    if ctx is not None:
        kw["tls"] = ctx
    if options.tls_hostname:
        kw["tls_hostname"] = options.tls_hostname
    if options.tls_handshake_first:
        kw["tls_handshake_first"] = True
    return kw


def fatal_reason(exc: BaseException, options: NatsOptions, url: str) -> str | None:
    """One line naming why connecting cannot work, or None when retrying may help."""
    text = str(exc)
    lowered = text.lower()
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in lowered:
        return f"NATS authorization violation connecting to {url}: {options.auth_hint()}"
    if "authentication expired" in lowered or "authentication revoked" in lowered:
        return f"NATS credentials expired or revoked connecting to {url}: {options.auth_hint()}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or text
        return (f"TLS certificate of the NATS server at {url} not trusted "
                f"({why}): check --nats-tls-ca"
                f"{' and --nats-tls-hostname' if options.tls_hostname else ''}")
    if isinstance(exc, ssl.SSLError):
        return (f"TLS handshake with the NATS server at {url} failed "
                f"({getattr(exc, 'reason', None) or text}): "
                "check --nats-tls-cert/--nats-tls-key and the server's TLS settings")
    if "tls required" in lowered or "secure connection" in lowered:
        return (f"the NATS server at {url} and this client disagree about TLS ({text}): "
                "check --nats-tls-ca and tls:// URLs")
    return None


ErrorCallback = Callable[[Exception], Awaitable[None]]


async def connect(options: NatsOptions, *, name: str | None = None,
                  error_cb: ErrorCallback | None = None, **tuning: Any) -> NatsClient:
    """``nats.connect`` with these options; ``tuning`` passes through (reconnect waits, ...).

    Raises :class:`NatsConnectFatal` at the first authentication or TLS verification failure of
    the initial connection instead of retrying forever. After that, errors go to ``error_cb``
    (and permission violations are logged: they mean the server's configuration refuses
    something this process does)."""
    kwargs = connect_kwargs(options)
    connecting = True
    nc = NatsClient()
    violations: set[str] = set()

    async def on_error(exc: Exception) -> None:
        if connecting:
            server = getattr(nc, "_current_server", None)
            url = server.uri.geturl() if server is not None else ",".join(kwargs["servers"])
            reason = fatal_reason(exc, options, url)
            if reason is not None:
                raise NatsConnectFatal(reason)
        text = str(exc)
        if "permissions violation" in text.lower() and text not in violations:
            violations.add(text)  # once per subject: a retry loop must not flood the log
            log.error("NATS refused an operation of %s: %s", name or "this client", text)
        if error_cb is not None:
            await error_cb(exc)

    try:
        await nc.connect(name=name, error_cb=on_error, **kwargs, **tuning)
    except NatsConnectFatal:
        # Bounded: closing a transport whose TLS handshake failed can wait forever.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 0.5)
        raise
    connecting = False
    return nc


async def check_connect(options: NatsOptions, *, name: str, timeout: float = 5.0) -> bool:
    """Try each server once, to report a configuration mistake before a process starts.

    Raises :class:`NatsConnectFatal` for bad credentials or TLS; returns True once a connection
    worked, False when no server could be reached (not a mistake: the process's own retries
    handle a NATS that starts later)."""
    for url in options.servers or ("nats://127.0.0.1:4222",):
        try:
            nc = await asyncio.wait_for(
                connect(options.with_servers(url), name=name, allow_reconnect=False,
                        connect_timeout=2), timeout)
        except NatsConnectFatal:
            raise
        except Exception:  # refused, unreachable, timed out: try the next server
            continue
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 1.0)
        return True
    return False


def check_connect_sync(options: NatsOptions, *, name: str, timeout: float = 5.0) -> bool:
    """:func:`check_connect` for a process's ``main`` (before its own event loop starts)."""
    return asyncio.run(check_connect(options, name=name, timeout=timeout))


__all__ = [
    "NAMESPACE",
    "NATS_SECURITY",
    "NatsConnectFatal",
    "NatsOptions",
    "NatsOptionsInvalid",
    "add_nats_arguments",
    "check_connect",
    "check_connect_sync",
    "connect",
    "connect_kwargs",
    "options_from_args",
    "split_servers",
]
