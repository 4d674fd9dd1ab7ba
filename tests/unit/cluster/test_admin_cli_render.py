"""`jetrouter admin` output and error parsing, without a cluster (the cluster itself:
tests/integration/cluster/test_admin_cli.py)."""

from __future__ import annotations

from typing import Any

import httpx

from cluster import admin_cli

T0 = 1_790_000_000.0  # an event time (epoch seconds)


def _ledger_row(request_id: str, hop: int, worker: str, outcome: str) -> dict[str, Any]:
    """Shaped like GET /admin/requests/{id} (snapshots/ledger.py): dict candidates."""
    return {"request_id": request_id, "base_id": "r0-1", "hop": hop, "replica_id": "r0",
            "worker_id": worker, "dp_rank": 0, "model": "m", "isl_tokens": 64,
            "overlap_blocks": 3, "routed_ts": T0 + hop, "prefill_ts": T0 + hop + 0.25,
            "finished_ts": T0 + hop + 1.5, "outcome": outcome, "output_tokens": 8,
            "lost": False, "candidates": [
                {"worker_id": "w0", "dp_rank": 0, "overlap_blocks": 0, "prefill_blocks": 4.0,
                 "decode_blocks": 2.0, "cost": 6.0, "busy": False},
                {"worker_id": "w1", "dp_rank": 0, "overlap_blocks": 3, "prefill_blocks": 1.0,
                 "decode_blocks": 1.0, "cost": 2.0, "busy": False}]}


def test_candidates_from_tuples_are_named_sorted_and_the_chosen_one_marked() -> None:
    decision = {"request_id": "r0-1", "worker_id": "w1", "dp_rank": 0, "candidates": [
        ["w0", 0, 0, 10.0, 2.0, 12.0, False], ["w1", 0, 8, 2.0, 1.0, 3.0, True]]}
    rows = admin_cli.candidate_rows(decision)
    assert [(r[""], r["worker_id"], r["cost"]) for r in rows] == [("*", "w1", 3.0),
                                                                   ("", "w0", 12.0)]
    table = admin_cli.show_request(decision).split("chosen):\n", 1)[1].splitlines()
    assert table[0].split() == list(admin_cli.CANDIDATE_FIELDS)
    assert table[1].split() == ["*", "w1", "0", "8", "2", "1", "3", "yes"]
    assert table[2].split() == ["w0", "0", "0", "10", "2", "12", "no"]


def test_a_ledger_decision_shows_timings_hops_and_candidates() -> None:
    row = {**_ledger_row("r0-1.1", 1, "w1", "ok"),
           "hops": [_ledger_row("r0-1", 0, "w0", "migrated"), _ledger_row("r0-1.1", 1, "w1", "ok")]}
    text = admin_cli.show_request(row)
    lines = text.splitlines()
    assert lines[0].split() == ["request_id", "r0-1.1"]
    assert "routed_ts       2026-09-21 14:13:21.000 UTC" in text
    assert "prefill_after   0.250s after routing" in text
    assert "finished_after  1.500s after routing" in text
    hops = text.split("hops (2):\n", 1)[1].splitlines()
    assert hops[0].split() == ["hop", "request_id", "worker_id", "dp_rank", "outcome",
                               "routed_ts"]
    assert hops[1].split() == ["0", "r0-1", "w0", "0", "migrated", "2026-09-21",
                               "14:13:20.000", "UTC"]
    assert hops[2].split()[:5] == ["1", "r0-1.1", "w1", "0", "ok"]
    candidates = text.split("candidates (2, * = chosen):\n", 1)[1].splitlines()
    assert [c.split()[0:2] for c in candidates[1:]] == [["*", "w1"], ["w0", "0"]]


def test_mapping_nests_records_and_tables_shorten_checksums() -> None:
    reset = {"epoch": 2, "cut": {"kv": 3}, "snapshot": {"snapshot_id": "s1", "size": 2048,
                                                         "positions": {"kv": 3}}}
    assert admin_cli.show_reset(reset).splitlines() == [
        "reset done: epoch is now 2", "cut       kv=3", "snapshot",
        "  snapshot_id  s1", "  size         2.0 KiB", "  positions    kv=3"]
    listing = admin_cli.show_snapshots({"snapshots": [
        {"snapshot_id": "s2", "ts": T0, "size": 10, "sha256": "ab" * 32}]})
    header, row = listing.splitlines()
    assert header.split() == ["snapshot_id", "ts", "size", "sha256"]
    assert row.split() == ["s2", "2026-09-21", "14:13:20.000", "UTC", "10", "B", "ab" * 6]
    assert admin_cli.show_snapshots({"snapshots": []}) == "no snapshots"


def test_api_message_reads_every_error_shape() -> None:
    def msg(status: int, **kw: Any) -> str:
        return admin_cli.api_message(httpx.Response(status, **kw))

    assert msg(403, json={"error": {"message": "invalid admin token"}}) == "invalid admin token"
    assert msg(503, json={"message": "busy", "type": "service_unavailable"}) == "busy"
    assert msg(422, json={"detail": "bad"}) == "bad"
    assert msg(502, text="upstream down\n") == "upstream down"
    assert msg(500) == "Internal Server Error"


def test_a_decision_shows_predicted_beside_engine_reported_reuse() -> None:
    hop0 = {**_ledger_row("r0-1", 0, "w0", "migrated"), "predicted_tokens": 48,
            "cached_tokens": 32}
    hop1 = {**_ledger_row("r0-1~1", 1, "w1", "ok"), "predicted_tokens": 0, "cached_tokens": None}
    text = admin_cli.show_request({**hop0, "hops": [hop0, hop1]})
    head = text.split("hops (2):", 1)[0]
    assert "predicted_tokens  48" in head and "cached_tokens     32" in head
    assert head.index("predicted_tokens") < head.index("cached_tokens") < head.index("outcome")
    hops = text.split("hops (2):\n", 1)[1].splitlines()
    assert hops[0].split()[4:6] == ["predicted_tokens", "cached_tokens"]
    assert hops[1].split()[4:6] == ["48", "32"]
