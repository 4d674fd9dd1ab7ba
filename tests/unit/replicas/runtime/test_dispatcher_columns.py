"""At fleet size the dispatcher decides over candidate columns; below ``COLUMNS_FROM_ROWS`` rows
over objects. Both give the same decisions: the same fleet decided both ways, request by request
(cached prefixes, load in flight, health, exclusions, a pinned engine over a busy threshold)."""

from __future__ import annotations

import pytest

from eventlog import events as ev
from eventlog.hashing import prompt_hashes, tokens_hashes
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.selection import BusyThresholds
from replicas.runtime import dispatcher as dispatcher_module
from replicas.runtime.dispatcher import RouteRequest
from tests.unit.replicas.runtime.test_dispatcher import BS, Port, _dispatcher

pytestmark = pytest.mark.timeout(30)
WORKERS = 40
PROMPT = list(range(500, 500 + 12 * BS))


def fleet() -> Port:
    port = Port()
    state = port.state
    state.apply(KV, 1, [ev.WorkerRegistered(f"w{i:02d}", f"http://w{i}", "m", BS, 2000 + i,
                                            4096, 1.0, dp_size=1 + i % 2)
                        for i in range(WORKERS)])
    local = tokens_hashes(PROMPT, BS)
    seq = prompt_hashes(PROMPT, BS)
    kv = 2
    for i in range(0, WORKERS, 3):  # every third worker caches a prefix of its own length
        pairs = [(10_000 * i + j, h) for j, h in enumerate(local[: 1 + i % 12])]
        state.apply(KV, kv, [ev.BlocksStored(f"w{i:02d}", 1, 0, None, pairs, 2.0)])
        kv += 1
    for i in range(0, WORKERS, 4):
        state.apply(ROUTER, i + 1, [ev.RequestRouted(f"q{i}", "r", f"w{i:02d}", 0, 40 * i,
                                                     seq[: i % 7], 0, 8, 0, 3.0)])
    state.apply(CONTROL, 1, [ev.WorkerHealthChanged("w05", "suspicious", "slow", 3.0),
                             ev.WorkerHealthChanged("w07", "unhealthy", "down", 3.0)])
    return port


def decisions(objects: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    monkeypatch.setattr(dispatcher_module, "COLUMNS_FROM_ROWS", 10**9 if objects else 1)
    built = dispatcher_module.build_candidate_columns
    calls = []

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return built(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dispatcher_module, "build_candidate_columns", counted)
    port = fleet()
    port.state.thresholds["m"] = BusyThresholds(active_prefill_tokens_threshold=500)
    d, _ = _dispatcher(port)
    out = []
    for n, (exclude, only) in enumerate([
            (frozenset(), None), (frozenset({"w09", "w12"}), None), (frozenset(), ("w36", 0)),
            (frozenset(), ("w20", 1)), (frozenset({"w00"}), ("w00", 0))]):
        for tokens in (PROMPT, PROMPT[: 5 * BS], PROMPT[:3]):
            req = RouteRequest(f"x{n}-{len(tokens)}", "m", tokens, exclude=exclude)
            result, _, _ = d.decide(req, only=only)
            rows = result.costs.rows()  # what the RequestRouted carries: types too (msgpack)
            out.append((type(result).__name__, getattr(result, "worker", None),
                        getattr(result, "overlap_blocks", None), rows,
                        [tuple(type(v).__name__ for v in row) for row in rows]))
    assert bool(calls) is not objects  # each run took the path it was meant to
    return out


def test_columns_and_objects_decide_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    by_objects = decisions(True, monkeypatch)
    by_columns = decisions(False, monkeypatch)
    assert by_columns == by_objects
    assert any(kind == "Decision" for kind, *_ in by_columns)
    # the pinned engine over its busy threshold keeps the request (the pin bypasses scoring)
    assert ("Decision", ("w36", 0)) in [(k, w) for k, w, *_ in by_columns]

    assert WORKERS * 3 // 2 >= dispatcher_module.COLUMNS_FROM_ROWS  # columns by default too
