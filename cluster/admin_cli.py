"""`jetrouter admin`: the admin API's command-line client (design.md §9-§10).

    jetrouter admin [--url URL] [--token TOKEN] [--cluster-file PATH] [--json] VERB [ARGS]

Verbs: ``state``, ``snapshot``, ``snapshots``, ``reset [--yes]``, ``threshold [N]``, ``tenants``,
``keys``, ``replicas``, ``workers``, ``request REQUEST_ID``, and ``export FILE`` / ``import FILE``
(a backup of the streams and the newest snapshot, through NATS itself: cluster/backup.py). With no
``--url``/``--token`` the client reads ``.jetrouter/cluster.json`` (written by `jetrouter up`):
the replicas' URLs, tried in order (the next one on a connection error), and its
``admin_token``. Output is readable tables and lines, or
the API's raw JSON with ``--json``. Exit status: 0 done; 1 the API answered an error (its status
and message are printed) or no replica could be reached; 2 a usage or configuration problem.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from api.cli import CliError
from cluster import backup
from errors.root import JetrouterError

DEFAULT_CLUSTER_FILE = Path(".jetrouter") / "cluster.json"
DEFAULT_TIMEOUT_S = 30.0  # a snapshot of a large state is taken while the request waits
EXIT_API_ERROR = 1
EXIT_USAGE = 2

# RequestRouted.candidates rows are tuples (eventlog.events.CandidateRow); name their fields.
CANDIDATE_FIELDS = ("worker_id", "dp_rank", "overlap_blocks", "prefill_blocks", "decode_blocks",
                    "cost", "busy")


Show = Callable[[Any], str]


class AdminRequestFailed(JetrouterError):
    """The admin API answered with an error status, or no replica could be reached."""


# -- where to send requests ------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    urls: list[str]  # base URLs, tried in order while connections are refused
    token: str
    hint: str = ""  # said when no URL answers (e.g. cluster.json says the cluster stopped)


def _with_scheme(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else "http://" + url


def load_cluster_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CliError(f"cannot read cluster file {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CliError(f"cluster file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CliError(f"cluster file {path} is not a JSON object")
    return data


def cluster_urls(cluster: dict[str, Any]) -> list[str]:
    """The replicas' URLs, those with a live pid first (a dead one is only a last resort)."""
    entries = [r for r in cluster.get("replicas") or [] if isinstance(r, dict) and r.get("url")]
    entries.sort(key=lambda r: r.get("pid") is None)  # stable: keeps cluster.json's order
    return [_with_scheme(str(r["url"])) for r in entries]


def resolve_target(url: str | None, token: str | None, cluster_file: Path | None) -> Target:
    """--url/--token (or their env vars) win; cluster.json fills in whatever is missing."""
    path = cluster_file if cluster_file is not None else DEFAULT_CLUSTER_FILE
    cluster: dict[str, Any] | None = None
    if path.exists():
        cluster = load_cluster_file(path)
    elif cluster_file is not None:
        raise CliError(f"cluster file {path} not found")
    if url:
        urls = [_with_scheme(url)]
    elif cluster is not None:
        urls = cluster_urls(cluster)
        if not urls:
            raise CliError(f"cluster file {path} lists no replicas; pass --url URL")
    else:
        raise CliError(f"no cluster file at {path} and no --url: start a cluster with "
                       "`jetrouter up`, or pass --url URL (or set JETROUTER_URL)")
    token = token or (str(cluster["admin_token"]) if cluster and cluster.get("admin_token")
                      else None)
    if not token:
        where = f" and {path} has no admin_token" if cluster is not None else ""
        raise CliError(f"no admin token{where}: pass --token TOKEN "
                       "(or set JETROUTER_ADMIN_TOKEN)")
    hint = ""
    if not url and cluster is not None and cluster.get("state") == "stopped":
        hint = f"{path} says the cluster is stopped; start it with `jetrouter up`"
    return Target(urls=urls, token=token, hint=hint)


