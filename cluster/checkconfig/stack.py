"""Checks across the services of a compose file: health checks, published ports, ``depends_on``,
volumes, image builds, the HAProxy balancer in front of the replicas, Prometheus' targets and
Grafana's datasources and dashboards."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

from cluster.checkconfig.compose import HEALTH_PATHS, ComposeFile, Service, load_yaml
from cluster.checkconfig.haproxy import HAProxyConfig, parse_haproxy

DEPENDS_CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0")
# Metrics the dashboard may show before api/metrics.py exports them (the lead adds them).
PENDING_METRICS: set[str] = set()  # metrics the dashboard may name before they are exported
_URL = re.compile(r"https?://(\[[^\]]+\]|[\w.\-]+)(?::(\d+))?(/[^\s'\"]*)?")


class StackChecks(ComposeFile):
    def check_healthcheck(self, svc: Service) -> None:
        where = f"service {svc.name}"
        hc = svc.spec.get("healthcheck") or {}
        test = hc.get("test")
        if hc.get("disable") or not test or test == ["NONE"]:
            # A bridge listens on no port; its restart policy is what keeps it there.
            if svc.kind in ("nats", "jetrouter") and svc.verb != "bridge":
                self.problem(where, "no healthcheck")
            return
        words = shlex.split(test) if isinstance(test, str) else [str(t) for t in test]
        if words[0] in ("CMD", "CMD-SHELL"):
            words = words[1:] if words[0] == "CMD" else shlex.split(" ".join(words[1:]))
        elif not isinstance(test, str):
            self.problem(where, f"healthcheck test must start with CMD or CMD-SHELL: {test}")
        if svc.kind == "jetrouter" and Path(words[0]).name not in ("python", "python3",
                                                                   "jetrouter"):
            self.problem(where, f"healthcheck runs {words[0]!r}, which python:3.11-slim lacks")
        for m in _URL.finditer(" ".join(words)):
            host, port, path = m.group(1), int(m.group(2) or 80), m.group(3) or "/"
            if host not in LOCAL_HOSTS:
                self.problem(where, f"healthcheck probes {host}, not the container itself")
            if svc.ports is not None and port not in svc.ports:
                self.problem(where, f"healthcheck probes port {port}, but {svc.name} listens "
                             f"on {sorted(svc.ports)}")
            want = HEALTH_PATHS.get(svc.verb or "")
            if want and path.split("?")[0] != want:
                self.problem(where, f"healthcheck probes {path}, want {want}")
        if svc.kind in ("nats", "jetrouter") and svc.spec.get("restart") in (None, "no"):
            self.problem(where, "no restart policy")

    def check_ports(self, svc: Service) -> None:
        for p in svc.spec.get("ports") or []:
            target = p.get("target") if isinstance(p, dict) else str(p).split(":")[-1]
            port = int(str(target).split("/")[0].split("-")[0])
            if svc.ports is not None and port not in svc.ports:
                self.problem(f"service {svc.name}", f"publishes container port {port}, but "
                             f"it listens on {sorted(svc.ports)}")

    def check_depends_on(self) -> None:
        graph: dict[str, list[str]] = {}
        for svc in self.services.values():
            deps = svc.spec.get("depends_on") or {}
            if isinstance(deps, list):
                deps = {d: {"condition": "service_started"} for d in deps}
            graph[svc.name] = list(deps)
            for dep, opts in deps.items():
                where = f"service {svc.name}"
                target = self.services.get(dep)
                cond = (opts or {}).get("condition", "service_started")
                if target is None:
                    self.problem(where, f"depends_on {dep}, which is not a service")
                    continue
                if cond not in DEPENDS_CONDITIONS:
                    self.problem(where, f"depends_on {dep}: unknown condition {cond!r}")
                if cond == "service_healthy" and not (target.spec.get("healthcheck") or {}).get(
                        "test"):
                    self.problem(where, f"depends_on {dep} being healthy, but it has no "
                                 "healthcheck")
                if target.spec.get("profiles") and not svc.spec.get("profiles"):
                    self.problem(where, f"depends_on {dep}, which only runs in profiles "
                                 f"{target.spec['profiles']}")
        state: dict[str, int] = {}

        def visit(n: str, trail: list[str]) -> None:
            if state.get(n) == 1:
                self.problem("depends_on", f"cycle {' -> '.join([*trail, n])}")
            if state.get(n):
                return
            state[n] = 1
            for d in graph.get(n, []):
                visit(d, [*trail, n])
            state[n] = 2
        for n in graph:
            visit(n, [])

    def check_volumes(self, svc: Service) -> None:
        declared = self.doc.get("volumes") or {}
        for source, _target in svc.mounts():
            if not source:
                continue
            if source.startswith((".", "/", "~")):
                if source.startswith(".") and not (self.root / source).exists():
                    self.problem(f"service {svc.name}", f"bind mount {source} does not exist")
            elif source not in declared:
                self.problem(f"service {svc.name}", f"volume {source} is not declared under "
                             "top-level `volumes:`")

    def check_image_builds(self) -> None:
        """One build per image: several services building one tag run parallel builds that each
        produce an image id, and a later plain `up -d` recreates every service whose id changed.
        Services using an image another service builds must not pull it (no registry has it)."""
        builders: dict[str, list[str]] = {}
        for svc in self.services.values():
            if "build" in svc.spec:
                builders.setdefault(str(svc.spec.get("image", "")), []).append(svc.name)
        for image, names in builders.items():
            if len(names) > 1:
                self.problem(self.path.name, f"services {', '.join(names)} all build {image!r}: "
                             "let one build it and the others use `image:` only")
        for svc in self.services.values():
            image = str(svc.spec.get("image", ""))
            if "build" not in svc.spec and image in builders and svc.spec.get(
                    "pull_policy") not in ("never",):
                self.problem(f"service {svc.name}", f"runs {image!r}, built by "
                             f"{builders[image][0]}, without `pull_policy: never` (compose "
                             "would try to pull it)")

    def check_haproxy(self, svc: Service) -> None:
        path = self.mounted_file(svc, "haproxy.cfg")
        if path is None:
            return
        cfg: HAProxyConfig = parse_haproxy(path.read_text())
        svc.ports = set(cfg.bind_ports)
        where = self.rel(path)
        for message in cfg.problems:
            self.problem(where, message)
        replicas = self.by_verb("serve")
        hosts = {host for host, _ in cfg.servers}
        for host in sorted(set(replicas) - hosts):
            self.problem(where, f"replica {host} is not a backend server")
        for host in sorted(hosts & set(replicas)):
            self.check_stable_address(replicas[host])
        for host, port in cfg.servers:
            if host not in replicas:
                self.problem(where, f"backend server {host} is not a replica service")
            elif replicas[host].ports is not None and port not in replicas[host].ports:
                self.problem(where, f"backend server {host}:{port}, but {host} listens on "
                             f"{sorted(replicas[host].ports or [])}")

    def check_stable_address(self, svc: Service) -> None:
        """A balanced replica's address must outlive its process. An address owned by the
        replica's container vanishes when that container exits: connects to it hang until
        `timeout connect`, and those still pending when HAProxy marks the replica down are cut
        by `on-marked-down shutdown-sessions` without a retry (measured: 2 of 304 requests,
        none of which had reached the replica). Joined to an always-running service's network,
        the address stays and a connect to a dead replica is refused at once, then retried."""
        where = f"service {svc.name}"
        mode = str(svc.spec.get("network_mode", ""))
        if not mode.startswith("service:"):
            self.problem(where, "behind the balancer its address dies with its container "
                         "(connects hang, then are cut without a retry): join the network of "
                         f"a service that only sleeps (`network_mode: service:{svc.name}-net`)")
            return
        anchor = self.services.get(mode.removeprefix("service:"))
        if anchor is None:
            self.problem(where, f"network_mode {mode}: no such service")
            return
        networks = anchor.spec.get("networks") or {}
        aliases = {str(a) for n in (networks.values() if isinstance(networks, dict) else [])
                   for a in ((n or {}).get("aliases") or [])}
        if svc.name not in aliases:
            self.problem(f"service {anchor.name}", f"{svc.name} runs in its network, but no "
                         f"alias {svc.name} points there: the balancer cannot resolve it")
        if anchor.spec.get("restart") in (None, "no"):
            self.problem(f"service {anchor.name}", "no restart policy")
        for key in ("ports", "networks"):
            if svc.spec.get(key):
                self.problem(where, f"`{key}` with network_mode {mode} (compose rejects it; "
                             f"put it on {anchor.name})")

    def check_prometheus(self, svc: Service) -> None:
        svc.ports = {9090}
        path = self.mounted_file(svc, "prometheus.yml")
        if path is None:
            return
        where = self.rel(path)
        doc = load_yaml(path) or {}
        targets: set[tuple[str, int]] = set()
        for job in doc.get("scrape_configs") or []:
            if job.get("metrics_path", "/metrics") != "/metrics":
                self.problem(where, f"job {job.get('job_name')} scrapes {job['metrics_path']}")
            for sc in job.get("static_configs") or []:
                for t in sc.get("targets") or []:
                    host, _, port = str(t).rpartition(":")
                    targets.add((host, int(port)))
        for host, port in sorted(targets):
            target = self.services.get(host)
            if target is None:
                self.problem(where, f"target {host}:{port} is not a service")
            elif target.ports is not None and port not in target.ports:
                self.problem(where, f"target {host}:{port}, but {host} listens on "
                             f"{sorted(target.ports)}")
        for s in [*self.by_verb("serve").values(), *self.by_verb("worker").values()]:
            if not any(h == s.name for h, _ in targets):
                self.problem(where, f"{s.name} is not scraped")

    def check_grafana(self, svc: Service) -> None:
        svc.ports = {3000}
        env = svc.spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
        password = env.get("GF_SECURITY_ADMIN_PASSWORD")
        no_login = (str(env.get("GF_AUTH_DISABLE_LOGIN_FORM", "")).lower() == "true"
                    and str(env.get("GF_AUTH_BASIC_ENABLED", "")).lower() == "false")
        if not no_login and (password is None or str(password) not in self.required.values()):
            self.problem(f"service {svc.name}", "Grafana's admin password has a default "
                         "(admin/admin when unset): disable the login (GF_AUTH_DISABLE_LOGIN_FORM"
                         ", GF_AUTH_BASIC_ENABLED=false) or require ${GRAFANA_ADMIN_PASSWORD:?}")
        prov = self.mounted_file(svc, "/etc/grafana/provisioning")
        if prov is None:
            return
        uids: set[str] = set()
        for f in sorted((prov / "datasources").glob("*.y*ml")):
            for ds in (load_yaml(f) or {}).get("datasources") or []:
                uids.add(str(ds.get("uid")))
                u = urlsplit(str(ds.get("url", "")))
                target = self.services.get(u.hostname or "")
                if target is None or target.kind != "prometheus" or u.port != 9090:
                    self.problem(self.rel(f), f"datasource url {ds.get('url')}"
                                 " is not the prometheus service on 9090")
        for f in sorted((prov / "dashboards").glob("*.y*ml")):
            for provider in (load_yaml(f) or {}).get("providers") or []:
                folder = (provider.get("options") or {}).get("path", "")
                host_dir = self.mounted_file(svc, folder)
                for dash in sorted(host_dir.glob("*.json")) if host_dir else []:
                    self.check_dashboard(dash, uids)

    def check_dashboard(self, path: Path, uids: set[str]) -> None:
        where = self.rel(path)
        try:
            panels = json.loads(path.read_text()).get("panels", [])
        except json.JSONDecodeError as exc:
            self.problem(where, f"not JSON: {exc}")
            return
        known = known_metric_names()
        for panel in panels:
            for t in panel.get("targets", []):
                uid = (t.get("datasource") or panel.get("datasource") or {}).get("uid")
                if uid not in uids:
                    self.problem(where, f"panel {panel.get('title')!r}: datasource {uid!r} "
                                 "is not provisioned")
                for name in set(re.findall(r"\bjetrouter_\w+", t.get("expr", ""))) - known:
                    self.problem(where, f"panel {panel.get('title')!r}: no metric {name}")


def known_metric_names() -> set[str]:
    """Every sample name the replicas and simulated workers export (plus PENDING_METRICS)."""
    from api.metrics import RouterMetrics
    from api.replica_metrics import families as replica_families
    # Imported by name like api.cli does: the checker reads the worker's metric names only.
    worker_metrics = importlib.import_module("workers.metrics")
    registries = [RouterMetrics().registry, worker_metrics.WorkerMetrics([], "check").registry]
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created")}
    names = set(PENDING_METRICS)
    # The replica's own figures are exported by a collector read at scrape time.
    for family in [f for r in registries for f in r.collect()] + replica_families():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names
