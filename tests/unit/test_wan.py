"""The benchmarks' link emulator (tests/wan.py): it adds the one-way delay each way and caps bandwidth."""

from __future__ import annotations

import socket
import threading
import time

from tests.wan import delay_proxy


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def _round_trip(port: int, payload: bytes) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        began = time.perf_counter()
        conn.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += conn.recv(1 << 16)
        assert got == payload
        return time.perf_counter() - began


def test_a_round_trip_through_the_proxy_takes_two_one_way_delays():
    server, thread = _echo_server()
    with server, delay_proxy(server.getsockname()[1], 0.05) as proxy:
        rtt = _round_trip(proxy.port, b"ping")
    thread.join(5)
    assert 0.1 <= rtt < 0.2


def test_the_bandwidth_cap_paces_a_large_transfer():
    server, thread = _echo_server()
    with server, delay_proxy(server.getsockname()[1], 0.0, bytes_per_s=2_000_000) as proxy:
        rtt = _round_trip(proxy.port, bytes(400_000))  # 0.2 s at 2 MB/s; the echo streams back meanwhile
    thread.join(5)
    assert 0.19 <= rtt < 0.6
