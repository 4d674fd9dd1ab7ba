"""`jetrouter bridge` as a real process between a real-socket engine stand-in (ZMQ PUB + ROUTER
replay + HTTP, tests/kvengine.py) and a real nats-server.

The check that matters everywhere: a fresh RouterState built from the JR_KV stream has the same
index digest as one built from the engine's ground truth (what it really caches)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import pytest
import zmq
import zmq.asyncio
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from eventlog.events import (
    AllBlocksCleared,
    BlocksStored,
    Event,
    WorkerRegistered,
    WorkerRetired,
    decode_batch,
)
from eventlog.hashing import prompt_hashes
from eventlog.names import Names
from eventlog.streams import ensure_streams
from natsops.server import NatsServer
from replicas.core.state import RouterState, StateConfig
from tests.kvengine import EngineSim
from tests.waiting import until
from workers.bridge.resume import H_EVENT_ID, H_GEN, H_SEQ
from workers.bridge.zmqio import parse_replay_reply, replay, replay_request

NAMES = Names("jr")
STREAM = NAMES.stream("kv")


class BridgeProc:
    def __init__(self, engine: EngineSim, nats_url: str, worker_id: str, log_dir: Path,
                 *extra: str) -> None:
        self.argv = [sys.executable, "-m", "api.cli", "bridge", "--engine-url", engine.url,
                     "--kv-events", engine.events_endpoint, "--kv-replay",
                     engine.replay_endpoint, "--kv-topic", engine.topic if engine.layout == "map"
                     else "", "--worker-id", worker_id, "--nats-url", nats_url,
                     "--health-interval", "0.2", "--unhealthy-after", "1",
                     "--load-interval", "0.2", "--replay-timeout", "10", *extra]
        self.log_dir = log_dir
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BridgeProc:
        self.runs += 1
        self.log_path = self.log_dir / f"bridge-{self.runs}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.log_dir.glob("bridge-*.log")))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


async def kv_messages(nc: NATS, subject: str) -> list[tuple[int, dict[str, str], list[Event]]]:
    """Every message on one worker's KV subject: (stream seq, headers, events)."""
    js = nc.jetstream()
    info = await js.stream_info(STREAM)
    out = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            msg = await js.get_msg(STREAM, seq)
        except NotFoundError:
            continue
        if msg.subject == subject:
            out.append((seq, dict(msg.headers or {}), decode_batch(msg.data or b"")))
    return out


async def state_from_stream(nc: NATS, block_size: int) -> RouterState:
    state = RouterState(StateConfig(block_size=block_size))
    js = nc.jetstream()
    info = await js.stream_info(STREAM)
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        msg = await js.get_msg(STREAM, seq)
        state.apply("kv", seq, decode_batch(msg.data or b""))
    return state


async def caught_up(nc: NATS, worker_id: str, engine: EngineSim) -> bool:
    """The bridge appended the engine's latest batch."""
    try:
        msg = await nc.jetstream().get_last_msg(STREAM, NAMES.kv_subject(worker_id))
    except NotFoundError:
        return False
    return (msg.headers or {}).get(H_SEQ) == str(engine.seq - 1)


def all_events(messages: list[tuple[int, dict[str, str], list[Event]]]) -> list[Event]:
    return [e for _, _, events in messages for e in events]


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    await ensure_streams(client.jetstream(), NAMES)
    yield client
    await client.close()


@pytest.fixture
async def engine() -> AsyncIterator[EngineSim]:
    sim = await EngineSim(loras=("sql-lora",)).start()
    yield sim
    await sim.stop()


