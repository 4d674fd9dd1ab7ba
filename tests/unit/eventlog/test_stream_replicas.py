"""How many replicas a new stream is given, from the connected server's INFO
(eventlog/streams.py `replicas_for_server`), and how long a creation waits for a cluster to
place them (`create_placed`)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError

from eventlog.streams import MAX_REPLICAS, create_placed, replicas_for_server


def urls(n: int) -> list[str]:
    return [f"10.0.0.{i}:4222" for i in range(n)]


def test_a_server_outside_a_cluster_gets_one() -> None:
    assert replicas_for_server({}) == 1
    assert replicas_for_server({"connect_urls": urls(3)}) == 1


def test_a_cluster_still_forming_is_not_guessed_smaller_than_three() -> None:
    # A node with a route to one peer so far gossips two members, or none at all.
    assert replicas_for_server({"cluster": "c", "connect_urls": urls(2)}) == 3
    assert replicas_for_server({"cluster": "c", "connect_urls": urls(1)}) == 3
    assert replicas_for_server({"cluster": "c"}) == 3
    assert replicas_for_server({"cluster": "c", "connect_urls": None}) == 3


def test_a_bigger_cluster_gets_its_size_up_to_the_cap() -> None:
    assert replicas_for_server({"cluster": "c", "connect_urls": urls(4)}) == 4
    assert replicas_for_server({"cluster": "c", "connect_urls": urls(9)}) == MAX_REPLICAS


@pytest.mark.timeout(30)
async def test_the_placement_wait_starts_at_the_first_refusal_not_the_first_attempt() -> None:
    """A create that goes unanswered for longer than the placement wait (no meta leader yet),
    then is refused while the last members join, still gets the whole wait before it steps
    down: the stream is created with the replicas asked for."""
    started = time.monotonic()
    asked: list[int] = []

    async def create(replicas: int) -> int:
        asked.append(replicas)
        elapsed = time.monotonic() - started
        if elapsed < 0.4:
            await asyncio.sleep(0.02)
            raise NatsTimeoutError  # no meta leader: unanswered
        if elapsed < 0.6 and replicas == 3:
            raise APIError(code=500, err_code=10023, description="insufficient resources")
        return replicas

    got = await asyncio.wait_for(
        create_placed(None, create, 3, what="stream X", step_down=True,  # type: ignore[arg-type]
                      placement_wait=0.3), 10)
    assert got == 3 and 2 not in asked
