"""Applying many messages of one stream at once: what a replica catching up does (design.md §5).

``RouterState.apply_many(stream, messages)`` leaves the state exactly as ``apply`` on each message
in turn would. On the KV stream it gathers the stores and removals of consecutive messages into a
run and hands the run to the index (``apply_run``: one change to its tables for the whole run in
the compact form, ``index_run.py``). Everything else keeps its place in the order:

* each message's position, duplicate and malformed checks, and each event's checks (a refused
  worker, its ``event_id`` in sequence, an offloaded tier) run in message order, as ``apply``
  runs them; only events that reach the index join the run;
* any other KV event — a worker registered or retired, a clear — first applies the run so far,
  then itself (it may free a slot, or depend on what the run stored);
* expiry runs once, after the last message, not after each: on the KV stream it only reads event
  time, a maximum, and expires what lies before it, so once gives what each time gives.

Approximate mode (its index expires blocks by event time) and the other streams apply message by
message. Statuses are counted as ``apply`` counts them. Pure: no I/O, clock or randomness.

``kv_decoder`` says how the KV stream's messages should be decoded for a state's index: with each
``BlocksStored``'s blocks left as u64 words (``eventlog/kv_decode.py``) where the index's compiled
kernel copies them as they are, else as tuples of ints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from eventlog import events as ev
from eventlog import kv_decode
from eventlog.names import KV
from replicas.core import index_kernel
from replicas.core.index import PrefixIndex as CompactIndex
from replicas.core.index_run import REMOVE, STORE, KvOp, RunResult

_STORED = ev.BlocksStored.__name__


class _Config(Protocol):
    @property
    def approximate(self) -> bool: ...


class _Index(Protocol):
    def apply_run(self, ops: Sequence[KvOp]) -> list[RunResult]: ...


class _Stats(Protocol):
    def bump(self, stream: str, event_type: str, status: str, n: int = 1) -> None: ...


class RouterState(Protocol):
    """What ``apply_many`` reads and changes of ``replicas.core.state.RouterState`` (which
    calls it), as a port, so the two modules do not import each other."""

    positions: dict[str, int]
    now: float

    @property
    def config(self) -> _Config: ...

    @property
    def index(self) -> _Index: ...

    @property
    def stats(self) -> _Stats: ...

    def apply(self, stream: str, seq: int, events: Sequence[ev.Event]) -> bool: ...

    def _apply_event(self, stream: str, event: ev.Event) -> None: ...

    def _skip_kv_event(self, worker_id: str, event_id: int) -> str | None: ...

    def _expire(self) -> None: ...


def kv_decoder(index: object) -> ev.Decode:
    """``decode_kv_batch`` for the compact form applying with its kernel (outside approximate
    mode, whose Python code would iterate the packed pairs), else ``decode_batch``: the same
    events either way."""
    if (kv_decode.AVAILABLE and isinstance(index, CompactIndex) and not index.approximate
            and index_kernel.active() is not None):
        return kv_decode.decode_kv_batch
    return ev.decode_batch


def apply_many(state: RouterState, stream: str,
               messages: Sequence[tuple[int, Sequence[ev.Event]]]) -> None:
    if stream != KV or state.config.approximate:
        for seq, events in messages:
            state.apply(stream, seq, events)
        return
    positions, stats = state.positions, state.stats
    skip_kv_event = state._skip_kv_event
    run: list[KvOp] = []
    kinds: list[str] = []  # each run op's event type, for its status count
    stored, removed = ev.BlocksStored, ev.BlocksRemoved
    applied = False
    for seq, events in messages:
        if seq <= positions[KV]:
            stats.bump(KV, "message", "duplicate")
            continue
        positions[KV] = seq
        applied = True
        if not events:
            stats.bump(KV, "message", "malformed")
        for e in events:
            t = type(e)
            if t is not stored and t is not removed:
                if run:
                    _flush(state, run, kinds)
                state._apply_event(KV, e)
                continue
            if e.ts > state.now:
                state.now = e.ts
            name = t.__name__
            skip = skip_kv_event(e.worker_id, e.event_id)
            if skip:
                stats.bump(KV, name, skip)
                continue
            if e.medium is not None:
                stats.bump(KV, name, "other_tier")
                continue
            if t is stored:
                run.append((STORE, (e.worker_id, e.dp_rank), e.parent_hash, e.blocks))
            else:
                run.append((REMOVE, (e.worker_id, e.dp_rank), e.block_hashes, None))
            kinds.append(name)
    if run:
        _flush(state, run, kinds)
    if applied:
        state._expire()


def _flush(state: RouterState, run: list[KvOp], kinds: list[str]) -> None:
    """Apply the run to the index and count each op's status as ``apply`` would (tallied first:
    a count per op costs more than the compiled index's apply of a small event)."""
    bump = state.stats.bump
    tally = Counter(zip(kinds, state.index.apply_run(run), strict=True))
    for (name, result), n in tally.items():
        if name == _STORED:
            bump(KV, name, result, n)  # type: ignore[arg-type]
        else:  # a removal's result: how many of its ids were unknown
            bump(KV, name, "block_not_found" if result else "ok", n)
    run.clear()
    kinds.clear()