@pytest.fixture
def bridges(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[BridgeProc] = []

    def make(engine: EngineSim, url: str, worker_id: str = "e1", *extra: str) -> BridgeProc:
        proc = BridgeProc(engine, url, worker_id, tmp_path, *extra)
        started.append(proc)
        return proc.start()

    yield make
    for proc in started:
        proc.kill()


def prefixes(engine: EngineSim, n: int = 4) -> list[list[int]]:
    return [[engine.rng.randrange(30_000) for _ in range(2 * engine.block_size)]
            for _ in range(n)]


async def registered(nc: NATS, worker_id: str = "e1") -> WorkerRegistered:
    async def probe() -> WorkerRegistered | None:
        msgs = await kv_messages(nc, NAMES.kv_subject(worker_id))
        regs = [e for e in all_events(msgs) if isinstance(e, WorkerRegistered)]
        return regs[-1] if regs else None
    return await until(probe, timeout=60, what="WorkerRegistered on the stream")


async def bridged_after_steps(nc: NATS, engine: EngineSim, bridges: Callable[..., BridgeProc],
                             steps: int) -> tuple[list[list[int]], BridgeProc]:
    """A bridge between ``engine`` and NATS as e1, registered, and the engine's first ``steps``
    batches on the stream: (the prefixes the engine's steps extend, the bridge)."""
    shared = prefixes(engine)
    bridge = bridges(engine, nc.connected_url.geturl())
    await registered(nc)
    for _ in range(steps):
        engine.random_step(shared)
    await until(lambda: caught_up(nc, "e1", engine), timeout=60,
                what=f"the engine's first {steps} batches appended")
    return shared, bridge


async def clears(nc: NATS, worker_id: str = "e1") -> int:
    """How many ``AllBlocksCleared`` the worker's KV subject holds."""
    events = all_events(await kv_messages(nc, NAMES.kv_subject(worker_id)))
    return sum(isinstance(e, AllBlocksCleared) for e in events)


async def assert_index_matches_engine(nc: NATS, engine: EngineSim, worker_id: str = "e1") -> None:
    await until(lambda: caught_up(nc, worker_id, engine), timeout=60,
                what="bridge caught up with the engine")
    state = await state_from_stream(nc, engine.block_size)
    truth = engine.truth_state(worker_id)
    assert state.index.total_blocks == truth.index.total_blocks, (
        f"state counters: {dict(state.stats.counts)}")
    assert state.digests()["index"] == truth.digests()["index"]
    assert ("kv", "EventIdGap", "gap") not in state.stats.counts
    assert not any(status == "duplicate_event_id" for (_, _, status) in state.stats.counts)


# --- replay socket framing -------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_topic", [True, False])
async def test_replay_request_and_reply_framing(with_topic: bool) -> None:
    """The DEALER request is [b"", start seq u64 BE]; replies [b"", (topic,) seq, payload] until
    the end marker (seq 0xFF*8); vLLM sends the topic frame, SGLang does not."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    seen: list[list[bytes]] = []

    async def serve() -> None:
        frames = await router.recv_multipart()
        seen.append(frames[1:])
        start = int.from_bytes(frames[2], "big")
        head = [b"kv-events"] if with_topic else []
        for seq in range(start, start + 3):
            await router.send_multipart([frames[0], b"", *head, seq.to_bytes(8, "big"),
                                         f"p{seq}".encode()])
        end = [b"", b"\xff" * 8, b""] if with_topic else [b"\xff" * 8, b""]
        await router.send_multipart([frames[0], b"", *end])

    try:
        server = asyncio.create_task(serve())
        got = await replay(ctx, endpoint, 2**40 + 5, timeout=10)
        await server
        assert seen == [[b"", (2**40 + 5).to_bytes(8, "big")]] == [replay_request(2**40 + 5)]
        assert [(f.seq, f.payload) for f in got] == [(2**40 + 5 + i, f"p{2**40 + 5 + i}".encode())
                                                     for i in range(3)]
        assert parse_replay_reply([b"", b"", b"\xff" * 8, b""]) is None
    finally:
        ctx.destroy(linger=0)


# --- the bridge process ----------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_registers_streams_gauges_reannounces_and_retires(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    shared = prefixes(engine)
    for _ in range(5):
        engine.random_step(shared)  # before the bridge: learned through the replay socket
    gauges: list[dict] = []  # type: ignore[type-arg]

    async def on_gauge(msg) -> None:  # type: ignore[no-untyped-def]
        gauges.append(json.loads(msg.data))
    await nc.subscribe(NAMES.load_subject("e1"), cb=on_gauge)
    engine.running, engine.waiting = 3, 2
    bridge = bridges(engine, nc.connected_url.geturl())
    reg = await registered(nc)
    assert (reg.url, reg.model, reg.block_size, reg.kv_total_blocks, reg.loras) == (
        engine.url, "tiny", 16, engine.num_gpu_blocks, ["sql-lora"])
    for _ in range(40):
        engine.random_step(shared)
    await assert_index_matches_engine(nc, engine)
    gauge = await until(lambda: gauges[-1] if gauges else None, what="a load gauge")
    assert gauge["worker_id"] == "e1" and gauge["dp_rank"] == 0
    assert (gauge["num_running"], gauge["num_waiting"]) == (3, 2)
    assert gauge["kv_total_blocks"] == engine.num_gpu_blocks

    # Re-announce: AllBlocksCleared + the cache, and the index is unchanged.
    before = len(await kv_messages(nc, NAMES.kv_subject("e1")))
    await nc.publish(NAMES.reannounce_subject("e1"), b"")
    msgs = await until(lambda: kv_messages(nc, NAMES.kv_subject("e1")),
                       lambda m: len(m) > before, what="re-announce appended")
    announced = msgs[-1][2]
    assert isinstance(announced[0], AllBlocksCleared)
    assert sum(len(e.blocks) for e in announced if isinstance(e, BlocksStored)) == sum(
        map(len, engine.cache.values()))
    await assert_index_matches_engine(nc, engine)

    assert bridge.terminate() == 0
    events = all_events(await kv_messages(nc, NAMES.kv_subject("e1")))
    assert isinstance(events[-1], WorkerRetired) and events[-1].reason == "shutdown"
    ids = [e.event_id for e in events if hasattr(e, "event_id")]  # type: ignore[attr-defined]
    assert ids == sorted(set(ids)), "event ids strictly increasing"


@pytest.mark.timeout(60)
async def test_an_sglang_prefill_engine_registers_its_bootstrap_port(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    """Routers name the prefill engine's bootstrap server to both engines of an SGLang
    hand-off (api/forward/sglang_handoff.py): the bridge's flags carry it to them."""
    bridges(engine, nc.connected_url.geturl(), "e1", "--role", "prefill",
            "--engine-kind", "sglang", "--bootstrap-port", "8998")
    reg = await registered(nc)
    assert (reg.role, reg.engine_kind, reg.bootstrap_port) == ("prefill", "sglang", 8998)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["map", "array"])
