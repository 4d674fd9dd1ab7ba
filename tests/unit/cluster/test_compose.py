"""compose.yaml and deploy/ stay consistent (cluster/checkconfig/), since CI cannot run Docker.

The real files must check clean; each mutated copy must produce the one problem it plants. Every
mutation asserts its text is present first, so a test cannot pass by mutating nothing.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from cluster.checkconfig.checker import check_compose, required_variables
from cluster.checkconfig.cli import main
from cluster.checkconfig.dockerfile import dockerfile_copied, dockerfile_instructions
from cluster.checkconfig.haproxy import parse_haproxy
from cluster.checkconfig.nats import parse_nats_flags

pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A private copy of compose.yaml and deploy/ to mutate."""
    shutil.copy(ROOT / "compose.yaml", tmp_path / "compose.yaml")
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def mutate(root: Path, file: str, old: str, new: str, count: int = 1) -> None:
    path = root / file
    text = path.read_text()
    assert text.count(old) >= count, f"{old!r} not in {file}: update the test"
    path.write_text(text.replace(old, new, count))


def test_repository_compose_is_consistent() -> None:
    assert check_compose(ROOT / "compose.yaml") == []


def test_copy_is_consistent_before_mutation(copy: Path) -> None:
    assert check_compose(copy / "compose.yaml") == []


