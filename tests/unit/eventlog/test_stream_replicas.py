"""How many replicas a new stream is given, from the connected server's INFO
(eventlog/streams.py `replicas_for_server`)."""

from __future__ import annotations

from eventlog.streams import MAX_REPLICAS, replicas_for_server


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
