"""The HAProxy configuration in front of the replicas: its bind ports and backend servers, and what
in it would break failover or streaming (checks, retries, timeouts, buffering)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class HAProxyConfig:
    bind_ports: list[int] = field(default_factory=list)
    servers: list[tuple[str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _haproxy_seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    if m is None:
        return 0.0
    unit = {"us": 1e-6, "ms": 1e-3, None: 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return int(m.group(1)) * unit[m.group(2)]


# 200 ready, 404 alive but not taking new requests (api/app.py): a balancer drains on 404 and
# can then cut the sessions of a replica that does not answer at all.
BALANCER_CHECK = "/ready/balancer"


def parse_haproxy(text: str) -> HAProxyConfig:
    """Bind ports and backend servers of an HAProxy config, and what breaks the brief's needs:
    health check on /ready/balancer (a draining replica kept, a paused one cut), connect
    failures retried elsewhere, streams not held back."""
    cfg = HAProxyConfig()
    sections: list[tuple[str, list[list[str]]]] = []
    for raw in text.splitlines():
        words = re.split(r"(?:^|\s)#", raw, maxsplit=1)[0].split()
        if not words:
            continue
        if not raw[:1].isspace():
            sections.append((words[0], []))
        elif sections:
            sections[-1][1].append(words)
    defaults: list[list[str]] = []
    for kind, lines in sections:
        if kind == "defaults":
            defaults = lines
            continue
        if kind not in ("frontend", "backend", "listen"):
            continue
        for words in lines:
            if words[0] == "bind" and len(words) > 1:
                cfg.bind_ports.append(int(words[1].rpartition(":")[2]))
        servers = [w for w in lines if w[0] == "server" and len(w) > 2]
        if not servers:
            continue
        scope = defaults + lines          # a backend inherits the last defaults section
        # Directive -> its last occurrence ("option x" and "timeout x" keyed by their name).
        last = {" ".join(w[:2]) if w[0] in ("option", "timeout") else w[0]: w for w in scope}
        default_server = [w for w in scope if w[0] == "default-server"]
        for w in servers:
            host, _, port = w[2].rpartition(":")
            cfg.servers.append((host, int(port) if port.isdigit() else 0))
            if "check" not in w and not any("check" in d for d in default_server):
                cfg.problems.append(f"server {w[1]} is not health-checked (add `check`)")
        check = last.get("option httpchk", [])
        send = next((w for w in reversed(scope) if w[:2] == ["http-check", "send"]), [])
        uris = [x for x in check[2:] if x.startswith("/")]
        if "uri" in send:
            uris.append(send[send.index("uri") + 1])
        if not uris or uris[-1] != BALANCER_CHECK:
            cfg.problems.append(f"backend health check does not GET {BALANCER_CHECK} "
                                "(option httpchk)")
        elif not any(w[:2] == ["http-check", "disable-on-404"] for w in scope):
            cfg.problems.append("a draining or starting replica answers its check 404 and is "
                                "marked down: add `http-check disable-on-404`")
        retries = last.get("retries", ["retries", "3"])
        retry_on = last.get("retry-on", ["retry-on", "conn-failure"])
        if int(retries[1]) < 1 or "conn-failure" not in retry_on[1:]:
            cfg.problems.append("requests whose connection failed are not retried")
        if "option redispatch" not in last:
            cfg.problems.append("retries stay on the failed replica (add `option redispatch`)")
        if "empty-response" not in retry_on[1:]:
            cfg.problems.append("a request that reached a replica as it died fails (add "
                                "`empty-response` to retry-on)")
        l7 = {"empty-response", "response-timeout"} & set(retry_on[1:]) or any(
            c.endswith("xx") or c.isdigit() for c in retry_on[1:])
        if l7 and "option http-buffer-request" not in last and not any(
                "wait-for-body" in w for w in scope):
            cfg.problems.append("retry-on beyond conn-failure never fires while request bodies "
                                "stream through: add `option http-buffer-request`")
        if l7 and not any(w[:2] == ["http-request", "disable-l7-retry"] for w in scope):
            cfg.problems.append("admin writes may be retried after reaching a replica (two "
                                "resets): add `http-request disable-l7-retry` for them")
        connect = _haproxy_seconds(last.get("timeout connect", ["timeout", "connect", "5s"])[2])
        if connect > 0.5:
            cfg.problems.append(f"`timeout connect` {connect:g} s holds requests to a vanished "
                                "replica that long (want <= 500ms)")
        for w in servers:
            words = [x for d in default_server for x in d[1:]] + w[3:]
            opts = {k: v for k, v in zip(words, [*words[1:], ""], strict=True)}
            inter = _haproxy_seconds(opts.get("inter", "2s"))
            fall = int(opts.get("fall", "3") or 3)
            if inter * fall > 1.5:
                cfg.problems.append(f"server {w[1]}: a dead replica stays in rotation "
                                    f"~{inter * fall:g} s (inter x fall; want <= 1.5 s)")
            # A paused replica accepts the check's connect and never answers: each failed check
            # costs inter + `timeout check` (inter alone when that is unset).
            check = last.get("timeout check")
            paused = (inter + (_haproxy_seconds(check[2]) if check else inter)) * fall
            if paused > 2.0:
                cfg.problems.append(f"server {w[1]}: a paused replica is marked down only after "
                                    f"~{paused:g} s ((inter + timeout check) x fall; want <= 2 s)")
            if opts.get("on-marked-down") != "shutdown-sessions":
                cfg.problems.append(f"server {w[1]}: requests on a paused replica hang until "
                                    "`timeout server`: add `on-marked-down shutdown-sessions`")
        server_timeout = last.get("timeout server", ["timeout", "server", "0"])
        if _haproxy_seconds(server_timeout[2]) < 60:
            cfg.problems.append("`timeout server` under 60 s cuts long streamed generations")
        if any(w[0] in ("compression", "filter") for w in scope):
            cfg.problems.append("compression/filters buffer streamed responses")
    return cfg