MUTATIONS = [
    pytest.param("compose.yaml", '"serve", "--replica-id", "r1"', '"serve", "--replica-idd", "r1"',
                 "service r1: `jetrouter serve --replica-idd r1",
                 id="typo-flag-in-replica-command"),
    pytest.param("compose.yaml", "127.0.0.1:8000/ready", "127.0.0.1:8001/ready",
                 "service r1: healthcheck probes port 8001, but r1 listens on [8000]",
                 id="wrong-healthcheck-port"),
    pytest.param("compose.yaml", "r3: {condition: service_started}",
                 "r4: {condition: service_started}",
                 "service lb: depends_on r4, which is not a service", id="missing-depends-on"),
    pytest.param("deploy/haproxy.cfg", "    server r3 r3:8000\n", "",
                 "deploy/haproxy.cfg: replica r3 is not a backend server",
                 id="lb-backend-missing"),
    pytest.param("deploy/haproxy.cfg", "server r2 r2:8000", "server r2 r2:9000",
                 "backend server r2:9000, but r2 listens on [8000]", id="lb-backend-wrong-port"),
    pytest.param("deploy/haproxy.cfg", "option httpchk GET /ready/balancer",
                 "option httpchk GET /ready",
                 "backend health check does not GET /ready/balancer", id="lb-checks-wrong-path"),
    pytest.param("deploy/haproxy.cfg", "    http-check disable-on-404\n", "",
                 "add `http-check disable-on-404`", id="lb-404-marks-down"),
    pytest.param("deploy/haproxy.cfg", " on-marked-down shutdown-sessions", "",
                 "server r2: requests on a paused replica hang until `timeout server`",
                 id="lb-paused-replica-sessions-kept"),
    pytest.param("deploy/haproxy.cfg", "timeout check 500ms", "timeout check 2s",
                 "server r3: a paused replica is marked down only after ~4.5 s",
                 id="lb-slow-check-timeout"),
    pytest.param("deploy/haproxy.cfg", "    option redispatch 1\n", "",
                 "retries stay on the failed replica", id="lb-no-redispatch"),
    pytest.param("compose.yaml", "nats2: {condition: service_healthy}",
                 "nats2: {condition: service_healty}",
                 "depends_on nats2: unknown condition 'service_healty'", id="bad-condition"),
    pytest.param("compose.yaml", '"--port", "8000",\n              "--nats-url"',
                 '"--port", 8000,\n              "--nats-url"',
                 "service r1: command items [8000] are not strings", id="unquoted-number"),
    pytest.param("compose.yaml", "JETROUTER_LOG_LEVEL: info", "JETROUTER_LOG_LEVEL: loud",
                 "JETROUTER_LOG_LEVEL='loud': not one of", id="bad-env-value"),
    pytest.param("compose.yaml", "JETROUTER_LOG_LEVEL: info", "JETROUTER_LOGLEVEL: info",
                 "environment JETROUTER_LOGLEVEL matches no `jetrouter serve` flag",
                 id="unknown-env-var"),
    pytest.param("compose.yaml", '"--advertise-url", "http://w2:8100"',
                 '"--advertise-url", "http://w1:8100"',
                 "service w2: --advertise-url 'http://w1:8100' should be http://w2:8100",
                 id="worker-advertises-wrong-host"),
    pytest.param("compose.yaml", '"--routes", "nats://nats1:6222,nats://nats3:6222"',
                 '"--routes", "nats://nats1:6222"',
                 "service nats2: --routes miss ['nats3']", id="nats-route-missing"),
    pytest.param("compose.yaml", '"--server_name", "nats3", "--port"',
                 '"--server_name", "nats3", "--prot"',
                 "service nats3: nats-server has no flag --prot", id="nats-flag-typo"),
    pytest.param("compose.yaml", '"--nats-url", *nats-urls]\n  w2',
                 '"--nats-url", "nats://nats9:4222"]\n  w2',
                 "service w1: --nats-url nats://nats9:4222 names no NATS service",
                 id="nats-url-unknown-host"),
    pytest.param("compose.yaml", "x-nats-urls:", "name: jetrouter\nx-nats-urls:",
                 "compose.yaml: top-level `name:` makes docker-compose 1.29",
                 id="project-name-key"),
    pytest.param("compose.yaml", '    network_mode: "service:r2-net"\n', "",
                 "service r2: behind the balancer its address dies with its container",
                 id="replica-owns-its-address"),
    pytest.param("compose.yaml", "aliases: [r3]", "aliases: [router3]",
                 "service r3-net: r3 runs in its network, but no alias r3 points there",
                 id="replica-anchor-without-alias"),
    pytest.param("compose.yaml", 'network_mode: "service:r1-net"', 'network_mode: "service:r9-net"',
                 "service r1: network_mode service:r9-net: no such service",
                 id="replica-anchor-missing"),
    pytest.param("compose.yaml", "  r1-data:\n", "",
                 "service r1: volume r1-data is not declared", id="volume-undeclared"),
    pytest.param("compose.yaml", "image: nats:2.10-alpine", "image: nats:2.10",
                 "nats:2.10 is FROM scratch: no shell or wget", id="nats-scratch-healthcheck"),
    pytest.param("deploy/prometheus.yml", ', "w4:8100"', "",
                 "deploy/prometheus.yml: w4 is not scraped", id="prometheus-misses-worker"),
    pytest.param("deploy/Dockerfile", 'ENTRYPOINT ["jetrouter"]', 'ENTRYPOINT ["python"]',
                 "deploy/Dockerfile: ENTRYPOINT is ['python'], want [\"jetrouter\"]",
                 id="dockerfile-entrypoint"),
    pytest.param("deploy/Dockerfile", "USER jetrouter\n", "",
                 "deploy/Dockerfile: the image runs as root", id="dockerfile-root"),
    pytest.param("deploy/Dockerfile", "COPY cluster cluster\n", "",
                 "deploy/Dockerfile: packages cluster of pyproject.toml are not copied",
                 id="dockerfile-misses-a-package"),
    pytest.param("deploy/grafana/dashboards/jetrouter.json", "jetrouter_stream_lag",
                 "jetrouter_stream_lagg", "no metric jetrouter_stream_lagg",
                 id="dashboard-unknown-metric"),
    pytest.param("deploy/grafana/provisioning/datasources/prometheus.yml",
                 "http://prometheus:9090", "http://prometheus:9091",
                 "datasource url http://prometheus:9091 is not the prometheus service",
                 id="grafana-datasource-port"),
    # --- one build, no default secrets, a balancer that drops a dead replica fast ------------
    pytest.param("compose.yaml", "  image: jetrouter:local\n",
                 "  image: jetrouter:local\n  build: {context: ., dockerfile: deploy/Dockerfile}\n",
                 "services r1, r2, r3, w1, w2, w3, w4, vllm1-bridge, vllm-prefill-bridge, "
                 "vllm-decode-bridge all build 'jetrouter:local'",
                 id="every-service-builds-the-image"),
    pytest.param("compose.yaml", '"service:r2-net"\n    pull_policy: never\n', '"service:r2-net"\n',
                 "service r2: runs 'jetrouter:local', built by r1, without `pull_policy: never`",
                 id="image-user-would-pull"),
    pytest.param("compose.yaml",
                 '"${JETROUTER_ADMIN_TOKEN:?set JETROUTER_ADMIN_TOKEN to a long random string}"',
                 '"${JETROUTER_ADMIN_TOKEN:-change-me}"',
                 "service r1: the admin token has a fixed or default value",
                 id="admin-token-default"),
    pytest.param("compose.yaml", 'GF_AUTH_BASIC_ENABLED: "false"',
                 'GF_SECURITY_ADMIN_PASSWORD: "${GRAFANA_ADMIN_PASSWORD:-admin}"',
                 "service grafana: Grafana's admin password has a default",
                 id="grafana-default-password"),
    pytest.param("deploy/haproxy.cfg", "timeout connect 200ms", "timeout connect 2s",
                 "`timeout connect` 2 s holds requests to a vanished replica",
                 id="lb-slow-connect-timeout"),
    pytest.param("deploy/haproxy.cfg", "check inter 250ms fall 2", "check inter 2s fall 2",
                 "server r1: a dead replica stays in rotation ~4 s", id="lb-slow-health-check"),
    pytest.param("deploy/haproxy.cfg", "retry-on conn-failure empty-response response-timeout",
                 "retry-on conn-failure",
                 "a request that reached a replica as it died fails", id="lb-no-empty-response"),
    pytest.param("deploy/haproxy.cfg", "    option http-buffer-request\n", "",
                 "retry-on beyond conn-failure never fires while request bodies stream",
                 id="lb-retries-without-buffered-body"),
    pytest.param("deploy/haproxy.cfg", "    http-request disable-l7-retry", "    #",
                 "admin writes may be retried after reaching a replica",
                 id="lb-retries-admin-writes"),
    pytest.param("compose.yaml", '"--block-size", "16", "--nats-url"',
                 '"--block-size", "32", "--nats-url"',
                 "service vllm1-bridge: --block-size 32, but vllm1 runs --block-size 16",
                 id="bridge-block-size-differs-from-engine"),
    pytest.param("compose.yaml", '"tcp://vllm1:5557"', '"tcp://vllm1:5559"',
                 "service vllm1-bridge: --kv-events port 5559, but vllm1 binds tcp://*:5557",
                 id="bridge-kv-events-wrong-port"),
    pytest.param("compose.yaml", '"--enable-prefix-caching", ', "",
                 "service vllm1: no --enable-prefix-caching", id="engine-without-prefix-cache"),
    # --- the vllm-pd profile: vLLM's hand-off needs a KV connector and a reachable NIXL ------
    pytest.param("compose.yaml", ',\n              "--kv-transfer-config", \'{"kv_connector": '
                 '"NixlConnector", "kv_role": "kv_both"}\']', "]",
                 "service vllm-prefill: registered as prefill but no --kv-transfer-config",
                 id="pd-engine-without-kv-connector"),
    pytest.param("compose.yaml", "      VLLM_NIXL_SIDE_CHANNEL_HOST: vllm-decode\n", "",
                 "service vllm-decode: VLLM_NIXL_SIDE_CHANNEL_HOST is unset (localhost)",
                 id="pd-engine-nixl-host-unset"),
    pytest.param("compose.yaml", 'VLLM_NIXL_SIDE_CHANNEL_PORT: "5601"',
                 'VLLM_NIXL_SIDE_CHANNEL_PORT: "5600"',
                 "service vllm-decode: VLLM_NIXL_SIDE_CHANNEL_PORT 5600 is also vllm-prefill's",
                 id="pd-engines-share-a-nixl-port"),
]


