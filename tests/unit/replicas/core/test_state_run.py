"""``RouterState.apply_many`` (state_run.py) against ``apply`` message by message: the same state —
digests, positions, statuses, event ids, workers, answers — over random KV messages cut into
slices at random: stores and removals mixed with registrations, retirements, clears, refused
workers, event id gaps and repeats, offloaded tiers, events on the wrong stream, empty and
repeated messages; both index forms."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog import kv_decode
from eventlog.hashing import sequence_hashes
from eventlog.names import CONTROL, KV
from replicas.core import index_kernel
from replicas.core.state import RouterState, StateConfig
from replicas.core.state_run import kv_decoder

# every test twice: the index's Python code, then its compiled kernel (conftest.py)
pytestmark = pytest.mark.usefixtures("each_index_kernel")

WORKERS = ["w0", "w1", "w2"]
IDS = st.integers(min_value=0, max_value=12).map(lambda h: h * 100 + 7)
TOKENS = st.integers(min_value=1, max_value=5)
WORKER = st.sampled_from(WORKERS)
EVENT_ID = st.integers(min_value=1, max_value=40)
TS = st.floats(min_value=1.0, max_value=1e4, allow_nan=False)
RANK = st.integers(min_value=0, max_value=1)

EVENTS = st.one_of(
    st.builds(ev.BlocksStored, WORKER, EVENT_ID, RANK, st.one_of(st.none(), st.none(), IDS),
              st.lists(st.tuples(IDS, TOKENS), max_size=16), TS,
              st.sampled_from([None, None, None, None, "cpu"])),
    st.builds(ev.BlocksStored, WORKER, EVENT_ID, RANK, st.one_of(st.none(), IDS),
              st.lists(st.tuples(IDS, TOKENS), max_size=16), TS),
    st.builds(ev.BlocksRemoved, WORKER, EVENT_ID, RANK, st.lists(IDS, max_size=16), TS,
              st.sampled_from([None, None, None, "cpu"])),
    st.builds(ev.AllBlocksCleared, WORKER, EVENT_ID, RANK, TS),
    # a worker with another block size is refused: its events are counted, never indexed
    st.builds(ev.WorkerRegistered, WORKER, st.just("http://w"), st.just("m"),
              st.sampled_from([16, 16, 16, 32]), st.just(100), st.just(8192), TS),
    st.builds(ev.WorkerRetired, WORKER, st.sampled_from(["shutdown", "lost"]), TS),
    st.builds(ev.SnapshotThresholdSet, st.just(10), TS),  # a control event on the KV stream
)
# (seq step: 0 repeats the previous message's position, and is skipped as a duplicate; events)
MESSAGES = st.lists(st.tuples(st.sampled_from([1, 1, 1, 1, 2, 0]),
                              st.lists(EVENTS, max_size=4)), max_size=40)
QUERIES = [sequence_hashes(q) for q in ([1], [1, 2], [1, 2, 3, 4], [2, 3], [5, 5, 5])]


def numbered(messages: list[tuple[int, list[ev.Event]]]) -> list[tuple[int, list[ev.Event]]]:
    seq = 0
    out = []
    for step, events in messages:
        seq += step
        out.append((max(seq, 1), events))
    return out


def summary(state: RouterState) -> tuple[object, ...]:
    index = state.index
    return (state.digests(), state.positions, state.stats.counts, state.last_event_id,
            state.out_of_sync, state.now, sorted(state.workers), sorted(state.lost_workers),
            sorted(state.refused_workers), state.roster_version, index.total_blocks,
            index.node_count, sorted(index.counters.items()),
            [index.find_matches(q) for q in QUERIES])


@pytest.mark.parametrize("form", ["compact", "reference"])
@settings(max_examples=150, deadline=None)
@given(messages=MESSAGES, cuts=st.lists(st.integers(min_value=1, max_value=12), max_size=40))
def test_apply_many_equals_apply_one_message_at_a_time(
        form: str, messages: list[tuple[int, list[ev.Event]]], cuts: list[int]) -> None:
    config = StateConfig(index_form=form)
    one, many = RouterState(config), RouterState(config)
    feed = numbered(messages)
    for seq, events in feed:
        one.apply(KV, seq, events)
    at = 0
    for size in [*cuts, len(feed)]:
        many.apply_many(KV, feed[at:at + size])
        at += size
        if at >= len(feed):
            break
    assert summary(many) == summary(one)
    restored = RouterState.decode(many.encode(), config)
    assert restored.digests() == one.digests()
    # as a replica reads the stream: each message through the decoder its index is given
    # (blocks as u64 words for the compact form's kernel; every message, however small)
    read = RouterState(config)
    decode = kv_decoder(read.index)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_decode, "SMALL_MESSAGE", 0)
        read.apply_many(KV, [(seq, decode(ev.encode_batch(events)) if events else [])
                             for seq, events in feed])
    assert summary(read) == summary(one)


@pytest.mark.parametrize("config", [StateConfig(), StateConfig(index_form="compact"),
                                    StateConfig(index_form="compact", approximate=True)],
                         ids=["reference", "compact", "compact-approximate"])
def test_the_kv_decoder_packs_blocks_only_for_the_compact_kernel(config: StateConfig) -> None:
    packs = (config.index_form == "compact" and not config.approximate
             and index_kernel.active() is not None and kv_decode.AVAILABLE)
    expected = kv_decode.decode_kv_batch if packs else ev.decode_batch
    assert kv_decoder(RouterState(config).index) is expected


def test_other_streams_and_approximate_mode_apply_message_by_message() -> None:
    taken = ev.SnapshotThresholdSet(5, 2.0)
    for config in (StateConfig(), StateConfig(approximate=True)):
        one, many = RouterState(config), RouterState(config)
        messages: list[tuple[int, list[ev.Event]]] = [(1, [taken]), (1, [taken]), (2, [])]
        for seq, events in messages:
            one.apply(CONTROL, seq, events)
        many.apply_many(CONTROL, messages)
        stored = [(3, [ev.BlocksStored("w0", 1, 0, None, [(7, 1), (8, 2)], 3.0)])]
        one.apply(KV, *stored[0])
        many.apply_many(KV, stored)
        assert summary(many) == summary(one)
