"""Ports for what kvlab starts: never one the kernel may hand out to another socket meanwhile."""

from __future__ import annotations

import socket

from kvlab import net


def test_a_free_port_is_below_the_kernels_ephemeral_range_and_bindable() -> None:
    low, _ = net.ephemeral_range()
    ports = {net.free_port() for _ in range(50)}
    assert all(net._LOWEST <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # spread, so that two engines started at once rarely draw the same
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_in_use_is_never_given(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    busy_port, next_port = net._LOWEST + 5, net._LOWEST + 7
    draws = iter([busy_port, busy_port, next_port])

    class Draws:
        def randrange(self, a: int, b: int) -> int:
            return next(draws)

    monkeypatch.setattr(net, "ephemeral_range", lambda: (net._LOWEST + 1000, 60999))
    monkeypatch.setattr(net.random, "SystemRandom", Draws)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", busy_port))
        busy.listen()
        assert net.free_port() == next_port


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(net, "ephemeral_range", lambda: (net._LOWEST + 10, 60999))
    assert net.free_port() >= 1024