@pytest.mark.parametrize(("file", "old", "new", "expected"), MUTATIONS)
def test_mutation_is_reported(copy: Path, file: str, old: str, new: str, expected: str) -> None:
    mutate(copy, file, old, new)
    problems = check_compose(copy / "compose.yaml")
    assert any(expected in p for p in problems), problems


def test_rejected_command_lines_do_not_show_the_admin_token(copy: Path) -> None:
    mutate(copy, "compose.yaml", '"serve", "--replica-id", "r1"', '"serve", "--bogus", "r1"')
    mutate(copy, "compose.yaml", '"--nats-url", *nats-urls, "--data-dir", "/data"]\n    volumes: '
           '["r1-data', '"--nats-url", *nats-urls, "--data-dir", "/data", "--admin-token", '
           '"${JETROUTER_ADMIN_TOKEN:?}"]\n    volumes: ["r1-data')
    problems = check_compose(copy / "compose.yaml", environ={"JETROUTER_ADMIN_TOKEN": "s3cret"})
    assert any("--admin-token *** ` is rejected" in p or "--admin-token ***` is rejected" in p
               for p in problems), problems
    assert not any("s3cret" in p for p in problems), problems


def test_several_problems_are_all_reported(copy: Path) -> None:
    mutate(copy, "compose.yaml", "127.0.0.1:8100/health", "127.0.0.1:8100/ready")
    mutate(copy, "compose.yaml", '"--host", "0.0.0.0", "--port", "8000"',
           '"--host", "127.0.0.1", "--port", "8000"')
    problems = check_compose(copy / "compose.yaml")
    assert sum("healthcheck probes /ready, want /health" in p for p in problems) == 4, problems
    assert any("service r1: --host 127.0.0.1 is unreachable" in p for p in problems), problems