# -- talking to the API ----------------------------------------------------------------------


def api_message(response: httpx.Response) -> str:
    """The human message of an error answer: OpenAI's shape, the flat 503 shape, or raw text."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    text = response.text.strip().replace("\n", " ")
    return text[:200] if text else response.reason_phrase or "error"


class AdminClient:
    """Synchronous admin API client over a list of replica URLs."""

    def __init__(self, target: Target, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.target = target
        self._http = httpx.Client(timeout=timeout,
                                  headers={"authorization": f"Bearer {target.token}"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, path: str, body: object = None) -> Any:
        """The decoded JSON answer; AdminRequestFailed on an error status or when nobody answers.

        Falls back to the next URL only when the connection could not be made: the request
        was then never sent, so even a POST (snapshot, reset) cannot run twice.
        """
        refused: list[str] = []
        for base in self.target.urls:
            url = base + path
            try:
                response = self._http.request(method, url, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                refused.append(f"{base} ({exc or type(exc).__name__})")
                continue
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
                raise CliError(f"bad URL {base!r}: {exc}") from exc
            except httpx.TimeoutException as exc:
                raise AdminRequestFailed(
                    f"no answer from {url} within the timeout ({type(exc).__name__}); "
                    "raise it with --timeout") from exc
            except httpx.TransportError as exc:
                raise AdminRequestFailed(
                    f"{method} {url} failed: {exc or type(exc).__name__}") from exc
            if response.status_code >= 400:
                raise AdminRequestFailed(f"{response.status_code}: {api_message(response)} "
                                         f"({method} {url})")
            try:
                return response.json()
            except ValueError as exc:
                raise AdminRequestFailed(f"{method} {url} answered {response.status_code} with a "
                                         "body that is not JSON") from exc
        hint = f" ({self.target.hint})" if self.target.hint else ""
        raise AdminRequestFailed("cannot reach any replica: " + "; ".join(refused) + hint)


# -- readable output -------------------------------------------------------------------------


def _is_time(key: str, value: float) -> bool:
    # Event times are epoch seconds (events.py); anything after 2001 under a time-like name.
    return (key == "ts" or key.endswith(("_ts", "_at", "_time"))) and value > 1e9


def _is_bytes(key: str) -> bool:
    return key == "size" or key.endswith(("_size", "_bytes"))


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cell(value: Any, key: str = "") -> str:
    """One value as short text: yes/no, trimmed floats, UTC times, k=v maps, comma lists."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and _is_bytes(key):
        return _human_bytes(value)
    if isinstance(value, float):
        if _is_time(key, value):
            stamp = dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
            return stamp[:-3] + " UTC"
        if key.endswith("_s"):
            return f"{value:.1f}s"
        if value != 0 and abs(value) < 0.001:
            return f"{value:.2e}"
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if isinstance(value, dict):
        if all(not isinstance(v, (dict, list)) for v in value.values()):
            return " ".join(f"{k}={cell(v, str(k))}" for k, v in value.items()) or "-"
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            return ", ".join(cell(v, key) for v in value) or "-"
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def render_mapping(data: dict[str, Any], first: Sequence[str] = (),
                   skip: Sequence[str] = ()) -> str:
    """Aligned `key  value` lines, the keys in `first` first, then the rest as they came."""
    keys = [k for k in first if k in data] + [k for k in data if k not in first]
    keys = [k for k in keys if k not in skip]
    if not keys:
        return ""
    width = max(len(k) for k in keys)
    lines = []
    for k in keys:
        value = data[k]
        if isinstance(value, dict) and value and any(isinstance(v, (dict, list))
                                                     for v in value.values()):
            # A nested record (e.g. the snapshot a reset took): its own block, indented.
            lines.append(k)
            lines += ["  " + line for line in render_mapping(value).splitlines()]
        else:
            lines.append(f"{k.ljust(width)}  {cell(value, k)}")
    return "\n".join(lines)


