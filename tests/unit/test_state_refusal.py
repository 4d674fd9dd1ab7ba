"""RouterState refuses a worker whose block size differs from the router's: never indexed, never
a candidate, visible with its reason; a function of the event and the config alone."""

from __future__ import annotations

from eventlog import events as ev
from eventlog.names import KV
from replicas.core.state import RouterState, StateConfig


def register(worker: str, block_size: int, ts: float = 1.0) -> ev.WorkerRegistered:
    return ev.WorkerRegistered(worker, f"http://{worker}", "m", block_size, 100, 2048, ts)


def stored(worker: str, event_id: int) -> ev.BlocksStored:
    return ev.BlocksStored(worker, event_id, 0, None, [(1, 11), (2, 22)], 2.0)


def test_mismatched_block_size_is_refused_and_never_indexed() -> None:
    state = RouterState(StateConfig(block_size=16))
    state.apply(KV, 1, [register("good", 16), register("bad", 32)])
    state.apply(KV, 2, [stored("good", 1), stored("bad", 1)])
    assert set(state.workers) == {"good"}
    assert set(state.refused_workers) == {"bad"}
    assert state.refusal_reason("bad") == (
        "block size 32 differs from the router's --kv-cache-block-size 16")
    assert state.refusal_reason("good") is None
    assert state.index.tree_size(("bad", 0)) == 0 and state.index.tree_size(("good", 0)) == 2
    assert state.stats.counts[(KV, "WorkerRegistered", "refused_block_size")] == 1
    assert state.stats.counts[(KV, "BlocksStored", "refused_worker")] == 1


def test_reregistering_fixes_or_breaks_a_worker() -> None:
    state = RouterState(StateConfig(block_size=16))
    state.apply(KV, 1, [register("w", 16), stored("w", 1)])
    # Restarted with the wrong block size: what it cached before is forgotten, it is refused.
    state.apply(KV, 2, [register("w", 32, ts=2.0)])
    assert "w" not in state.workers and "w" in state.refused_workers
    assert state.index.tree_size(("w", 0)) == 0
    state.apply(KV, 3, [register("w", 16, ts=3.0), stored("w", 1)])
    assert "w" in state.workers and not state.refused_workers
    assert state.index.tree_size(("w", 0)) == 2
    # A refused worker that shuts down leaves no trace.
    state.apply(KV, 4, [register("x", 8), ev.WorkerRetired("x", "shutdown", 4.0)])
    assert not state.refused_workers


def test_refusal_is_replicated_state() -> None:
    """Equal on every replica (digest), and kept across a snapshot."""
    a, b = RouterState(StateConfig(block_size=16)), RouterState(StateConfig(block_size=16))
    a.apply(KV, 1, [register("bad", 32)])
    assert a.digests() != b.digests()
    b.apply(KV, 1, [register("bad", 32)])
    assert a.digests() == b.digests()
    copy = RouterState.decode(a.encode(), a.config)
    assert copy.digests() == a.digests() and set(copy.refused_workers) == {"bad"}