def test_interpolation_uses_defaults_and_reports_required_variables(copy: Path) -> None:
    # `${VAR:?msg}` is a secret the user must give to start the stack: not a problem here,
    # listed by required_variables(); a bare `${VAR}` unset is a mistake.
    assert required_variables(copy / "compose.yaml") == ["JETROUTER_ADMIN_TOKEN"]
    mutate(copy, "compose.yaml", "JETROUTER_LOG_LEVEL: info", "JETROUTER_LOG_LEVEL: ${LEVEL}")
    problems = check_compose(copy / "compose.yaml")
    assert any("variable LEVEL is not set and has no default" in p for p in problems), problems
    assert check_compose(copy / "compose.yaml", environ={"LEVEL": "info"}) == []


def test_host_jetrouter_environment_does_not_leak(copy: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The check sees the container's environment, not the shell that runs it.
    monkeypatch.setenv("JETROUTER_ROUTER_MODE", "bogus")
    assert check_compose(copy / "compose.yaml") == []


def test_dependency_cycle_is_reported(copy: Path) -> None:
    mutate(copy, "compose.yaml", '    profiles: ["observability"]\n    restart: unless-stopped\n'
           '    volumes:\n      - "./deploy/prometheus.yml',
           '    profiles: ["observability"]\n    depends_on: [grafana]\n'
           '    restart: unless-stopped\n    volumes:\n      - "./deploy/prometheus.yml')
    problems = check_compose(copy / "compose.yaml")
    assert any("cycle prometheus -> grafana -> prometheus" in p for p in problems), problems


def test_profiled_dependency_of_a_default_service_is_reported(copy: Path) -> None:
    mutate(copy, "compose.yaml", "      r3: {condition: service_started}",
           "      r3: {condition: service_started}\n      prometheus: {condition: service_started}")
    problems = check_compose(copy / "compose.yaml")
    assert any("service lb: depends_on prometheus, which only runs in profiles" in p
               for p in problems), problems


def test_malformed_value_is_a_problem_not_a_crash(copy: Path) -> None:
    mutate(copy, "compose.yaml", 'ports: ["8080:8080"]', 'ports: ["8080:http"]')
    problems = check_compose(copy / "compose.yaml")
    assert any(p.startswith("service lb: could not be checked (ValueError") for p in problems), \
        problems


def test_main_exit_status(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(copy / "compose.yaml")]) == 0
    mutate(copy, "deploy/haproxy.cfg", "    server r1 r1:8000\n", "")
    assert main([str(copy / "compose.yaml")]) == 1
    assert "replica r1 is not a backend server" in capsys.readouterr().out


