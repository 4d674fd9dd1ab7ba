"""RequestQueue policies (fcfs / lcfs / wspt), priority jumps, removal, and should_queue."""

from __future__ import annotations

import pytest

from replicas.core.queue import RequestQueue, queue_key, should_queue
from replicas.core.selection import Candidate


def drain(q: RequestQueue) -> list:
    out = []
    while (item := q.pop()) is not None:
        out.append(item)
    return out


def test_fcfs_serves_earliest_arrival_first() -> None:
    q: RequestQueue[str] = RequestQueue("fcfs")
    q.push("late", arrival=3.0)
    q.push("early", arrival=1.0)
    q.push("mid", arrival=2.0)
    assert len(q) == 3
    assert q.peek() == "early"
    assert drain(q) == ["early", "mid", "late"]
    assert q.pop() is None and q.peek() is None and len(q) == 0


def test_lcfs_serves_latest_arrival_first() -> None:
    q: RequestQueue[str] = RequestQueue("lcfs")
    for name, t in (("a", 1.0), ("c", 3.0), ("b", 2.0)):
        q.push(name, arrival=t)
    assert drain(q) == ["c", "b", "a"]


def test_wspt_serves_shortest_uncached_work_first() -> None:
    q: RequestQueue[str] = RequestQueue("wspt")
    q.push("long", arrival=1.0, uncached_isl_tokens=8000)
    q.push("short", arrival=2.0, uncached_isl_tokens=100)
    q.push("mid", arrival=3.0, uncached_isl_tokens=1000)
    q.push("cached", arrival=4.0, uncached_isl_tokens=0)  # fully cached: treated as 1 token
    assert drain(q) == ["cached", "short", "mid", "long"]


def test_priority_jump_moves_a_request_ahead() -> None:
    q: RequestQueue[str] = RequestQueue("fcfs")
    q.push("first", arrival=10.0)
    q.push("second", arrival=11.0)
    q.push("vip", arrival=12.0, priority_jump=5.0)  # key 5-12 = -7 beats -10 and -11
    q.push("small-jump", arrival=13.0, priority_jump=1.0)  # key -12: still behind the others
    assert drain(q) == ["vip", "first", "second", "small-jump"]

    w: RequestQueue[str] = RequestQueue("wspt")
    w.push("short", arrival=0.0, uncached_isl_tokens=100)  # 1/100
    w.push("long-vip", arrival=0.0, priority_jump=19.0, uncached_isl_tokens=1000)  # 20/1000
    assert drain(w) == ["long-vip", "short"]


@pytest.mark.parametrize("policy", ["fcfs", "lcfs", "wspt"])
def test_equal_keys_keep_insertion_order(policy: str) -> None:
    q: RequestQueue[int] = RequestQueue(policy)
    for i in range(50):
        q.push(i, arrival=7.0, uncached_isl_tokens=64)
    assert drain(q) == list(range(50))


def test_remove_drops_a_waiting_item() -> None:
    q: RequestQueue[object] = RequestQueue("fcfs")
    a, b, c = object(), object(), object()
    q.push(a, arrival=1.0)
    q.push(b, arrival=2.0)
    q.push(c, arrival=3.0)
    assert q.remove(a)
    assert not q.remove(a)
    assert len(q) == 2
    assert q.peek() is b
    assert drain(q) == [b, c]


def test_heap_is_compacted_after_many_removals() -> None:
    q: RequestQueue[int] = RequestQueue("fcfs")
    for i in range(500):
        q.push(i, arrival=float(i))
    for i in range(1, 500):
        assert q.remove(i)
    assert len(q._heap) <= 2 * len(q) + 64
    assert drain(q) == [0]


def test_queue_key_formulas_and_unknown_policy() -> None:
    assert queue_key("fcfs", 10.0, 2.0, 0) == -8.0
    assert queue_key("lcfs", 10.0, 2.0, 0) == 12.0
    assert queue_key("wspt", 10.0, 3.0, 200) == 4.0 / 200
    with pytest.raises(ValueError):
        RequestQueue("sjf")


def _c(prefill: int, mnbt: int = 1000) -> Candidate:
    return Candidate(("w", 0), 0, 0, prefill, 0, 0, 100, mnbt)


def test_should_queue_only_while_every_worker_is_over_threshold() -> None:
    assert should_queue([_c(4001), _c(9000)], 4.0)
    assert not should_queue([_c(4001), _c(4000)], 4.0)  # one worker at exactly 4x: not over
    # the threshold scales with each worker's own max_num_batched_tokens
    assert should_queue([_c(4001), _c(41, mnbt=10)], 4.0)
    assert not should_queue([_c(4001), _c(40, mnbt=10)], 4.0)
    assert not should_queue([], 4.0)
