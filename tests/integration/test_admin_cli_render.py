"""`jetrouter admin` output and error parsing, without a cluster (see test_admin_cli.py)."""

from __future__ import annotations

from typing import Any

import httpx

from api import admin_cli


def test_candidates_are_named_sorted_and_the_chosen_one_marked() -> None:
    decision = {"request_id": "r0-1", "worker_id": "w1", "dp_rank": 0, "candidates": [
        ["w0", 0, 0, 10.0, 2.0, 12.0, False], ["w1", 0, 8, 2.0, 1.0, 3.0, False]]}
    rows = admin_cli.candidate_rows(decision)
    assert [(r[""], r["worker_id"], r["cost"]) for r in rows] == [("*", "w1", 3.0),
                                                                   ("", "w0", 12.0)]
    text = admin_cli.show_request(decision)
    table = text.split("chosen):\n", 1)[1].splitlines()
    assert table[0].split() == list(admin_cli.CANDIDATE_FIELDS)
    assert table[1].split() == ["*", "w1", "0", "8", "2", "1", "3", "no"]


def test_api_message_reads_every_error_shape() -> None:
    def msg(status: int, **kw: Any) -> str:
        return admin_cli.api_message(httpx.Response(status, **kw))

    assert msg(403, json={"error": {"message": "invalid admin token"}}) == "invalid admin token"
    assert msg(503, json={"message": "busy", "type": "service_unavailable"}) == "busy"
    assert msg(422, json={"detail": "bad"}) == "bad"
    assert msg(502, text="upstream down\n") == "upstream down"
    assert msg(500) == "Internal Server Error"