def _numeric(values: list[Any]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                 for v in present)


def _short(text: str, key: str) -> str:
    """A table shows a checksum's first 12 hex digits (the mapping view shows all of it)."""
    return text[:12] if key == "sha256" and len(text) > 12 else text


def render_table(rows: list[dict[str, Any]], first: Sequence[str], only: bool = False) -> str:
    """A text table: the columns in `first` that any row has, then (unless `only`) the rows'
    other scalar columns, so fields the API gains later still show."""
    columns = [k for k in first if any(k in r for r in rows)]
    for row in [] if only else rows:
        columns += [k for k, v in row.items()
                    if k not in columns and not isinstance(v, (dict, list))]
    text = [[_short(cell(r.get(k), k), k) for k in columns] for r in rows]
    widths = [max([len(k)] + [len(t[i]) for t in text]) for i, k in enumerate(columns)]
    right = [_numeric([r.get(k) for r in rows]) for k in columns]

    def line(parts: Sequence[str]) -> str:
        return "  ".join(p.rjust(w) if r else p.ljust(w)
                         for p, w, r in zip(parts, widths, right, strict=True)).rstrip()

    return "\n".join([line(columns)] + [line(t) for t in text])


def _listed(data: Any, key: str) -> list[dict[str, Any]]:
    items = data.get(key, []) if isinstance(data, dict) else data
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def show_state(data: dict[str, Any]) -> str:
    return render_mapping(data, first=("replica_id", "ready", "leader", "epoch", "positions",
                                       "digests", "lag", "snapshot_threshold"))


def show_snapshot(data: dict[str, Any]) -> str:
    head = f"snapshot {data.get('snapshot_id', '?')} taken"
    return head + "\n" + render_mapping(data, first=("snapshot_id", "positions", "size",
                                                     "sha256"))


def show_reset(data: dict[str, Any]) -> str:
    return f"reset done: epoch is now {data.get('epoch', '?')}\n" + render_mapping(
        data, skip=("epoch",))


def show_threshold(data: dict[str, Any]) -> str:
    return f"snapshot threshold: {cell(data.get('threshold'))}"


def show_threshold_set(data: dict[str, Any]) -> str:
    return f"snapshot threshold set to {cell(data.get('threshold'))}"


def show_list(key: str, columns: Sequence[str], empty: str) -> Show:
    """A renderer for the `{key: [row, ...]}` answers: a table, or `empty` when no rows."""
    def show(data: Any) -> str:
        rows = _listed(data, key)
        return render_table(rows, columns) if rows else empty
    return show


show_snapshots = show_list("snapshots", ("snapshot_id", "ts", "size", "positions", "created_by",
                                         "trigger", "sha256"), "no snapshots")
show_replicas = show_list("replicas", ("replica_id", "version", "formats", "ready", "leader",
                                       "epoch", "age_s", "divergent", "positions", "digests"),
                          "no replicas")
show_workers = show_list("workers", ("worker_id", "url", "model", "health", "dp_size",
                                     "kv_total_blocks", "cached_blocks", "active_prefill_tokens",
                                     "active_decode_blocks", "out_of_sync", "status", "reason"),
                         "no workers registered")
show_sessions = show_list("sessions", ("session_id", "worker_id", "dp_rank", "model", "ttl_s",
                                       "expires_in_s", "requests", "engine_usable"),
                          "no sticky sessions")


def show_tenants(data: Any) -> str:
    """``GET /admin/tenants`` (a list) or one tenant's answer, usage flattened into columns."""
    rows = _listed(data, "tenants") if "tenants" in data else [data]
    flat = [{**{k: v for k, v in r.items() if k != "usage"}, **r.get("usage", {})}
            for r in rows]
    return render_table(flat, ("tenant", "configured", "requests_per_minute",
                               "tokens_per_minute", "max_concurrent", "weight", "isolated",
                               "api_keys",
                               "requests_last_minute", "tokens_last_minute", "concurrent")
                        ) if flat else "no tenants"


