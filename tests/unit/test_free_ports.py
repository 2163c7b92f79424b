"""Ports picked for a child to bind later are ones nothing else on the machine takes by itself."""

from __future__ import annotations

import socket
from pathlib import Path

from runtime.server import free_ports


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_are_drawn_below_the_ephemeral_range_where_no_outgoing_connection_lands() -> None:
    low, _ = _ephemeral_range()
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert all(10000 <= port < low for port in ports), ports


def test_drawn_ports_are_bindable_on_loopback() -> None:
    for port in free_ports(3):
        with socket.socket() as child:
            child.bind(("127.0.0.1", port))