async def test_gap_is_filled_from_the_replay_socket(
        nc: NATS, bridges, layout: str) -> None:  # type: ignore[no-untyped-def]
    """Batches the SUB socket never got (dropped) are fetched from the replay socket: no clear,
    the index equals the engine's cache. `array`: SGLang's layout (signed hashes, no topic)."""
    engine = await EngineSim(layout=layout, topic="kv-events" if layout == "map" else "").start()
    try:
        shared, _ = await bridged_after_steps(nc, engine, bridges, 1)
        replays = len(engine.replay_requests)
        for _ in range(6):
            engine.random_step(shared, send=False)  # lost on the way: only in the buffer
        engine.random_step(shared)
        await assert_index_matches_engine(nc, engine)
        assert len(engine.replay_requests) > replays
        assert await clears(nc) == 0
    finally:
        await engine.stop()


@pytest.mark.timeout(120)
async def test_replay_answer_with_a_hole_is_asked_again_not_cleared(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    """A replay answer missing batches in its middle (the engine's ROUTER socket dropped them
    while the reader was slow) is asked again from the first one missing: no clear."""
    shared, _ = await bridged_after_steps(nc, engine, bridges, 1)
    replays = len(engine.replay_requests)
    gap = engine.seq
    for _ in range(6):
        engine.random_step(shared, send=False)  # lost on the way: only in the buffer
    engine.replay_drops = {gap + 3, gap + 4}
    engine.random_step(shared)
    await assert_index_matches_engine(nc, engine)
    assert engine.replay_requests[replays:][:2] == [gap, gap + 3]
    assert await clears(nc) == 0


# How the engine's answer to a resumed bridge's replay from seq 0 comes damaged, and the
# replays the bridge must ask for: a hole (two batches dropped from the middle, seen in CI at
# load ~10), or an answer stopping after three batches (a ROUTER queue full to the end while the
# bridge was slow) with its end marker lost with the rest (silence) or kept.
DAMAGED_ANSWERS = {"hole": ([0, 2], {"replay_drops": {2, 3}}),
                   "cut, end lost": ([0, 3], {"replay_cut_after": 3}),
                   "cut, end kept": ([0, 3], {"replay_cut_after": 3,
                                              "replay_cut_keeps_end": True})}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", list(DAMAGED_ANSWERS))
async def test_a_resumed_bridge_rebuilds_its_mirror_past_a_damaged_answer(
        nc: NATS, engine: EngineSim, bridges, damage: str) -> None:  # type: ignore[no-untyped-def]
    """A restarted bridge replays the engine's run from seq 0 into its mirror, so that a
    re-announce is the whole cache; what a damaged answer brought is kept and the rest asked for
    from where it stopped (the re-announce was a clear only: seen in CI under load)."""
    asked, setting = DAMAGED_ANSWERS[damage]
    _, bridge = await bridged_after_steps(nc, engine, bridges, 8)
    bridge.kill()
    replays = len(engine.replay_requests)
    for name, value in setting.items():
        setattr(engine, name, value)
    bridge.start()
    await until(lambda: len(engine.replay_requests) >= replays + 2, timeout=60,
                what="the mirror rebuild asked again")
    assert engine.replay_requests[replays:][:2] == asked, bridge.log()[-3000:]
    before = len(await kv_messages(nc, NAMES.kv_subject("e1")))
    await nc.publish(NAMES.reannounce_subject("e1"), b"")
    msgs = await until(lambda: kv_messages(nc, NAMES.kv_subject("e1")),
                       lambda m: len(m) > before, what="re-announce appended")
    assert sum(len(e.blocks) for e in msgs[-1][2] if isinstance(e, BlocksStored)) == sum(
        map(len, engine.cache.values()))
    await assert_index_matches_engine(nc, engine)
    assert await clears(nc) == 1  # the re-announce's own


@pytest.mark.timeout(120)
async def test_unreplayable_gap_clears_instead_of_guessing(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    shared, _ = await bridged_after_steps(nc, engine, bridges, 5)
    for _ in range(3):
        engine.random_step(shared, send=False)
    engine.buffer.clear()  # the engine's replay buffer no longer has them
    after_gap_seq = engine.seq
    engine.random_step(shared)  # extends a prefix the index no longer holds: not indexed
    fresh = engine.store([engine.rng.randrange(30_000) for _ in range(3 * engine.block_size)])
    await until(lambda: caught_up(nc, "e1", engine), timeout=60, what="caught up after gap")
    msgs = await kv_messages(nc, NAMES.kv_subject("e1"))
    first_after = next(evs for _, h, evs in msgs if int(h.get(H_SEQ, -1)) >= after_gap_seq)
    assert isinstance(first_after[0], AllBlocksCleared)
    # Never a wrong index: what it holds, the engine holds (here it knows less).
    state = await state_from_stream(nc, engine.block_size)
    truth = engine.truth_state("e1")
    assert state.index.total_blocks == len(fresh) < truth.index.total_blocks
    assert all(h in engine.cache[0] for h in fresh)
    assert state.index.find_matches(prompt_hashes(
        [t for h in fresh for t in engine.cache[0][h].tokens], 16)).scores == {("e1", 0): 3}


@pytest.mark.timeout(120)
async def test_engine_restart_clears_and_relearns(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    shared = prefixes(engine)
    bridge = bridges(engine, nc.connected_url.geturl())
    await registered(nc)
    for _ in range(10):
        engine.random_step(shared)
    await assert_index_matches_engine(nc, engine)
    gen_before = (await kv_messages(nc, NAMES.kv_subject("e1")))[-1][1][H_GEN]
    engine.restart()
    for _ in range(4):
        engine.random_step(shared)  # seq 0.. again: the bridge sees the seq go back
    try:
        await assert_index_matches_engine(nc, engine)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- bridge log ---\n{bridge.log()[-4000:]}") from None
    msgs = await kv_messages(nc, NAMES.kv_subject("e1"))
    assert msgs[-1][1][H_GEN] != gen_before
    assert any(isinstance(e, AllBlocksCleared) for _, h, evs in msgs if h[H_GEN] != gen_before
               for e in evs)


@pytest.mark.timeout(120)
async def test_a_restart_seen_twice_clears_once(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    """A restart is seen twice: by the live seq going back and by the start time on /metrics.
    When the engine's HTTP side was too busy to tell the bridge its new start time as it
    cleared, the monitor's later sighting must not clear again what the new run stored since.
    A second clear empties the worker's index until the next batch's gap is replayed, and
    with no next batch it stays empty (seen in CI: the restart test below timed out)."""
    shared = prefixes(engine)
    bridge = bridges(engine, nc.connected_url.geturl(), "e1", "--unhealthy-after", "60",
                     "--engine-http-timeout", "0.3")
    await registered(nc)
    for _ in range(5):
        engine.random_step(shared)
    await assert_index_matches_engine(nc, engine)
    gen_before = (await kv_messages(nc, NAMES.kv_subject("e1")))[-1][1][H_GEN]
    engine.responsive.clear()
    engine.restart()
    for _ in range(4):
        engine.random_step(shared)
    await until(lambda: caught_up(nc, "e1", engine), timeout=60, what="the new run appended")
    answered = engine.metrics_answered
    engine.responsive.set()
    await until(lambda: engine.metrics_answered >= answered + 2, timeout=60,
                what="the monitor read the new start time")
    engine.random_step(shared)
    try:
        await assert_index_matches_engine(nc, engine)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- bridge log ---\n{bridge.log()[-4000:]}") from None
    msgs = await kv_messages(nc, NAMES.kv_subject("e1"))
    clears = [e for _, h, evs in msgs if h[H_GEN] != gen_before for e in evs
              if isinstance(e, AllBlocksCleared)]
    assert len(clears) == 1, bridge.log()[-4000:]


@pytest.mark.timeout(120)
async def test_a_restart_after_a_run_learnt_by_replay_alone(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    """The old run reached the bridge only through its start-up replay (no batch of it came
    live: sent before the bridge subscribed, as a late subscriber misses them), so when the
    engine restarts, the new run's first live batches carry seqs the bridge already appended
    and no live seq goes back: the restart is seen by the start time only, after those batches
    were taken for replayed ones. Seen in CI under load as the restart test's timeout."""
    shared = prefixes(engine)
    for _ in range(6):
        engine.random_step(shared, send=False)  # buffered by the engine, never sent live
    bridge = bridges(engine, nc.connected_url.geturl())
    await registered(nc)
    await assert_index_matches_engine(nc, engine)  # learnt from the start-up replay
    engine.restart()
    for _ in range(3):
        engine.random_step(shared)  # live seqs 0..2: at or below the replayed 5
    try:
        await assert_index_matches_engine(nc, engine)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- bridge log ---\n{bridge.log()[-4000:]}") from None


@pytest.mark.timeout(180)
async def test_bridge_sigkill_under_load_loses_nothing_and_applies_nothing_twice(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    shared = prefixes(engine, 6)
    engine.num_gpu_blocks = 300  # evictions all along
    bridge = bridges(engine, nc.connected_url.geturl())
    await registered(nc)
    stop = asyncio.Event()

    async def load() -> None:  # the engine keeps working through every kill
        while not stop.is_set():
            engine.random_step(shared)
            await asyncio.sleep(0.003)  # pacing of the engine, not synchronisation

    async def appended_seq() -> int:
        try:
            msg = await nc.jetstream().get_last_msg(STREAM, NAMES.kv_subject("e1"))
        except NotFoundError:
            return -1
        return int((msg.headers or {}).get(H_SEQ, -1))

    producer = asyncio.create_task(load())
    for kill in range(3):
        at = await appended_seq()
        # The (restarted) bridge is appending again, past where the last one was killed.
        await until(appended_seq, lambda s, at=at: s > at + 20, timeout=60,
                    what=f"bridge run {kill + 1} appending")
        bridge.kill()
        bridge.start()
    at = await appended_seq()
    await until(appended_seq, lambda s: s > at + 20, timeout=60, what="last run appending")
    stop.set()
    await producer
    try:
        await assert_index_matches_engine(nc, engine)
    except AssertionError as exc:  # seen once in ~10 runs at load 10: keep what explains it
        raise AssertionError(f"{exc}\n--- bridge logs ---\n{bridge.log()[-6000:]}") from None
    msgs = await kv_messages(nc, NAMES.kv_subject("e1"))
    events = all_events(msgs)
    assert sum(isinstance(e, WorkerRegistered) for e in events) == 1
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    ids = [e.event_id for e in events if hasattr(e, "event_id")]  # type: ignore[attr-defined]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "event ids contiguous across restarts"
    seqs = [int(h[H_SEQ]) for _, h, _ in msgs[1:]]
    assert seqs == sorted(set(seqs)) and seqs[-1] == engine.seq - 1
    assert int(msgs[-1][1][H_EVENT_ID]) == ids[-1]
    assert bridge.log().count("resuming e1") == 3, bridge.log()[-3000:]

    # A re-announce from the third restarted bridge is the whole cache (its mirror was rebuilt
    # from the engine's replay buffer), not merely a clear.
    await nc.publish(NAMES.reannounce_subject("all"), b"")
    msgs = await until(lambda: kv_messages(nc, NAMES.kv_subject("e1")),
                       lambda m: isinstance(m[-1][2][0], AllBlocksCleared), what="re-announce")
    assert sum(len(e.blocks) for e in msgs[-1][2] if isinstance(e, BlocksStored)) == sum(
        map(len, engine.cache.values()))
    await assert_index_matches_engine(nc, engine)


@pytest.mark.timeout(120)
async def test_unhealthy_engine_is_retired_and_registered_again(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    await bridged_after_steps(nc, engine, bridges, 1)
    engine.healthy = False
    events = await until(lambda: kv_messages(nc, NAMES.kv_subject("e1")),
                         lambda m: isinstance(all_events(m)[-1], WorkerRetired),
                         timeout=60, what="WorkerRetired")
    assert all_events(events)[-1].reason == "engine unhealthy"  # type: ignore[union-attr]
    engine.healthy = True
    await until(lambda: kv_messages(nc, NAMES.kv_subject("e1")),
                lambda m: isinstance(all_events(m)[-1], WorkerRegistered | BlocksStored),
                timeout=60, what="registered again")
    await assert_index_matches_engine(nc, engine)  # relearned from the replay socket


@pytest.mark.timeout(120)
async def test_a_busy_engine_is_not_retired_while_its_kv_events_flow(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    """Busy is not dead (workers/bridge/monitor.py): the engine's /health and /metrics time out
    (a real vLLM computing long prompts on a loaded host), but its engine core keeps storing
    blocks. The worker stays registered and its load gauges go on; once the KV events stop
    too, it is a hung engine and is retired."""
    shared = prefixes(engine)
    gauges: list[dict] = []  # type: ignore[type-arg]

    async def on_gauge(msg) -> None:  # type: ignore[no-untyped-def]
        gauges.append(json.loads(msg.data))
    await nc.subscribe(NAMES.load_subject("e1"), cb=on_gauge)
    engine.running = 5
    bridges(engine, nc.connected_url.geturl(), "e1", "--engine-http-timeout", "0.3",
            "--unhealthy-after", "3")
    await registered(nc)
    engine.random_step(shared)
    await until(lambda: caught_up(nc, "e1", engine), timeout=60, what="caught up")
    engine.responsive.clear()
    loop = asyncio.get_running_loop()
    busy_until = loop.time() + 8  # well over --unhealthy-after
    seen = len(gauges)
    while loop.time() < busy_until:
        engine.random_step(shared)  # the engine's pace of work, not a wait for the bridge
        await asyncio.sleep(0.2)
    await until(lambda: caught_up(nc, "e1", engine), timeout=60, what="caught up while busy")
    events = all_events(await kv_messages(nc, NAMES.kv_subject("e1")))
    assert not [e for e in events if isinstance(e, WorkerRetired)], "a busy engine was retired"
    during = gauges[seen:]
    assert len(during) >= 3, f"load gauges stopped while the engine was busy: {during}"
    assert all(g["num_running"] == 5 for g in during)  # the last load read stands in
    await assert_index_matches_engine(nc, engine)
    # The KV events stop as well: a hung engine.
    events = await until(lambda: kv_messages(nc, NAMES.kv_subject("e1")),
                         lambda m: isinstance(all_events(m)[-1], WorkerRetired),
                         timeout=60, what="WorkerRetired once the engine stopped working")
    assert all_events(events)[-1].reason == "engine unhealthy"  # type: ignore[union-attr]


@pytest.mark.timeout(120)
async def test_lora_blocks_only_match_their_adapter(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    bridges(engine, nc.connected_url.geturl())
    await registered(nc)
    tokens = [engine.rng.randrange(30_000) for _ in range(4 * engine.block_size)]
    engine.store(tokens, lora="sql-lora")
    await assert_index_matches_engine(nc, engine)
    state = await state_from_stream(nc, engine.block_size)
    assert state.workers["e1"].loras == ["sql-lora"]
    find = state.index.find_matches
    assert find(prompt_hashes(tokens, 16, adapter="sql-lora")).scores == {("e1", 0): 4}
    assert find(prompt_hashes(tokens, 16)).scores == {}
    engine.store(tokens)
    await assert_index_matches_engine(nc, engine)
    state = await state_from_stream(nc, engine.block_size)
    assert state.index.find_matches(prompt_hashes(tokens, 16)).scores == {("e1", 0): 4}


@pytest.mark.timeout(240)  # four process starts, each importing the CLI: slow on a busy machine
async def test_bridge_refuses_bad_flags_with_one_line(tmp_path: Path) -> None:
    for argv, needle in [
        (["--engine-url", "localhost:8000", "--kv-events", "tcp://x:1", "--worker-id", "w"],
         "--engine-url"),
        (["--engine-url", "http://x", "--kv-events", "tcp://x:1", "--worker-id", "a.b"],
         "worker id"),
        (["--engine-url", "http://x", "--kv-events", "x:1", "--worker-id", "w"], "ZMQ endpoint"),
        (["--engine-url", "http://x", "--kv-events", "tcp://x:1", "--worker-id", "w",
          "--block-size", "0"], "positive"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "api.cli", "bridge", *argv],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
async def test_block_size_flag_that_contradicts_the_engine_is_refused(
        nc: NATS, engine: EngineSim, tmp_path: Path) -> None:
    """The bridge registers the engine's real block size (here 16, from /metrics); a --block-size
    that contradicts it is refused before anything is registered."""
    proc = BridgeProc(engine, nc.connected_url.geturl(), "e1", tmp_path, "--block-size", "32")
    proc.start()
    assert proc.proc is not None
    rc = await until(lambda: proc.proc.poll(), lambda r: r is not None, timeout=60,  # type: ignore[union-attr]
                     what="bridge exit")
    assert rc == 2
    assert "--block-size 32 differs from the engine's block size 16" in proc.log()
    assert await kv_messages(nc, NAMES.kv_subject("e1")) == []


@pytest.mark.timeout(120)
async def test_silent_engine_restart_is_seen_in_metrics_and_clears(
        nc: NATS, engine: EngineSim, bridges) -> None:  # type: ignore[no-untyped-def]
    """A restarted engine that sends nothing yet still holds nothing: the new
    process_start_time_seconds in /metrics makes the bridge clear its blocks at once."""
    shared = prefixes(engine)
    bridges(engine, nc.connected_url.geturl())
    await registered(nc)
    for _ in range(3):
        engine.random_step(shared)
    await assert_index_matches_engine(nc, engine)
    engine.restart()  # no batch published: only /metrics tells

    async def indexed() -> int:
        return (await state_from_stream(nc, engine.block_size)).index.total_blocks
    assert await until(indexed, lambda n: n == 0, timeout=60, what="blocks cleared") == 0
    engine.random_step(shared)
    await assert_index_matches_engine(nc, engine)
