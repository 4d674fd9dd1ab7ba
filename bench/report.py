"""Aggregate a trace run into figures; print a table (or two runs side by side); save JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.client import FAILED, OK, REJECTED, RunResult
from bench.ideal import IdealHitRate


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100), linear interpolation between closest ranks; None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be in 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _dist(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in qs}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def summarize(run: RunResult, *, ideal: Mapping[str, IdealHitRate] | None = None,
              workload: Mapping[str, Any] | None = None,
              num_workers: int | None = None) -> dict[str, Any]:
    """Every figure of one run as plain JSON-able data."""
    records = run.records
    ok = [r for r in records if r.outcome == OK]
    counts = Counter(r.outcome for r in records)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    with_usage = [r for r in ok if r.prompt_tokens and r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    cached_tokens = sum(r.cached_tokens or 0 for r in with_usage)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = run.duration_s
    per_worker = Counter(r.worker for r in ok if r.worker)
    # Workers that got nothing still count in the mean when the fleet size is known.
    fleet = max(num_workers or 0, len(per_worker))
    mean_load = sum(per_worker.values()) / fleet if fleet else 0.0
    errors = Counter((r.error or r.outcome) for r in records if r.outcome != OK)
    # Prediction vs reality, per request: the router's predicted reuse (header) against the
    # engine's own cached_tokens (usage).
    pairs = [(r.predicted_tokens, r.cached_tokens, r.prompt_tokens or 0) for r in ok
             if r.predicted_tokens is not None and r.cached_tokens is not None]
    errors_abs = [abs(p - c) for p, c, _ in pairs]
    paired_prompt = sum(n for _, _, n in pairs)
    return {
        "label": run.label,
        "model": run.model,
        "urls": run.urls,
        "extra": dict(run.extra),
        "requests": {"total": len(records), "ok": counts[OK], "failed": counts[FAILED],
                     "rejected": counts[REJECTED],
                     "failovers": sum(r.failovers for r in records)},
        "ttft_s": _dist(ttft, (50, 90, 99)),
        "itl_s": _dist(itl, (50, 90)),
        "e2e_s": _dist(e2e, (50, 99)),
        "queued_s": _dist([r.queued_s for r in records], (50, 99)),
        "throughput": {"duration_s": duration,
                       "req_per_s": len(ok) / duration if duration > 0 else None,
                       "output_tok_per_s": output_tokens / duration if duration > 0 else None,
                       "output_tokens": output_tokens},
        "prefix_hit": {"engine_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
                       "cached_tokens": cached_tokens, "prompt_tokens": prompt_tokens,
                       "requests_with_usage": len(with_usage)},
        "prediction": {
            "requests": len(pairs),
            "mean_abs_error_tokens": sum(errors_abs) / len(pairs) if pairs else None,
            "exact_share": sum(1 for e in errors_abs if e == 0) / len(pairs) if pairs else None,
            "predicted_rate": sum(p for p, _, _ in pairs) / paired_prompt if paired_prompt
            else None,
            "mean_error_tokens": sum(p - c for p, c, _ in pairs) / len(pairs) if pairs else None,
        },
        "ideal": {k: v.to_json() for k, v in (ideal or {}).items()},
        "workers": {"requests": dict(sorted(per_worker.items())), "fleet_size": fleet,
                    "max_over_mean": max(per_worker.values()) / mean_load if mean_load else None},
        "errors": dict(errors.most_common(5)),
        "workload": dict(workload or {}),
        "options": {k: v for k, v in asdict(run.options).items()},
    }


def _get(summary: Mapping[str, Any], path: str) -> Any:
    value: Any = summary
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _ms(v: float) -> str:
    return f"{v * 1000:.1f} ms"


def _pct(v: float) -> str:
    return f"{v * 100:.1f}%"


def _num(v: float) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


# (row title, path into the summary, formatter)
ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("requests", "requests.total", _num),
    ("ok", "requests.ok", _num),
    ("rejected (503)", "requests.rejected", _num),
    ("failed", "requests.failed", _num),
    ("failovers", "requests.failovers", _num),
    ("TTFT p50", "ttft_s.p50", _ms),
    ("TTFT p90", "ttft_s.p90", _ms),
    ("TTFT p99", "ttft_s.p99", _ms),
    ("ITL p50", "itl_s.p50", _ms),
    ("ITL p90", "itl_s.p90", _ms),
    ("e2e p50", "e2e_s.p50", _ms),
    ("e2e p99", "e2e_s.p99", _ms),
    ("client queue p99", "queued_s.p99", _ms),
    ("duration", "throughput.duration_s", lambda v: f"{v:.1f} s"),
    ("throughput req/s", "throughput.req_per_s", _num),
    ("output tok/s", "throughput.output_tok_per_s", _num),
    ("prefix hit (engine)", "prefix_hit.engine_rate", _pct),
    ("predicted hit (router)", "prediction.predicted_rate", _pct),
    ("prediction |error| mean", "prediction.mean_abs_error_tokens", lambda v: f"{v:.1f} tok"),
    ("predicted exactly", "prediction.exact_share", _pct),
    ("ideal hit (fleet LRU)", "ideal.finite.block_rate", _pct),
    ("ideal hit (infinite)", "ideal.infinite.block_rate", _pct),
    ("worker max/mean", "workers.max_over_mean", _num),
]


def _cell(summary: Mapping[str, Any], path: str, fmt: Callable[[Any], str]) -> str:
    value = _get(summary, path)
    return "-" if value is None else fmt(value)


def _render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(header, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def format_table(summary: Mapping[str, Any]) -> str:
    rows = [[title, _cell(summary, path, fmt)] for title, path, fmt in ROWS]
    workers = _get(summary, "workers.requests") or {}
    rows += [[f"  requests on {w}", str(n)] for w, n in workers.items()]
    return _render(["metric", str(summary.get("label", "run"))], rows)


def format_comparison(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """Two runs side by side, with the ratio b/a for every numeric row."""
    rows = []
    for title, path, fmt in ROWS:
        va, vb = _get(a, path), _get(b, path)
        ratio = f"{vb / va:.2f}x" if isinstance(va, int | float) and isinstance(
            vb, int | float) and va else "-"
        rows.append([title, _cell(a, path, fmt), _cell(b, path, fmt), ratio])
    la, lb = str(a.get("label", "a")), str(b.get("label", "b"))
    return _render(["metric", la, lb, f"{lb}/{la}"], rows)


def format_workload(workload: Mapping[str, Any]) -> str:
    parts = []
    for key, value in workload.items():
        if isinstance(value, Mapping):
            inner = ", ".join(f"{k}={_num(v)}" for k, v in value.items())
            parts.append(f"{key}: {inner}")
        else:
            parts.append(f"{key}: {_num(value) if isinstance(value, float) else value}")
    return "workload\n" + "\n".join("  " + part for part in parts)


def comparison_ratios(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for _title, path, _fmt in ROWS:
        va, vb = _get(a, path), _get(b, path)
        ok = isinstance(va, int | float) and isinstance(vb, int | float) and va
        out[path] = vb / va if ok else None
    return out


def write_json(path: Path | str, summaries: Sequence[Mapping[str, Any]],
               workload: Mapping[str, Any] | None = None) -> None:
    payload: dict[str, Any] = {"workload": dict(workload or {}), "runs": list(summaries)}
    if len(summaries) == 2:
        payload["ratios"] = {"of": f"{summaries[1]['label']}/{summaries[0]['label']}",
                             **comparison_ratios(summaries[0], summaries[1])}
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


# Per-request fields written by ``write_requests``; inter-token gaps are left out (a
# 128-token answer would make each line ~2 kB) and summarised by the report instead.
REQUEST_FIELDS = ("index", "outcome", "status", "scheduled_s", "queued_s", "ttft_s", "e2e_s",
                  "output_tokens", "sent_prompt_tokens", "prompt_tokens", "cached_tokens",
                  "predicted_tokens", "worker", "replica", "url", "failovers", "error")


def write_requests(path: Path | str, runs: Sequence[RunResult]) -> int:
    """Every request of every run as one JSON line (``run`` is the run's label), in arrival
    order: which requests made a tail, and where they went. Returns the number of lines."""
    lines = []
    for run in runs:
        for record in sorted(run.records, key=lambda r: r.index):
            row = {"run": run.label}
            row.update((name, getattr(record, name)) for name in REQUEST_FIELDS)
            lines.append(json.dumps(row))
    Path(path).write_text("".join(line + "\n" for line in lines))
    return len(lines)
