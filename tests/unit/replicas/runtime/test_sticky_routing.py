"""The routing side of sticky sessions and of Dynamo's block-tracking switches, on a replica's
state fed with events directly (no NATS: the dispatcher's ``_prepare`` is the synchronous part
of routing)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from eventlog import events as ev
from eventlog.hashing import prompt_hashes
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.routing_errors import AllWorkersBusy
from replicas.core.selection import BusyThresholds, RoutingConfig
from replicas.core.sticky import SessionRequest
from replicas.runtime.replica import Replica, ReplicaConfig, RouteRequest

BS = 16


def replica(thresholds: BusyThresholds | None = None, **routing: object) -> Replica:
    r = Replica(ReplicaConfig("r0", "nats://unused", routing=RoutingConfig.dynamo(**routing),
                              default_thresholds=thresholds or BusyThresholds()))
    kv = [ev.WorkerRegistered(w, f"http://{w}", "m", BS, 1000, 8192, 1.0) for w in ("w0", "w1")]
    r.state.apply(KV, 1, kv)
    return r


def cache(r: Replica, worker: str, tokens: list[int], seq: int) -> None:
    hashes = prompt_hashes(tokens, BS)
    blocks = [(h, h) for h in hashes]
    r.state.apply(KV, seq, [ev.BlocksStored(worker, seq, 0, None, blocks, 2.0)])


def request(rid: str, tokens: list[int], session: SessionRequest | None = None,
            exclude: frozenset[str] = frozenset()) -> RouteRequest:
    return RouteRequest(rid, "m", tokens, session=session, exclude=exclude)


def land(r: Replica, routed: object, seq: int) -> None:
    """The decision's message comes back from the stream."""
    r.state.apply(ROUTER, seq, [routed.event, *routed.session_events])  # type: ignore[attr-defined]
    r.dispatcher.settle(routed.request_id)  # type: ignore[attr-defined]


def test_a_pinned_session_ignores_a_better_cache_elsewhere() -> None:
    r = replica()
    first = r.dispatcher._prepare(request("a", list(range(64)), SessionRequest("s", "open")))
    assert first.sticky == "open"
    home = first.worker_id
    other = "w1" if home == "w0" else "w0"
    lure = list(range(1000, 1000 + 10 * BS))
    cache(r, other, lure, 2)
    # Before the pin is back from the stream the overlay already holds it.
    second = r.dispatcher._prepare(request("b", lure, SessionRequest("s")))
    assert second.worker_id == home and second.sticky == "pinned"
    land(r, first, 1)
    land(r, second, 2)
    assert r.state.sessions.get("s").requests == 2  # type: ignore[union-attr]
    # No session: the cache wins.
    assert r.dispatcher._prepare(request("c", lure)).worker_id == other


@pytest.mark.parametrize("how", ["retired", "unhealthy", "excluded"])
def test_an_unusable_engine_releases_the_pin(how: str) -> None:
    r = replica()
    first = r.dispatcher._prepare(request("a", list(range(64)), SessionRequest("s", "open")))
    land(r, first, 1)
    home = first.worker_id
    exclude: frozenset[str] = frozenset()
    if how == "retired":
        r.state.apply(KV, 5, [ev.WorkerRetired(home, "shutdown", 3.0)])
    elif how == "unhealthy":
        r.state.apply(CONTROL, 1, [ev.WorkerHealthChanged(home, "unhealthy", "test", 3.0)])
    else:
        exclude = frozenset({home})
    moved = r.dispatcher._prepare(request("b", list(range(64)), SessionRequest("s"), exclude))
    assert moved.worker_id != home and moved.sticky == "repin"
    pin = moved.session_events[0]
    assert isinstance(pin, ev.SessionPinned) and pin.reason == "repin"
    land(r, moved, 2)
    assert r.state.sessions.get("s").worker[0] == moved.worker_id  # type: ignore[union-attr]


def test_close_releases_and_the_next_turn_opens_afresh() -> None:
    r = replica()
    first = r.dispatcher._prepare(request("a", [1, 2, 3], SessionRequest("s", "open")))
    land(r, first, 1)
    last = r.dispatcher._prepare(request("b", [4, 5, 6], SessionRequest("s", "close")))
    assert last.worker_id == first.worker_id
    assert isinstance(last.session_events[0], ev.SessionReleased)
    land(r, last, 2)
    assert r.state.sessions.get("s") is None
    assert r.dispatcher._prepare(request("c", [7], SessionRequest("s"))).sticky == "open"


def test_a_busy_pinned_engine_still_takes_its_session() -> None:
    r = replica(BusyThresholds(active_prefill_tokens_threshold=1))
    first = r.dispatcher._prepare(request("a", list(range(200)), SessionRequest("s", "open")))
    land(r, first, 1)  # 200 prefill tokens in flight on the engine: over the threshold
    with pytest.raises(AllWorkersBusy):  # without its session the engine is busy: refused
        r.dispatcher._prepare(request("x", list(range(300, 400)),
                                      exclude=frozenset({"w1" if first.worker_id == "w0"
                                                         else "w0"})))
    again = r.dispatcher._prepare(request("b", list(range(300, 400)), SessionRequest("s")))
    assert again.worker_id == first.worker_id


def candidate(r: Replica, worker: str, tokens: list[int]) -> object:
    hashes = prompt_hashes(tokens, BS)
    return next(c for c in r.dispatcher.candidates("m", hashes) if c.worker == (worker, 0))


def test_block_tracking_switches_change_what_candidates_are_charged() -> None:
    tokens = list(range(4 * BS))
    in_flight = ev.RequestRouted("x", "r9", "w0", 0, len(tokens), prompt_hashes(tokens, BS), 0,
                                 8, 0, 2.0)
    loads = {}
    for name, flags in {"default": {}, "no_active": {"track_active_blocks": False},
                        "no_prefill": {"track_prefill_tokens": False}}.items():
        r = replica(**flags)
        r.state.apply(ROUTER, 1, [in_flight])
        c = candidate(r, "w0", tokens)
        loads[name] = (c.active_prefill_tokens, c.active_decode_blocks,  # type: ignore[attr-defined]
                       c.new_request_blocks)  # type: ignore[attr-defined]
        # The replicated load itself never depends on the switches.
        assert r.state.load.active_decode_blocks(("w0", 0)) == 4
        assert r.state.load.active_prefill_tokens(("w0", 0)) == 4 * BS
    assert loads["default"] == (4 * BS, 4, 0)  # the same 4 blocks are already held: shared
    assert loads["no_active"] == (4 * BS, 0, 0)
    assert loads["no_prefill"] == (0, 4, 0)


def test_without_kv_reuse_every_request_holds_its_own_blocks() -> None:
    tokens = list(range(4 * BS))
    shared = {}
    for reuse in (True, False):
        r = replica()
        r.config = replace(r.config, assume_kv_reuse=reuse)
        r.dispatcher.config = r.config
        first = r.dispatcher._prepare(request("a", tokens))
        assert first.event.kv_reuse is reuse  # the decision says so: every replica counts alike
        land(r, first, 1)
        again = candidate(r, first.worker_id, tokens)  # the same prompt once more
        assert again.new_request_blocks == (0 if reuse else 4)  # type: ignore[attr-defined]
        second = r.dispatcher._prepare(request("b", tokens, exclude=frozenset(
            {"w1" if first.worker_id == "w0" else "w0"})))
        land(r, second, 2)
        shared[reuse] = r.state.load.active_decode_blocks((first.worker_id, 0))
    assert shared == {True: 4, False: 8}  # two requests, the same prompt: once, or twice
