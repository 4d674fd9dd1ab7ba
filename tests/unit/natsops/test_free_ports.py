"""`natsops.server.free_port(s)`, `free_port_run`: ports to listen on, safe from outgoing
connections."""

from __future__ import annotations

import socket
from pathlib import Path

from natsops.server import free_port, free_port_run, free_ports


def ephemeral_low() -> int | None:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError):
        return None


def test_ports_are_distinct_bindable_and_never_handed_out_twice() -> None:
    first = free_ports(20)
    again = free_ports(20)
    assert len(set(first + again)) == 40
    for port in first[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ports_lie_below_the_ephemeral_range_where_the_kernel_says_where_it_is() -> None:
    low = ephemeral_low()
    ports = [free_port() for _ in range(50)]
    if low is not None and low > 12_000:
        assert all(p < low for p in ports), (low, ports)


def test_a_run_of_ports_is_consecutive_bindable_and_not_handed_out_again() -> None:
    first = free_port_run(16)
    run = range(first, first + 16)
    again = free_port_run(16)
    assert set(run).isdisjoint(range(again, again + 16))
    assert set(run).isdisjoint(free_ports(20))
    for port in run:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    low = ephemeral_low()
    if low is not None and low > 12_000:
        assert run[-1] < low
