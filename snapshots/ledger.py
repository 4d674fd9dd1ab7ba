"""Decision ledger: one SQL row per routing decision, from the router stream (design.md §8).

A row is born from ``RequestRouted`` (with every candidate's cost terms), then filled in by
``PrefillCompleted`` / ``RequestFinished``; ``ReplicaLost`` marks the lost replica's still-open
rows. A request migrated off a failed engine (``api/forward/``) is re-routed as
``<request_id>~<hop>``: each hop is its own row carrying ``base_id`` and ``hop``, and a lookup
by the base id returns all of them.

Throughput (~1,000 decisions/s, three events each) rules out a statement per event, so a group of
stream messages is first *folded* in memory, in stream order, into rows to insert and column
updates for rows already stored, then written with a few executemany statements. The result must
not depend on how messages were grouped (a rebuild by replay groups them differently), so:

* the first ``RequestRouted`` for an id wins; later events on a row overwrite (last wins);
* an update that arrives before its row exists hits nothing, as it would applied alone;
* ``RequestFinished`` carries the engine's ``cached_tokens`` (when it reported them), kept in
  the row beside ``predicted_tokens`` (``overlap_blocks * block_size`` of the decision);
* a disaggregated request's decode decision carries the KV blocks its engine receives
  (``transfer_blocks``); the time the hand-off took is read from the hops' rows
  (:func:`_phases`). Bytes are not recorded: neither vLLM's ``kv_transfer_params`` nor SGLang's
  answers say how many a request moved (vLLM counts them only in its own metrics);
* ``ReplicaLost`` flushes pending updates before marking stored rows, so "still open" means open
  at that point of the stream;
* retention drops rows whose ``routed_ts`` is older than a cutoff computed from the newest event
  ts applied (minus the retention, rounded down to 1/1000 of it): a row older than the cutoff is
  never inserted, and one DELETE runs when the cutoff moves. The cutoff only grows and depends on
  the newest ts alone, so the final rows are the same however messages were grouped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from eventlog import events as ev
from eventlog.names import PREFILL_HOP, ROUTER, split_hop
from snapshots.db import Tracking, decision_ledger, from_json, to_json

Message = tuple[int, Sequence[ev.Event]]

_RETENTION_STEPS = 1000
_LOOKUP_CHUNK = 500  # ids per IN (...) list: well under every backend's bound-parameter limit
CANDIDATE_FIELDS = (
    "worker", "dp_rank", "overlap_blocks", "prefill_blocks", "decode_blocks", "cost", "busy",
)


def _phases(rows: list[dict[str, Any]]) -> None:
    """Name each hop's part: ``prefill`` (hop -1), ``decode`` (the first hop after a prefill
    hop that handed its blocks over), else ``aggregated`` (no prefill hop, a prefill hop that
    failed, or a migration hop: those prefill on their own engine).

    The decode hop also gets ``handoff_s``: from the prefill hop's answer (its finish) to the
    decode engine's first token, both stamped by the replica that ran them (NULL until both
    happened). The two requests of an SGLang hand-off run concurrently and its prefill engine
    answers once the blocks are across, so there it is near 0, and negative when the prefill
    answer came after the first token."""
    prefill = next((r for r in rows if r["hop"] == PREFILL_HOP
                    and r["outcome"] == ev.Outcome.OK), None)
    for r in rows:
        r["phase"] = ("prefill" if r["hop"] == PREFILL_HOP
                      else "decode" if r["hop"] == 0 and prefill is not None else "aggregated")
        r["handoff_s"] = None
        if r["phase"] == "decode" and prefill is not None and r["prefill_ts"] is not None:
            r["handoff_s"] = r["prefill_ts"] - prefill["finished_ts"]


class LedgerView:
    projection = "decision_ledger"
    stream = ROUTER

    def __init__(self, retention: float) -> None:
        if retention < 0:
            raise ValueError(f"ledger retention must be >= 0 seconds, got {retention}")
        self.retention = retention  # 0: keep every decision

    async def write(
        self, conn: AsyncConnection, messages: Sequence[Message], track: Tracking
    ) -> None:
        """Apply ``messages`` (already filtered to seq > tracked position) inside ``conn``'s
        transaction; ``track.event_ts`` is advanced to the newest ``ts`` seen."""
        swept = self.cutoff(track.event_ts)
        routed_ids = [e.request_id for _, batch in messages for e in batch
                      if isinstance(e, ev.RequestRouted)]
        stored = await self._existing(conn, routed_ids)
        fresh: dict[str, dict[str, Any]] = {}
        updates: dict[str, dict[str, Any]] = {}

        def change(request_id: str, values: dict[str, Any]) -> None:
            row = fresh.get(request_id)
            if row is not None:
                row.update(values)
            else:
                updates.setdefault(request_id, {}).update(values)

        for seq, batch in messages:
            for e in batch:
                track.event_ts = max(track.event_ts, float(e.ts))
                if isinstance(e, ev.RequestRouted):
                    if e.request_id in fresh or e.request_id in stored:
                        continue
                    # Updates seen before this row existed were no-ops when they happened.
                    updates.pop(e.request_id, None)
                    fresh[e.request_id] = _routed_row(seq, e)
                elif isinstance(e, ev.PrefillCompleted):
                    change(e.request_id, {"prefill_ts": e.ts})
                elif isinstance(e, ev.RequestFinished):
                    values: dict[str, Any] = {"finished_ts": e.ts, "outcome": e.outcome,
                                              "output_tokens": e.output_tokens}
                    if e.cached_tokens >= 0:  # -1: the engine did not report it
                        values["cached_tokens"] = e.cached_tokens
                    if e.prefill_ts is not None:  # its PrefillCompleted was folded in here
                        values["prefill_ts"] = e.prefill_ts
                    change(e.request_id, values)
                elif isinstance(e, ev.ReplicaLost):
                    for row in fresh.values():
                        if row["replica_id"] == e.replica_id and _open(row):
                            row.update(lost=True, lost_ts=e.ts)
                    await self._flush_updates(conn, updates)
                    await self._mark_lost(conn, e)

        cutoff = self.cutoff(track.event_ts)
        rows = [row for row in fresh.values() if row["routed_ts"] >= cutoff]
        if rows:
            await conn.execute(decision_ledger.insert(), rows)
        await self._flush_updates(conn, updates)
        if cutoff > swept:  # stored rows are all at or after the previous cutoff
            await conn.execute(delete(decision_ledger).where(decision_ledger.c.routed_ts < cutoff))

    def cutoff(self, newest_ts: float) -> float:
        """Rows routed before this are dropped. Quantised to ``retention / 1000`` so that the
        DELETE runs when the cutoff has moved by a step, not in every transaction; being a
        function of the newest event time alone, it is the same however messages are grouped."""
        if self.retention == 0:
            return -math.inf
        step = self.retention / _RETENTION_STEPS
        return math.floor((newest_ts - self.retention) / step) * step

    async def request(self, conn: AsyncConnection, request_id: str) -> dict[str, Any] | None:
        """The decision for ``request_id`` with ``hops``: every hop of its base request."""
        base, _ = split_hop(request_id)
        table = decision_ledger
        rows = [_ledger_dict(r._mapping) for r in await conn.execute(
            select(table).where(table.c.base_id == base).order_by(table.c.hop)
        )]
        main = next((r for r in rows if r["request_id"] == request_id), None)
        if main is None and request_id == base and rows:
            main = rows[0]  # hop 0 aged out or never seen: the base id still finds the hops
        if main is None:
            return None
        _phases(rows)
        return {**main, "hops": rows}

    async def count(self, conn: AsyncConnection) -> int:
        return int((await conn.execute(select(func.count()).select_from(decision_ledger)))
                   .scalar_one())

    async def _existing(self, conn: AsyncConnection, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        unique = list(dict.fromkeys(ids))
        for i in range(0, len(unique), _LOOKUP_CHUNK):
            chunk = unique[i:i + _LOOKUP_CHUNK]
            rows = await conn.execute(
                select(decision_ledger.c.request_id).where(decision_ledger.c.request_id.in_(chunk))
            )
            found.update(rows.scalars())
        return found

    async def _flush_updates(
        self, conn: AsyncConnection, updates: dict[str, dict[str, Any]]
    ) -> None:
        """One executemany for every pending update: a column not changed is passed as NULL and
        kept by COALESCE (none of these columns is ever set back to NULL)."""
        if not updates:
            return
        params = [{"p_request_id": request_id,
                   **{f"p_{c}": values.get(c) for c in _UPDATABLE}}
                  for request_id, values in updates.items()]
        updates.clear()
        await conn.execute(_UPDATE_STMT, params)

    async def _mark_lost(self, conn: AsyncConnection, e: ev.ReplicaLost) -> None:
        table = decision_ledger
        await conn.execute(
            update(table)
            .where(table.c.replica_id == e.replica_id, table.c.finished_ts.is_(None),
                   table.c.lost.is_(False))
            .values(lost=True, lost_ts=e.ts)
        )


_UPDATABLE = ("prefill_ts", "finished_ts", "outcome", "output_tokens", "cached_tokens")
_UPDATE_STMT = (
    update(decision_ledger)
    .where(decision_ledger.c.request_id == bindparam("p_request_id"))
    .values({c: func.coalesce(bindparam(f"p_{c}", type_=decision_ledger.c[c].type),
                              decision_ledger.c[c])
             for c in _UPDATABLE})
)


def _open(row: dict[str, Any]) -> bool:
    return row["finished_ts"] is None and not row["lost"]


def _routed_row(seq: int, e: ev.RequestRouted) -> dict[str, Any]:
    base, hop = split_hop(e.request_id)
    return {
        "request_id": e.request_id,
        "base_id": base,
        "hop": hop,
        "seq": seq,
        "replica_id": e.replica_id,
        "worker_id": e.worker_id,
        "dp_rank": e.dp_rank,
        "model": e.model,
        "isl_tokens": e.isl_tokens,
        "overlap_blocks": e.overlap_blocks,
        "expected_osl": e.expected_osl,
        "priority": e.priority,
        "candidates": to_json(e.candidates),
        "routed_ts": e.ts,
        "prefill_ts": None,
        "finished_ts": None,
        "outcome": None,
        "output_tokens": None,
        "lost": False,
        "lost_ts": None,
        "predicted_tokens": e.overlap_blocks * e.block_size if e.block_size > 0 else None,
        "cached_tokens": None,
        "tenant": e.tenant or None,
        "transfer_blocks": e.transfer_blocks if e.transfer_blocks >= 0 else None,
    }


def candidate_dicts(rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(CANDIDATE_FIELDS, row, strict=True)) for row in rows]


def _ledger_dict(row: Any) -> dict[str, Any]:
    out = {key: row[key] for key in row.keys()}
    out["candidates"] = candidate_dicts(from_json(out["candidates"]))
    out["lost"] = bool(out["lost"])
    return out
