"""Every check of a compose file, in the order they depend on each other, and the two questions
callers ask: what is wrong with it, and which variables must be set to start it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from cluster.checkconfig.compose import HEALTH_PATHS
from cluster.checkconfig.jetrouter_services import JetrouterChecks
from cluster.checkconfig.nats import NatsChecks
from cluster.checkconfig.stack import StackChecks


class ComposeChecker(JetrouterChecks, NatsChecks, StackChecks):
    def run(self) -> list[str]:
        if not self.load():
            return self.problems
        services = list(self.services.values())
        # Order matters: NATS ports first (jetrouter URLs refer to them), then every service's
        # listen ports (health checks, the balancer and Prometheus refer to those).
        for svc in services:
            if svc.kind == "nats":
                self.guarded(f"service {svc.name}", self.check_nats, svc)
        for svc in services:
            if svc.kind == "jetrouter":
                self.guarded(f"service {svc.name}", self.check_jetrouter, svc)
        self.guarded("nats", self.check_nats_cluster)
        for svc in services:
            if svc.verb in (*HEALTH_PATHS, "bridge") and svc.args is not None:
                self.guarded(f"service {svc.name}", self.check_nats_urls, svc)
                self.guarded(f"service {svc.name}", self.check_nats_security, svc)
            if svc.verb == "bridge" and svc.args is not None:
                self.guarded(f"service {svc.name}", self.check_bridge, svc)
        checks = {"haproxy": self.check_haproxy, "prometheus": self.check_prometheus,
                  "grafana": self.check_grafana}
        for svc in services:
            if svc.kind in checks:
                self.guarded(f"service {svc.name}", checks[svc.kind], svc)
        if not any(s.kind == "haproxy" for s in services):
            self.problem(self.path.name, "no HAProxy load balancer in front of the replicas")
        self.check_ids_and_block_sizes()
        self.check_image_builds()
        for svc in services:
            for check in (self.check_healthcheck, self.check_ports, self.check_volumes):
                self.guarded(f"service {svc.name}", check, svc)
        self.guarded("depends_on", self.check_depends_on)
        return self.problems


def check_compose(path: str | os.PathLike[str],
                  environ: Mapping[str, str] | None = None,
                  overrides: tuple[str | os.PathLike[str], ...] = ()) -> list[str]:
    """Problems found in the compose file and the deploy/ files it uses; empty = consistent.

    ``environ`` feeds ``${VAR}`` interpolation (default: none set, so defaults apply);
    ``overrides`` are further ``-f`` files merged over ``path`` (e.g. compose.secure.yaml).
    Raises :class:`YamlUnavailable` without PyYAML.
    """
    return ComposeChecker(Path(path).resolve(), environ or {},
                          tuple(Path(o).resolve() for o in overrides)).run()


def required_variables(path: str | os.PathLike[str]) -> list[str]:
    """The ``${VAR:?...}`` variables the file needs set to start (secrets without defaults)."""
    checker = ComposeChecker(Path(path).resolve(), {})
    checker.load()
    return sorted(checker.required)