def _tenant_request(args: argparse.Namespace) -> tuple[str, str, object, Show]:
    """`tenants` (list), `tenants ID`, `tenants set ID --rpm ...`, `tenants delete ID`."""
    action, tenant = args.tenant_action, args.tenant
    if action in ("set", "delete") and not tenant:
        raise CliError(f"`tenants {action}` needs a tenant id")
    if action == "set":
        body = {"requests_per_minute": args.rpm, "tokens_per_minute": args.tpm,
                "max_concurrent": args.max_concurrent, "weight": args.weight,
                "isolated": args.isolated}
        return "PUT", "/admin/tenants/" + quote(tenant, safe=""), body, show_tenants
    if action == "delete":
        return "DELETE", "/admin/tenants/" + quote(tenant, safe=""), None, \
            lambda d: f"tenant {d.get('tenant')} deleted"
    if action not in (None, "show", "list"):  # `tenants ID`: the id in the action's place
        tenant = action
    if tenant:
        return "GET", "/admin/tenants/" + quote(tenant, safe=""), None, show_tenants
    return "GET", "/admin/tenants", None, show_tenants


def _key_request(args: argparse.Namespace) -> tuple[str, str, object, Show]:
    """`keys ID` (list), `keys add ID [--key K]`, `keys revoke KEY_ID`."""
    action, target = args.key_action, args.key_target
    if action in ("add", "revoke") and not target:
        raise CliError(f"`keys {action}` needs a {'tenant id' if action == 'add' else 'key id'}")
    if action == "add":
        return "POST", f"/admin/tenants/{quote(target, safe='')}/keys", \
            ({"key": args.key} if args.key else {}), \
            lambda d: (f"tenant {d['tenant']}: new API key {d['key']} (key id {d['key_id']}); "
                       "it is shown only this once")
    if action == "revoke":
        return "DELETE", "/admin/api-keys/" + quote(target, safe=""), None, \
            lambda d: f"API key {d['key_id']} of tenant {d['tenant']} revoked"
    tenant = target or action
    if not tenant:
        raise CliError("`keys` needs a tenant id: `keys ID`, `keys add ID` or `keys revoke "
                       "KEY_ID`")
    return "GET", f"/admin/tenants/{quote(tenant, safe='')}/keys", None, \
        lambda d: render_table(d["keys"], ("key_id",)) if d["keys"] else \
        f"tenant {d['tenant']} has no API keys set through the admin API"


def candidate_rows(decision: dict[str, Any]) -> list[dict[str, Any]]:
    """Every candidate as a dict, cheapest first, the chosen one marked with `*`."""
    rows: list[dict[str, Any]] = []
    for c in decision.get("candidates") or []:
        row = dict(zip(CANDIDATE_FIELDS, c, strict=False)) if isinstance(c, list) else dict(c)
        if "worker" in row and "worker_id" not in row:  # the ledger's key name
            row = {"worker_id": row.pop("worker"), **row}
        chosen = (row.get("worker_id") == decision.get("worker_id")
                  and row.get("dp_rank", 0) == decision.get("dp_rank", 0))
        rows.append({"": "*" if chosen else "", **row})
    rows.sort(key=lambda r: (r.get("cost") is None, r.get("cost") or 0.0))
    return rows


def _after(data: dict[str, Any], key: str) -> str | None:
    start, end = data.get("routed_ts"), data.get(key)
    if isinstance(start, (int, float)) and isinstance(end, (int, float)):
        return f"{end - start:.3f}s after routing"
    return None


