"""NATS connection options (eventlog/connect.py), server permissions (natsops/natsconf.py) and
subject binding (eventlog/binding.py) — the parts that need no server. The real server is in
tests/integration/eventlog/test_nats_security.py."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import nats.errors
import pytest

from api.cli import build_parser, main
from eventlog import binding
from eventlog.connect import (
    PASSWORD_ENV,
    NatsOptions,
    NatsOptionsInvalid,
    add_nats_arguments,
    connect_kwargs,
    fatal_reason,
    options_from_args,
)
from eventlog.events import BlocksStored, ReplicaLost, RequestFinished, RequestRouted
from eventlog.names import Names
from natsops.natsconf import Identity, permissions, render

NAMES = Names("jr")
FLAGS = ["--nats-user", "r1", "--nats-password-file", "PW", "--nats-tls-ca", "CA",
         "--nats-tls-cert", "CERT", "--nats-tls-key", "KEY", "--nats-tls-hostname", "nats1",
         "--nats-tls-handshake-first"]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, text in (("PW", "s3cret\n"), ("CA", "ca"), ("CERT", "c"), ("KEY", "k"),
                       ("TOKEN", "tok\n"), ("SEED", "SU..."), ("CREDS", "jwt")):
        (tmp_path / name).write_text(text)
        out[name] = str(tmp_path / name)
    return out


def _with(files: dict[str, str], argv: list[str]) -> list[str]:
    return [files.get(a, a) for a in argv]


REQUIRED = {"bridge": ["--engine-url", "http://e:8000", "--kv-events", "tcp://e:5557",
                       "--worker-id", "w1"]}


@pytest.mark.parametrize("verb", ["serve", "worker", "up", "bridge"])
def test_every_process_verb_takes_the_nats_flags(verb: str, files: dict[str, str]) -> None:
    argv = [verb, *REQUIRED.get(verb, []), *_with(files, FLAGS)]
    args = build_parser([verb]).parse_args(argv)
    options = options_from_args(args, url="tls://a:4222,tls://b:4222", environ={})
    assert options.user == "r1" and options.password_file == files["PW"]
    assert (options.tls_ca, options.tls_cert, options.tls_key) == (files["CA"], files["CERT"],
                                                                  files["KEY"])
    assert options.tls_hostname == "nats1" and options.tls_handshake_first
    assert options.servers == ("tls://a:4222", "tls://b:4222") and options.uses_tls


def test_secrets_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETROUTER_NATS_USER", "w1")
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    args = build_parser(["worker"]).parse_args(["worker"])
    options = options_from_args(args, environ={})
    assert (options.user, options.password) == ("w1", "from-env")
    assert "from-env" not in repr(options)  # never logged by accident


def test_a_child_gets_files_in_argv_and_literal_secrets_in_its_environment(
        files: dict[str, str]) -> None:
    parent = NatsOptions(servers=("nats://x:4222",), user="r1", password="pw",
                         tls_ca=files["CA"], token=None)
    argv, env = parent.child_argv(), parent.child_env()
    assert "pw" not in " ".join(argv) and env == {PASSWORD_ENV: "pw"}
    p = argparse.ArgumentParser()  # what snapshots/projector.py builds
    p.add_argument("--nats-url")
    add_nats_arguments(p)
    child = options_from_args(p.parse_args(["--nats-url", "nats://x:4222", *argv]), environ=env)
    assert child == parent


def test_connect_kwargs_read_the_files(files: dict[str, str]) -> None:
    kw = connect_kwargs(NatsOptions(servers=("nats://x:1",), user="u",
                                    password_file=files["PW"], token_file=files["TOKEN"]))
    assert (kw["user"], kw["password"], kw["token"]) == ("u", "s3cret", "tok")
    kw = connect_kwargs(NatsOptions(creds_file=files["CREDS"], nkey_seed_file=files["SEED"]))
    assert (kw["user_credentials"], kw["nkeys_seed"]) == (files["CREDS"], files["SEED"])
    assert kw["servers"] == ["nats://127.0.0.1:4222"] and "tls" not in kw


@pytest.mark.parametrize(("fields", "message"), [
    ({"tls_cert": "c"}, "--nats-tls-cert and --nats-tls-key go together"),
    ({"password": "p"}, "--nats-password needs --nats-user"),
    ({"user": "u", "password": "p", "password_file": "f"}, "not both"),
    ({"token": "t", "token_file": "f"}, "not both"),
])
def test_impossible_options_are_refused(fields: dict[str, str], message: str) -> None:
    with pytest.raises(NatsOptionsInvalid, match=message):
        NatsOptions(**fields)


def test_a_missing_file_is_one_line_and_exit_2(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["serve", "--nats-user", "r1", "--nats-password-file", str(missing),
                 "--data-dir", str(tmp_path / "d")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"jetrouter serve: error: --nats-password-file {missing}: no such readable "
                   "file"]


def test_fatal_errors_name_their_cause() -> None:
    user = NatsOptions(user="r1", password_file="/p")
    auth = fatal_reason(nats.errors.Error("nats: 'Authorization Violation'"), user, "tls://h:1")
    assert auth == ("NATS authorization violation connecting to tls://h:1: check --nats-user "
                    "(r1) and --nats-password-file")
    nobody = fatal_reason(nats.errors.AuthorizationError(), NatsOptions(), "nats://h:1")
    assert nobody is not None and "the server wants credentials" in nobody
    cert = ssl.SSLCertVerificationError(1, "certificate verify failed")
    assert "check --nats-tls-ca" in (fatal_reason(cert, user, "tls://h:1") or "")
    # What a retry can cure is not fatal.
    assert fatal_reason(ConnectionRefusedError(111, "refused"), user, "nats://h:1") is None
    assert fatal_reason(TimeoutError(), user, "nats://h:1") is None


# --- server permissions --------------------------------------------------------------------


def test_an_engine_may_publish_only_its_own_subjects() -> None:
    perms = permissions("engine", "w1", NAMES)
    assert perms is not None
    app = [s for s in perms.publish if not s.startswith("$JS.API")]
    assert app == ["jr.kv.w1", "jr.load.w1"]
    assert set(perms.publish) - set(app) == {"$JS.API.INFO", "$JS.API.STREAM.INFO.JR_KV",
                                             "$JS.API.STREAM.MSG.GET.JR_KV"}
    assert not any("*" in s or ">" in s for s in perms.publish)
    assert set(perms.subscribe) == {"_INBOX.>", "jr.reannounce.w1", "jr.reannounce.all"}


def test_a_replica_touches_only_jetrouter_streams_and_never_deletes() -> None:
    perms = permissions("replica", "r1", NAMES)
    assert perms is not None
    api = [s for s in perms.publish if s.startswith("$JS.API.STREAM.")]
    streams = {"JR_KV", "JR_ROUTER", "JR_CONTROL", "KV_jr-replicas", "KV_jr-leases",
               "OBJ_jr-snapshots"}
    assert {s.rsplit(".", 1)[1] for s in api} <= streams
    assert not any(".DELETE." in s and ".STREAM." in s for s in perms.publish)
    assert permissions("admin", "", NAMES) is None  # unrestricted


def test_render_quotes_literals_and_keeps_variable_references() -> None:
    text = render([Identity("admin", "admin", password="$PW_ADMIN"),
                   Identity("w1", "engine", "w1", password='pa"ss')])
    assert "password: $PW_ADMIN\n" in text and 'password: "pa\\"ss"' in text
    assert '"$JS.API.STREAM.INFO.JR_KV"' in text  # `$` quoted: not a variable
    with pytest.raises(ValueError, match="twice"):
        render([Identity("w1", "engine", "w1", password="a"),
                Identity("w1", "engine", "w1", password="b")])
    with pytest.raises(ValueError, match="exactly one"):
        Identity("w1", "engine", "w1")
    with pytest.raises(ValueError, match="must match"):
        Identity("w.1", "engine", "w.1", password="x")


# --- events bound to their subject ------------------------------------------------------------


def test_events_must_speak_for_their_subject() -> None:
    stored = BlocksStored("w0", 1, 0, None, [(1, 2)], 1.0)
    assert binding.foreign_party("jr.kv.w0", [stored]) is None
    assert binding.foreign_party("jr.kv.w1", [stored]) == "w0"
    routed = RequestRouted("q", "r2", "w0", 0, 16, [1], 0, 8, 0, 1.0)
    assert binding.foreign_party("jr.router.r2", [routed, RequestFinished("q", "ok", 1, 1.0)]) \
        is None
    assert binding.foreign_party("jr.router.r1", [routed]) == "r2"
    assert binding.foreign_party("jr.router.r1", [ReplicaLost("r3", 1.0)]) == "r3"
    assert binding.foreign_party("jr.control.thresholds", [stored]) is None
