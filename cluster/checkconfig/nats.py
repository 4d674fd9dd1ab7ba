"""The NATS services of a compose file: nats-server's flags, JetStream on a volume, the cluster's
routes, and every jetrouter service's ``--nats-url``, credentials and TLS against the server
configuration it loads."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cluster.checkconfig.compose import ComposeFile, Service

# nats-server's flags (2.10), from `nats-server --help`; the boolean ones take no value.
_NATS_BOOL = {"-js": "jetstream", "--jetstream": "jetstream", "-T": "logtime",
              "--logtime": "logtime", "--logtime_utc": "logtime_utc", "-s": "syslog",
              "--syslog": "syslog", "--tls": "tls", "--tlsverify": "tlsverify",
              "--no_advertise": "no_advertise", "-t": "test", "-sl": "signal", "-D": "debug",
              "--debug": "debug", "-V": "trace", "--trace": "trace", "-VV": "trace",
              "-DV": "trace", "-DVV": "trace"}


_NATS_VALUE = {"-a": "addr", "--addr": "addr", "-p": "port", "--port": "port", "-n": "server_name",
               "--name": "server_name", "--server_name": "server_name", "-P": "pid", "--pid": "pid",
               "-m": "http_port", "--http_port": "http_port", "-ms": "https_port",
               "-c": "config", "--config": "config", "--client_advertise": "client_advertise",
               "--ports_file_dir": "ports_file_dir", "-l": "log", "--log": "log",
               "-r": "remote_syslog", "--remote_syslog": "remote_syslog",
               "--log_size_limit": "log_size_limit", "--max_traced_msg_len": "max_traced",
               "-sd": "store_dir", "--store_dir": "store_dir", "--user": "user", "--pass": "pass",
               "--auth": "auth", "--tlscert": "tlscert", "--tlskey": "tlskey",
               "--tlscacert": "tlscacert", "--routes": "routes", "--cluster": "cluster",
               "--cluster_name": "cluster_name", "--cluster_advertise": "cluster_advertise",
               "--connect_retries": "connect_retries", "--cluster_listen": "cluster_listen",
               "--profile": "profile"}


def parse_nats_flags(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """nats-server flags as {name: value or True}, and the flags nats-server does not know."""
    flags: dict[str, Any] = {}
    unknown: list[str] = []
    words = iter(argv)
    for word in words:
        flag, eq, value = word.partition("=")
        if flag in _NATS_BOOL:
            flags[_NATS_BOOL[flag]] = value.lower() != "false" if eq else True
        elif flag in _NATS_VALUE:
            flags[_NATS_VALUE[flag]] = value if eq else next(words, "")
        else:
            unknown.append(word)
    return flags, unknown


class NatsChecks(ComposeFile):
    def check_nats(self, svc: Service) -> None:
        where = f"service {svc.name}"
        svc.nats, unknown = parse_nats_flags(svc.argv)
        for flag in unknown:
            self.problem(where, f"nats-server has no flag {flag}")
        n = svc.nats
        cluster_port = urlsplit(n["cluster"]).port if n.get("cluster") else None
        svc.ports = {int(n.get("port", 4222))} | {int(p) for p in (n.get("http_port"),
                                                                   cluster_port) if p}
        if not n.get("jetstream"):
            self.problem(where, "JetStream is off: add --jetstream")
        store = n.get("store_dir")
        if not store or not any(store == t or store.startswith(t.rstrip("/") + "/")
                                for _, t in svc.mounts()):
            self.problem(where, f"JetStream store {store!r} is not on a volume")
        image = str(svc.spec.get("image", ""))
        test = (svc.spec.get("healthcheck") or {}).get("test")
        official = re.match(r"(docker\.io/)?(library/)?nats([:@]|$)", image)
        if test and official and "alpine" not in image:
            self.problem(where, f"{image} is FROM scratch: no shell or wget for the healthcheck "
                         "(use the -alpine variant)")

    def check_nats_cluster(self) -> None:
        nats = [s for s in self.services.values() if s.kind == "nats"]
        names = {s.name for s in nats}
        if len({s.nats.get("cluster_name") for s in nats}) > 1:
            self.problem("nats", "servers disagree on --cluster_name")
        if len({s.nats.get("server_name") or s.name for s in nats}) < len(nats):
            self.problem("nats", "--server_name values are not unique")
        for s in nats if len(nats) > 1 else []:
            where = f"service {s.name}"
            if not s.nats.get("cluster"):
                self.problem(where, "no --cluster listen URL in a multi-server cluster")
            routed: set[str] = set()
            for route in filter(None, str(s.nats.get("routes", "")).split(",")):
                u = urlsplit(route.strip())
                target = self.services.get(u.hostname or "")
                if target is None or target.kind != "nats":
                    self.problem(where, f"route {route} names no NATS service")
                    continue
                routed.add(target.name)
                tport = urlsplit(target.nats.get("cluster") or "").port
                if u.port != tport:
                    self.problem(where, f"route {route}: {target.name} listens for routes "
                                 f"on {tport}")
            missing = names - routed - {s.name}
            if missing:
                self.problem(where, f"--routes miss {sorted(missing)}")

    def nats_server_config(self) -> tuple[Path, str] | None:
        """The nats-server configuration file the NATS services load (`--config`), if any."""
        for svc in self.services.values():
            conf = svc.nats.get("config") if svc.kind == "nats" else None
            if not conf:
                continue
            for target, source in self.container_files(svc):
                if (conf == target or conf.startswith(target.rstrip("/") + "/")) and \
                        source.startswith("."):
                    path = self.root / source / os.path.relpath(conf, target)
                    if path.is_file():
                        return path, path.read_text()
            self.problem(f"service {svc.name}", f"--config {conf} is not a mounted file")
            return None
        return None

    def check_nats_security(self, svc: Service) -> None:
        """Credential/TLS files exist in the container; users and TLS match the server config."""
        where = f"service {svc.name}"
        args = svc.args
        files = self.container_files(svc)
        for flag in ("nats_creds", "nats_nkey", "nats_password_file", "nats_token_file",
                     "nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            path = getattr(args, flag, None)
            if path and not any(path == t or path.startswith(t.rstrip("/") + "/")
                                for t, _ in files):
                self.problem(where, f"--{flag.replace('_', '-')} {path} is not mounted into the "
                             "container (volume or secret)")
        found = self.nats_server_config()
        if found is None:
            return
        path, text = found
        blocks = dict(re.findall(r'user:\s*"([^"]+)"(.*?)(?=user:|nkey:|\Z)', text, re.S))
        user = getattr(args, "nats_user", None)
        if not (user or args.nats_creds or args.nats_nkey or args.nats_token_file):
            self.problem(where, f"{self.rel(path)} requires credentials; give --nats-user ...")
        elif user and user not in blocks:
            self.problem(where, f"--nats-user {user} is not a user in {self.rel(path)}")
        elif user and "permissions" in blocks[user]:
            own = (".router.*" if svc.verb == "serve"
                   else f".kv.{getattr(args, 'worker_id', '')}\"")
            if own not in blocks[user]:
                self.problem(where, f"NATS user {user} lacks the {svc.verb} permissions "
                             f"(no {own.strip(chr(34))} in {self.rel(path)})")
        if re.search(r"^tls\s*\{", text, re.M) and not args.nats_tls_ca:
            # Its certificate comes from a private CA, which no system trust store holds.
            self.problem(where, f"{self.rel(path)} turns TLS on: give --nats-tls-ca (and "
                         "tls:// URLs)")

    def check_nats_urls(self, svc: Service) -> None:
        url = getattr(svc.args, "nats_url", None)
        if not url:
            self.problem(f"service {svc.name}", "no --nats-url")
            return
        for one in url.split(","):
            u = urlsplit(one.strip())
            target = self.services.get(u.hostname or "")
            if target is None or target.kind != "nats":
                self.problem(f"service {svc.name}", f"--nats-url {one} names no NATS service")
            elif (u.port or 4222) != int(target.nats.get("port", 4222)):
                self.problem(f"service {svc.name}", f"--nats-url {one}: {target.name} listens "
                             f"for clients on {target.nats.get('port', 4222)}")