def show_request(data: dict[str, Any]) -> str:
    shown = dict(data)
    for key in ("prefill_ts", "finished_ts", "lost_ts"):
        if _after(data, key):
            shown[key.removesuffix("_ts") + "_after"] = _after(data, key)
    head = render_mapping(shown, first=("request_id", "replica_id", "worker_id", "dp_rank",
                                        "model", "isl_tokens", "overlap_blocks",
                                        "predicted_tokens", "cached_tokens", "outcome",
                                        "output_tokens", "routed_ts", "prefill_after",
                                        "finished_after"),
                          skip=("candidates", "hops"))
    parts = [head]
    hops = _listed(data, "hops")
    if len(hops) > 1:  # migrated or disaggregated: every hop of it, the prefill hop first
        parts.append(f"hops ({len(hops)}):\n" + render_table(
            hops, ("hop", "phase", "request_id", "worker_id", "dp_rank", "predicted_tokens",
                   "cached_tokens", "outcome", "routed_ts"),
            only=True))
    for hop in hops:  # a disaggregated request: the prefill decision's cost terms too
        if hop.get("phase") == "prefill" and hop.get("request_id") != data.get("request_id"):
            pre = candidate_rows(hop)
            parts.append(f"prefill candidates ({len(pre)}, * = chosen):\n"
                         + render_table(pre, ("", *CANDIDATE_FIELDS)))
    rows = candidate_rows(data)
    if rows:
        parts.append(f"candidates ({len(rows)}, * = chosen):\n"
                     + render_table(rows, ("", *CANDIDATE_FIELDS)))
    else:
        parts.append("candidates: none recorded")
    return "\n".join(parts)


# -- the verb --------------------------------------------------------------------------------


def confirm_reset(target: Target, stdin: Any = None, stderr: Any = None) -> bool:
    """Ask on a terminal; refuse outright (CliError) when there is nobody to ask."""
    stdin = stdin if stdin is not None else sys.stdin
    stderr = stderr if stderr is not None else sys.stderr
    if stdin is None or not stdin.isatty():
        raise CliError("refusing to reset without --yes: stdin is not a terminal to confirm on")
    stderr.write(f"Reset the routing state of the whole cluster behind {target.urls[0]}?\n"
                 "Every replica clears its state, snapshots are deleted, engines re-announce.\n"
                 "Type 'yes' to continue: ")
    stderr.flush()
    answer = stdin.readline()
    return answer.strip().lower() in ("y", "yes")


