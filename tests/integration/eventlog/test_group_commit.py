"""GroupCommit against a real nats-server: events appended while a publish is in flight share
the next message, every event lands once and in order, lazy events linger and a prefill
completion still waiting is folded into its request's end."""

from __future__ import annotations

import asyncio

import pytest

from eventlog import events as ev
from eventlog.appender import Appender
from eventlog.group_commit import GroupCommit
from eventlog.names import Names
from eventlog.streams import stream_bounds
from eventlog.wire import FORMAT_HEADER
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
NAMES = Names("jr")
ROUTER = NAMES.stream("router")


def routed(i: int) -> ev.RequestRouted:
    return ev.RequestRouted(request_id=f"r{i}", replica_id="a", worker_id="w", dp_rank=0,
                            isl_tokens=32, block_seq_hashes=[i, i + 1], overlap_blocks=0,
                            expected_osl=4, priority=0, ts=1.0 + i)


async def stream_events(context, last: int) -> list[tuple[int, ev.Event]]:
    out = []
    for seq in range(1, last + 1):
        msg = await context.get_msg(ROUTER, seq)
        out.extend((seq, e) for e in ev.decode_batch(msg.data))
    return out


async def test_concurrent_appends_share_messages_once_each_in_order(js) -> None:
    _, context = js
    log = GroupCommit(Appender(context), NAMES.router_subject("a"), "a.boot1")
    sent = [routed(i) for i in range(200)]
    seqs = await asyncio.wait_for(asyncio.gather(*(log.append(e) for e in sent)), 30)
    _, last = await stream_bounds(context, ROUTER)
    assert last < len(sent) / 10  # grouped: appended in one go, they share messages
    landed = await stream_events(context, last)
    assert [e for _, e in landed] == sent
    assert [s for s, _ in landed] == list(seqs)  # each caller got its message's sequence
    assert log.messages == last and log.events == len(sent)
    assert log.last_seq == last  # what a lookup waits for the ledger to reach
    headers = (await context.get_msg(ROUTER, last)).headers
    assert headers is not None and headers["Nats-Msg-Id"] == f"a.boot1.{last}"


async def test_lazy_events_linger_and_a_waiting_prefill_folds_into_the_finish(js) -> None:
    _, context = js
    log = GroupCommit(Appender(context), NAMES.router_subject("a"), "a.boot2", linger=0.05)
    assert await asyncio.wait_for(log.append(routed(1)), 10) == 1
    prefill = log.submit(ev.PrefillCompleted("r1", 5.0), urgent=False)
    finish = log.submit(ev.RequestFinished("r1", "ok", 3, 6.0), urgent=False)
    assert await asyncio.wait_for(finish, 10) == 2  # went out by itself after the linger
    assert await asyncio.wait_for(prefill, 10) == 2  # carried by the same message
    landed = await stream_events(context, 2)
    assert [e for s, e in landed if s == 2] == [
        ev.RequestFinished("r1", "ok", 3, 6.0, prefill_ts=5.0)]
    assert log.folded == 1


async def test_lazy_events_ride_with_the_next_urgent_one(js) -> None:
    _, context = js
    log = GroupCommit(Appender(context), NAMES.router_subject("a"), "a.boot3", linger=30.0)
    lazy = log.submit(ev.PrefillCompleted("r0", 2.0), urgent=False)
    await asyncio.sleep(0)  # nothing is published for a lazy event alone
    assert await until(lambda: stream_bounds(context, ROUTER), lambda b: b[1] == 0,
                       timeout=5, what="stream still empty")
    assert await asyncio.wait_for(log.append(routed(2)), 10) == 1
    assert lazy.done() and lazy.result() == 1
    assert [e for _, e in await stream_events(context, 1)] == [
        ev.PrefillCompleted("r0", 2.0), routed(2)]
    log.close()


async def test_a_message_holds_at_most_max_events(js) -> None:
    _, context = js
    log = GroupCommit(Appender(context), NAMES.router_subject("a"), "a.boot4", max_events=3)
    sent = [routed(i) for i in range(10)]
    await asyncio.wait_for(asyncio.gather(*(log.append(e) for e in sent)), 30)
    _, last = await stream_bounds(context, ROUTER)
    assert last == 4  # 3 + 3 + 3 + 1
    assert [e for _, e in await stream_events(context, last)] == sent


async def test_a_held_message_outlives_the_server_and_lands_once(nats_server, js) -> None:
    """While its writer says the log is down (``hold``), a message whose append failed is sent
    again under its id instead of failing: it lands once, in order, when the server is back
    (same port, same store)."""
    _, context = js
    appender = Appender(context, timeout=0.3, attempts=1000, backoff_max=0.1, retry_window=0.5)
    down = {"hold": True}
    log = GroupCommit(appender, NAMES.router_subject("a"), "a.boot1", hold=lambda: down["hold"])
    assert await asyncio.wait_for(log.append(routed(0)), 10) == 1
    nats_server.kill()
    pending = [asyncio.ensure_future(log.append(routed(i))) for i in (1, 2)]
    await until(lambda: log.held, lambda n: n >= 2, timeout=20, what="the message held")
    assert not any(p.done() for p in pending)  # neither failed nor landed
    await asyncio.to_thread(nats_server.start, 30)
    seqs = await asyncio.wait_for(asyncio.gather(*pending), 30)
    _, last = await stream_bounds(context, ROUTER)
    assert [e for _, e in await stream_events(context, last)] == [routed(i) for i in range(3)]
    assert seqs == [last, last]


async def test_an_event_of_a_later_format_goes_in_a_message_of_its_own(js) -> None:
    # A release that cannot read ResponseStored loses (or stops at) that message alone, never
    # the decisions queued beside it.
    _, context = js
    log = GroupCommit(Appender(context), NAMES.router_subject("a"), "a.boot9")
    stored = ev.ResponseStored("resp_1", "w", 0, "m", 60.0, 2.0, "r1")
    sent = [routed(1), stored, routed(2)]
    await asyncio.wait_for(asyncio.gather(*(log.append(e) for e in sent)), 30)
    _, last = await stream_bounds(context, ROUTER)
    messages = [await context.get_msg(ROUTER, seq) for seq in range(1, last + 1)]
    batches = [(m.headers or {}).get(FORMAT_HEADER) for m in messages
               if stored in ev.decode_batch(m.data)]
    assert batches == ["2"]
    alone = [ev.decode_batch(m.data) for m in messages if stored in ev.decode_batch(m.data)]
    assert alone == [[stored]]
    assert [e for _, e in await stream_events(context, last)] == sent
