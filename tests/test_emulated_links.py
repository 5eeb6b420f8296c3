"""The emulated links (swarm/local/emulated_links.py): delay, bandwidth shared by a peer's connections, both ends of a
connection, byte counts, and specs that do not parse. Real sockets on loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from swarm.errors import EmulatedLinkError
from swarm.local.emulated_links import EmulatedLinks, LinkSpec


class EchoServer:
    """A TCP server on loopback that sends back what it gets (or, with `sink`, counts and drops it)."""

    def __init__(self, sink: bool = False):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sink = sink
        self.received = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += len(data)
                if not self.sink:
                    conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


def round_trip(port: int, size: int = 100) -> float:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"x")
        conn.recv(10)  # the first exchange opens the path
        begin = time.monotonic()
        conn.sendall(b"y" * size)
        got = 0
        while got < size:
            got += len(conn.recv(65536))
        return time.monotonic() - begin


def send_all(port: int, size: int, source_port: int | None = None) -> None:
    conn = socket.socket()
    if source_port is not None:  # as libp2p dials: from its listening port
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        conn.bind(("127.0.0.1", source_port))
    with conn:
        conn.connect(("127.0.0.1", port))
        conn.sendall(b"z" * size)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the sink closes when it has read everything


def wait_received(server: EchoServer, size: int, timeout: float = 20.0) -> float:
    begin = time.monotonic()
    while server.received < size:
        assert time.monotonic() - begin < timeout, f"only {server.received} of {size} bytes arrived"
        time.sleep(0.005)
    return time.monotonic()


# Timing on a loaded 2-core machine: a delay or a rate limit makes a transfer take at least so long (the lower
# bounds prove that it is applied); how much longer it takes depends on the load, so the upper bounds are loose:
# they only catch a delay or rate applied several times over, or in the wrong unit.


def test_delay_adds_a_round_trip_of_twice_the_one_way_delay():
    server = EchoServer()
    with EmulatedLinks(lifetime=60) as links:
        plain = min(round_trip(server.port) for _ in range(3))
        relay = links.add("peer", server.port, LinkSpec.parse("unlimited/25ms"))
        delayed = min(round_trip(relay) for _ in range(3))
        assert 0.05 <= delayed < 0.05 + 0.2, delayed  # 25 ms each way, once
        assert delayed > plain, (delayed, plain)
        # the echo came back through the relay: both directions counted
        assert links.carried()["peer"] == {"up": 101 * 3, "down": 101 * 3}
    server.close()


def test_bandwidth_is_shared_by_all_connections_of_a_peer():
    server = EchoServer(sink=True)
    size = 1_250_000  # 10 Mbit
    with EmulatedLinks(lifetime=60) as links:
        relay = links.add("peer", server.port, LinkSpec.parse("20mbit/5ms"))
        begin = time.monotonic()
        send_all(relay, size)
        one = time.monotonic() - begin
        assert 0.45 <= one < 0.5 * 4, one  # 10 Mbit at 20 Mbit/s: 0.5 s

        begin = time.monotonic()
        threads = [threading.Thread(target=send_all, args=(relay, size)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        two = time.monotonic() - begin
        # twice the bytes through the same downlink: twice the time (each connection its own 20 Mbit/s: 0.5 s)
        assert 0.95 <= two < 1.0 * 4, two
        assert links.carried()["peer"]["down"] == 3 * size
    server.close()


def test_a_connection_from_another_peer_crosses_that_peers_uplink_too():
    sink = EchoServer(sink=True)
    sender_port = socket.create_server(("127.0.0.1", 0), reuse_port=True)  # the sender "listens" here
    size = 500_000
    with EmulatedLinks(lifetime=60) as links:
        relay = links.add("receiver", sink.port, LinkSpec.parse("100mbit/1ms"))
        links.add("sender", sender_port.getsockname()[1], LinkSpec.parse("100mbit:8mbit/1ms"))
        begin = time.monotonic()
        send_all(relay, size, source_port=sender_port.getsockname()[1])
        took = time.monotonic() - begin
        assert took >= 0.45, took  # 4 Mbit through the sender's 8 Mbit/s uplink, not the receiver's 100 Mbit/s
        carried = links.carried()
        assert carried["sender"]["up"] == size and carried["receiver"]["down"] == size
    sender_port.close()
    sink.close()


def test_a_cut_link_loses_every_byte_and_closes_nothing_until_it_is_mended():
    server = EchoServer()
    with EmulatedLinks(lifetime=60) as links:
        relay = links.add("peer", server.port, LinkSpec.parse("unlimited/1ms"))
        with socket.create_connection(("127.0.0.1", relay)) as conn:
            conn.sendall(b"a")
            assert conn.recv(10) == b"a"
            links.cut("peer")
            conn.sendall(b"b")
            conn.settimeout(1.0)
            with pytest.raises(TimeoutError):  # no echo, and no close (recv would return b"")
                conn.recv(10)
            assert server.received == 1
            links.cut("peer", False)
            conn.sendall(b"c")
            assert conn.recv(10) == b"c"  # what was sent during the cut is gone for good
        with pytest.raises(EmulatedLinkError, match="no link named"):
            links.cut("nobody")
    server.close()


def test_relays_stop_by_themselves():
    server = EchoServer()
    links = EmulatedLinks(lifetime=0.5)
    relay = links.add("peer", server.port, LinkSpec())
    round_trip(relay)  # it relays while it lives
    deadline = time.monotonic() + 20
    while True:  # gone after its lifetime (0.5 s; later on a busy machine): a connection is refused
        try:
            round_trip(relay)
        except OSError:
            break
        assert time.monotonic() < deadline, "the relay still works 20 s after its lifetime of 0.5 s"
        time.sleep(0.1)
    links.close()  # closing again is harmless
    server.close()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("20mbit/25ms", LinkSpec(up_bits=20e6, down_bits=20e6, delay=0.025)),
        ("100mbit:20mbit/50ms/5ms", LinkSpec(up_bits=20e6, down_bits=100e6, delay=0.05, jitter=0.005)),
        ("unlimited", LinkSpec()),
        ("500kbit/0.1s", LinkSpec(up_bits=5e5, down_bits=5e5, delay=0.1)),
    ],
)
def test_specs_parse(text, expected):
    assert LinkSpec.parse(text) == expected


@pytest.mark.parametrize(
    "text", ["", "fast", "20mbps", "20mbit/25", "0mbit", "1:2:3mbit", "1.2.3mbit", "20mbit/25ms/1ms/2ms"]
)
def test_bad_specs_say_what_a_spec_looks_like(text):
    with pytest.raises(EmulatedLinkError, match="like|is RATE|rate"):
        LinkSpec.parse(text)