THRESHOLD_PATH = "/admin/snapshot-threshold"
# verb -> (HTTP method, path, readable renderer); `threshold N` and `request ID` are built apart.
ROUTES: dict[str, tuple[str, str, Show]] = {
    "state": ("GET", "/admin/state", show_state),
    "snapshot": ("POST", "/admin/snapshot", show_snapshot),
    "snapshots": ("GET", "/admin/snapshots", show_snapshots),
    "reset": ("POST", "/admin/reset", show_reset),
    "threshold": ("GET", THRESHOLD_PATH, show_threshold),
    "replicas": ("GET", "/admin/replicas", show_replicas),
    "workers": ("GET", "/admin/workers", show_workers),
    "sessions": ("GET", "/admin/sessions", show_sessions),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--url", default=None,
                   help="a replica's base URL (default: the replicas in the cluster file)")
    p.add_argument("--token", "--admin-token", dest="token", default=None,
                   help="admin bearer token (default: admin_token in the cluster file)")
    p.add_argument("--cluster-file", type=Path, default=None,
                   help=f"cluster description written by `jetrouter up` "
                        f"(default {DEFAULT_CLUSTER_FILE})")
    p.add_argument("--json", action="store_true", help="print the API's raw JSON")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for an answer (default {DEFAULT_TIMEOUT_S:g})")
    sub = p.add_subparsers(dest="admin_verb", metavar="VERB")
    sub.required = True
    sub.add_parser("state", help="this replica: epoch, positions, digests, lag, leader...")
    sub.add_parser("snapshot", help="take a snapshot now (the leader takes it)")
    sub.add_parser("snapshots", help="list the stored snapshots, newest first")
    r = sub.add_parser("reset", help="clear the routing state of every replica (epoch + 1)")
    r.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    t = sub.add_parser("threshold", help="show the snapshot threshold, or set it to N")
    t.add_argument("threshold", nargs="?", type=_positive_int, metavar="N",
                   help="messages appended between snapshots")
    sub.add_parser("replicas", help="every replica's positions, digests, leader, divergence")
    sub.add_parser("workers", help="the registered engines and their load")
    sub.add_parser("sessions", help="sticky sessions: the engine each is pinned to, its TTL")
    q = sub.add_parser("request", help="one routing decision with every candidate's costs")
    q.add_argument("request_id", metavar="REQUEST_ID")
    tn = sub.add_parser("tenants", help="tenants' limits and usage; `tenants set ID --rpm N "
                                        "...` sets one's limits, `tenants delete ID` drops them")
    tn.add_argument("tenant_action", nargs="?", metavar="set|delete|ID")
    tn.add_argument("tenant", nargs="?", metavar="ID")
    tn.add_argument("--rpm", type=_positive_int, help="requests per minute (default: no limit)")
    tn.add_argument("--tpm", type=_positive_int, help="tokens per minute (prompt + max_tokens)")
    tn.add_argument("--max-concurrent", type=_positive_int, help="requests in flight at once")
    tn.add_argument("--weight", type=float, default=1.0, help="share under fair queueing")
    tn.add_argument("--isolated", action="store_true",
                    help="keep its prompts' KV cache apart from other tenants' (cache_salt)")
    ky = sub.add_parser("keys", help="tenants' API keys: `keys ID` lists one's, `keys add ID` "
                                     "draws one (shown once), `keys revoke KEY_ID`")
    ky.add_argument("key_action", nargs="?", metavar="add|revoke|ID")
    ky.add_argument("key_target", nargs="?", metavar="ID|KEY_ID")
    ky.add_argument("--key", help="`keys add`: bring over this existing key instead of drawing one")
    backup.add_verbs(sub)
    # `--json` is also accepted after the verb (`jetrouter admin state --json`).
    for child in sub.choices.values():
        child.add_argument("--json", dest="json_after", action="store_true",
                           help="print the API's raw JSON")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _request(args: argparse.Namespace, target: Target) -> tuple[str, str, object, Show]:
    """(HTTP method, path, JSON body, renderer) for the verb in `args`."""
    verb = args.admin_verb
    if verb == "reset" and not args.yes and not confirm_reset(target):
        raise AdminRequestFailed("reset cancelled")
    if verb == "threshold" and args.threshold is not None:
        return "PUT", THRESHOLD_PATH, {"threshold": args.threshold}, show_threshold_set
    if verb == "tenants":
        return _tenant_request(args)
    if verb == "keys":
        return _key_request(args)
    if verb == "request":
        return "GET", "/admin/requests/" + quote(args.request_id, safe=""), None, show_request
    method, path, show = ROUTES[verb]
    return method, path, None, show


def run(args: argparse.Namespace) -> int:
    if args.admin_verb in ("export", "import"):  # NATS itself, not a replica's admin API
        try:
            path = args.cluster_file or DEFAULT_CLUSTER_FILE
            cluster = load_cluster_file(path) if path.exists() else None
        except CliError as exc:
            print(f"jetrouter admin: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return backup.run_verb(args, cluster)
    try:
        target = resolve_target(args.url, args.token, args.cluster_file)
        with AdminClient(target, timeout=args.timeout) as client:
            method, path, body, show = _request(args, target)
            data = client.call(method, path, body)
    except AdminRequestFailed as exc:
        print(f"jetrouter admin: error: {exc}", file=sys.stderr)
        return EXIT_API_ERROR
    except CliError as exc:
        # Reported here rather than by the frame: under `python -m api.cli` the frame runs as
        # __main__, whose CliError is a different class from the api.cli.CliError raised here.
        print(f"jetrouter admin: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    as_json = bool(args.json or getattr(args, "json_after", False))
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        print(show(data) if isinstance(data, (dict, list)) else cell(data))
    return 0