def test_main_skips_without_yaml(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` now raises ImportError
    assert main([str(ROOT / "compose.yaml")]) == 0
    assert "skipped, PyYAML is not installed" in capsys.readouterr().out


def test_dockerfile_instructions_read_the_last_stage() -> None:
    text = ('FROM a AS build\nENTRYPOINT ["x"]\nUSER builder\nFROM b\n'
            'RUN apt-get update \\\n && true\nUSER app:app\nENTRYPOINT ["jetrouter"]\n'
            "CMD serve --port 1\n")
    assert dockerfile_instructions(text) == {"USER": ["app"], "ENTRYPOINT": ["jetrouter"],
                                             "CMD": ["/bin/sh", "-c", "serve --port 1"]}


def test_dockerfile_copied_reads_context_sources_of_every_stage() -> None:
    text = ("FROM a AS build\nCOPY pyproject.toml README.md ./\nCOPY --chown=1:1 api/ api\n"
            'ADD ["workers", "/src/workers"]\nFROM b\nCOPY --from=build /wheels /tmp\n'
            "COPY ./cluster \\\n  /src/cluster\n")
    assert dockerfile_copied(text) == {"pyproject.toml", "README.md", "api", "workers",
                                       "cluster"}


def test_dockerignore_is_read_by_both_builders_and_keeps_environments_out() -> None:
    """deploy/Dockerfile builds with the repository as its context. `<Dockerfile>.dockerignore`
    is read by BuildKit only (and wins over .dockerignore there); the classic builder (Docker
    20.10, docker-compose 1.29) reads .dockerignore alone, and without it sends .venv and
    .venv-vllm (hundreds of MB to GB) on every `up --build`."""
    assert not (ROOT / "deploy" / "Dockerfile.dockerignore").exists()
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".venv-*", ".jetrouter", "tests"} <= ignored


def test_nats_flags() -> None:
    flags, unknown = parse_nats_flags(["-js", "--store_dir=/data", "-p", "4223", "--bogus"])
    assert flags == {"jetstream": True, "store_dir": "/data", "port": "4223"}
    assert unknown == ["--bogus"]


def test_haproxy_defaults_are_inherited_and_overridden() -> None:
    cfg = parse_haproxy(
        "defaults\n    timeout server 30s\n    retries 3\n    option redispatch\n"
        "    timeout connect 100ms\n    retry-on conn-failure empty-response\n"
        "    option http-buffer-request\n"
        "    http-request disable-l7-retry if METH_POST\n"
        "frontend f\n    bind *:9000  # comment\n    default_backend b\n"
        "backend b\n    timeout server 5m\n    compression algo gzip\n"
        "    option httpchk\n    http-check send meth GET uri /ready/balancer\n"
        "    http-check disable-on-404\n    timeout check 200ms\n"
        "    default-server inter 250ms fall 2 on-marked-down shutdown-sessions\n"
        "    server a a:1 check\n    server c c:2\n")
    assert cfg.bind_ports == [9000]
    assert cfg.servers == [("a", 1), ("c", 2)]
    assert cfg.problems == ["server c is not health-checked (add `check`)",
                            "compression/filters buffer streamed responses"]


# --- the image installs only pyproject's runtime dependencies ----------------------------------

PACKAGES = ("errors", "settings", "eventlog", "tokenization", "natsops", "replicas", "snapshots",
            "api", "workers", "leanhttp")


def _required_imports(path: Path) -> set[str]:
    """Top-level third-party modules a file imports, minus those guarded by `except ImportError`
    (optional ones, like PyYAML in cluster/checkconfig/compose.py)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                               "ModuleNotFoundError")
                for h in node.handlers):
            optional.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}


def _runtime_distributions() -> set[str]:
    """pyproject's [project].dependencies and everything they require (with their extras)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(d) for d in deps]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in map(Requirement, requires):
            extras = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if spec.marker is None or any(spec.marker.evaluate(env) for env in extras):
                todo.append(spec)
    return seen


def test_image_runtime_imports_are_declared_dependencies() -> None:
    """deploy/Dockerfile runs `pip install` of the wheel: an import satisfied only by the dev
    venv (or by hand-installed packages) would crash every container at start."""
    provided = _runtime_distributions()
    owners = metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module in _required_imports(path):
                if not {canonicalize_name(d) for d in owners.get(module, [])} & provided:
                    missing.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported but not in pyproject [project].dependencies: {missing}"


# --- compose.secure.yaml: NATS with TLS, users and permissions (an override file) -------------

def test_secured_override_is_consistent(copy: Path) -> None:
    shutil.copy(ROOT / "compose.secure.yaml", copy / "compose.secure.yaml")
    assert check_compose(copy / "compose.yaml", overrides=(copy / "compose.secure.yaml",)) == []


SECURE_MUTATIONS = [
    pytest.param('"--nats-user", "w2"', '"--nats-user", "w1"',
                 "service w2: NATS user w1 lacks the worker permissions (no .kv.w2",
                 id="engine-runs-as-another-engine"),
    pytest.param('"--nats-user", "r3"', '"--nats-user", "r9"',
                 "service r3: --nats-user r9 is not a user in deploy/nats/jetrouter.conf",
                 id="unknown-user"),
    pytest.param("    secrets: [{source: w4-nats-password, target: nats-password}, nats-ca.pem]\n",
                 "", "service w4: --nats-password-file /run/secrets/nats-password is not mounted",
                 id="password-file-not-mounted"),
    pytest.param("  w4-nats-password: {file: ./deploy/nats/secrets/users/w4.password}\n", "",
                 "service w4: secret w4-nats-password is not declared", id="undeclared-secret"),
    pytest.param('"--nats-tls-ca", "/run/secrets/nats-ca.pem"]\n    secrets: [{source: r1',
                 ']\n    secrets: [{source: r1',
                 "service r1: deploy/nats/jetrouter.conf turns TLS on: give --nats-tls-ca",
                 id="tls-without-ca"),
    pytest.param('"--nats-url", *nats-urls, "--data-dir", "/data", "--nats-user", "r2",\n'
                 '              "--nats-password-file", "/run/secrets/nats-password",\n',
                 '"--nats-url", *nats-urls, "--data-dir", "/data",\n',
                 "service r2: deploy/nats/jetrouter.conf requires credentials",
                 id="no-credentials"),
]


@pytest.mark.parametrize(("old", "new", "expected"), SECURE_MUTATIONS)
def test_secured_override_mutation_is_reported(copy: Path, old: str, new: str,
                                               expected: str) -> None:
    shutil.copy(ROOT / "compose.secure.yaml", copy / "compose.secure.yaml")
    mutate(copy, "compose.secure.yaml", old, new)
    problems = check_compose(copy / "compose.yaml", overrides=(copy / "compose.secure.yaml",))
    assert any(expected in p for p in problems), problems


def test_committed_nats_config_is_the_rendered_one() -> None:
    from natsops.secure import compose_config

    assert (ROOT / "deploy" / "nats" / "jetrouter.conf").read_text() == compose_config(), \
        "deploy/nats/jetrouter.conf drifted from natsops/secure.py compose_config(): re-render it"
