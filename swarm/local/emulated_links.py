"""Emulated internet links for a swarm on one machine (a testing aid for tests and benchmarks).

This machine's kernel has no netem or tbf qdiscs, so links are emulated in userspace: each peer gets a relay, a
TCP port on loopback that forwards every connection to the peer's real port, and the peer announces the relay's
address. Every byte to or from the peer then crosses its relay, which gives each peer the link of a home
connection:

- **bandwidth per direction**, shared by all the peer's connections (one token bucket for its uplink, one for its
  downlink);
- **one-way delay**, optionally with **jitter** (bytes stay in order, as TCP keeps them);
- a count of the **bytes it carried** each way, to check the peers' own byte counters against;
- a **cut** (`cut(name)`): from then on every byte to or from the peer is lost and no connection is closed, as
  when a laptop's lid closes or its Wi-Fi drops: the peer's process runs on, and nobody is told.

A connection from peer A to peer B crosses A's uplink and B's downlink (and the way back B's uplink and A's
downlink), with the delay of both links. The relay of B tells that a connection comes from A by its source port:
libp2p dials from its listening port (SO_REUSEPORT), so a connection from A's real port is A's. A connection from
any other port (a process that does not listen) crosses only B's link.

The relays connect only to 127.0.0.1, listen only on 127.0.0.1, and stop by themselves after `lifetime`
seconds (or when their process ends: they run in a daemon thread).

    links = EmulatedLinks()
    relay_port = links.add("peer0", peer_port, LinkSpec.parse("20mbit/25ms"))
    # start the peer with --host-maddrs /ip4/127.0.0.1/tcp/<peer_port>
    #                      --announce-maddrs /ip4/127.0.0.1/tcp/<relay_port>
    links.carried()  # {"peer0": {"up": bytes, "down": bytes}}
    links.close()
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import socket
import threading
import time
from dataclasses import dataclass, field

from swarm.errors import EmulatedLinkError

LOOPBACK = "127.0.0.1"
CHUNK_BYTES = 16384  # bytes read at once; a small chunk keeps the store-and-forward delay of each read small
DEFAULT_LIFETIME = 3600.0


@dataclass(frozen=True)
class LinkSpec:
    """A peer's home link: bits per second each way (None: unlimited), one-way delay and jitter in seconds."""

    up_bits: float | None = None
    down_bits: float | None = None
    delay: float = 0.0
    jitter: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """'20mbit/25ms', '100mbit:20mbit/50ms/5ms' (down:up), 'unlimited/10ms' or 'unlimited'."""
        parts = text.strip().lower().split("/")
        if not 1 <= len(parts) <= 3 or not parts[0]:
            raise EmulatedLinkError(f"a link is RATE[/DELAY[/JITTER]], e.g. 20mbit/25ms, not {text!r}")
        rates = parts[0].split(":")
        if len(rates) > 2:
            raise EmulatedLinkError(f"a link's rate is RATE or DOWN:UP, not {parts[0]!r}")
        down, up = (_rate(rates[0]), _rate(rates[-1]))
        delay = _seconds(parts[1]) if len(parts) > 1 else 0.0
        jitter = _seconds(parts[2]) if len(parts) > 2 else 0.0
        return cls(up_bits=up, down_bits=down, delay=delay, jitter=jitter)

    def describe(self) -> str:
        def rate(bits: float | None) -> str:
            return "unlimited" if bits is None else f"{bits / 1e6:g} Mbit/s"

        text = f"down {rate(self.down_bits)}, up {rate(self.up_bits)}, {self.delay * 1000:g} ms"
        return text + (f" ± {self.jitter * 1000:g} ms" if self.jitter else "")


def _rate(text: str) -> float | None:
    if text in ("unlimited", "inf", ""):
        return None
    match = re.fullmatch(r"([0-9]+\.?[0-9]*|\.[0-9]+)\s*(k|m|g)?bit", text)
    if not match:
        raise EmulatedLinkError(f"a rate is like 20mbit, 500kbit or unlimited, not {text!r}")
    value = float(match.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    if value <= 0:
        raise EmulatedLinkError(f"a rate must be positive, not {text!r}")
    return value


def _seconds(text: str) -> float:
    match = re.fullmatch(r"([0-9]+\.?[0-9]*|\.[0-9]+)\s*(ms|s)", text)
    if not match:
        raise EmulatedLinkError(f"a delay is like 25ms or 0.1s, not {text!r}")
    return float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)


class _Bucket:
    """One direction of a link: bytes leave it at its rate, one after another (shared by all connections)."""

    def __init__(self, bits_per_second: float | None):
        self.bytes_per_second = None if bits_per_second is None else bits_per_second / 8
        self.next_free = 0.0

    def reserve(self, size: int, earliest: float) -> float:
        """When `size` bytes that may start at `earliest` have all passed."""
        if self.bytes_per_second is None:
            return earliest
        start = max(earliest, self.next_free)
        self.next_free = start + size / self.bytes_per_second
        return self.next_free

    def duration(self, size: int) -> float:
        return 0.0 if self.bytes_per_second is None else size / self.bytes_per_second


@dataclass
class _Link:
    name: str
    target_port: int
    spec: LinkSpec
    up: _Bucket = field(init=False)
    down: _Bucket = field(init=False)
    bytes_up: int = 0
    bytes_down: int = 0
    cut: bool = False  # every byte to or from the peer is lost, and no connection is closed (a pulled cable)

    def __post_init__(self) -> None:
        self.up, self.down = _Bucket(self.spec.up_bits), _Bucket(self.spec.down_bits)


class EmulatedLinks:
    """The relays of a local swarm: one per peer, in one asyncio loop on a daemon thread."""

    def __init__(self, lifetime: float = DEFAULT_LIFETIME, seed: int = 0):
        self._links: dict[str, _Link] = {}
        self._by_port: dict[int, _Link] = {}  # a peer's real port -> its link (to know where a connection is from)
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop.run_forever, name="emulated-links", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(lifetime, self.close)
        self._timer.daemon = True
        self._timer.start()

    def add(self, name: str, target_port: int, spec: LinkSpec, relay_port: int = 0) -> int:
        """Put the peer listening on 127.0.0.1:`target_port` behind a link; returns the relay's port."""
        if name in self._links:
            raise EmulatedLinkError(f"there is a link named {name!r} already")
        if not 0 < target_port < 65536:
            raise EmulatedLinkError(f"target port {target_port} is not a port")
        link = _Link(name, target_port, spec)

        async def start() -> int:
            server = await asyncio.start_server(
                lambda r, w: self._accept(link, r, w), LOOPBACK, relay_port, reuse_address=True
            )
            self._servers.append(server)
            return server.sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=10)
        self._links[name] = link
        self._by_port[target_port] = link
        return port

    def peer_flags(self, name: str, spec: LinkSpec) -> list[str]:
        """swarm-peer flags that put a peer behind a new link `name`: it listens on a free loopback port, and
        announces the relay's (later flags win over earlier ones of the same name)."""
        with socket.socket() as probe:  # a free port for the peer (it binds it moments later)
            probe.bind((LOOPBACK, 0))
            port = probe.getsockname()[1]
        relay = self.add(name, port, spec)
        return ["--host-maddrs", f"/ip4/{LOOPBACK}/tcp/{port}", "--announce-maddrs", f"/ip4/{LOOPBACK}/tcp/{relay}"]

    def cut(self, name: str, cut: bool = True) -> None:
        """Cut the peer's link (or mend it, `cut=False`): its bytes are lost, its connections stay open."""
        if name not in self._links:
            raise EmulatedLinkError(f"there is no link named {name!r}")
        self._links[name].cut = cut

    def carried(self) -> dict[str, dict[str, int]]:
        """Bytes each link carried so far: up (sent by its peer) and down (received by it)."""
        return {name: {"up": link.bytes_up, "down": link.bytes_down} for name, link in self._links.items()}

    def close(self) -> None:
        """Stop every relay and close every connection through them."""
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()

        async def stop() -> None:
            for server in self._servers:
                server.close()
            for writer in list(self._writers):  # their pipes then end by themselves (cancelling them would be noisy)
                writer.transport.abort()
            await asyncio.wait(self._tasks, timeout=5) if self._tasks else None

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> EmulatedLinks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ the relaying

    async def _accept(self, link: _Link, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._tasks.add(task)
        source_port = client_writer.get_extra_info("peername")[1]
        source = self._by_port.get(source_port)  # None: a connection from a process that does not listen
        self._writers.add(client_writer)
        try:
            peer_reader, peer_writer = await asyncio.open_connection(LOOPBACK, link.target_port)
        except OSError:
            client_writer.close()
            self._writers.discard(client_writer)
            self._tasks.discard(task)
            return
        self._writers.add(peer_writer)
        try:
            await asyncio.gather(
                self._pipe(client_reader, peer_writer, sender=source, receiver=link),
                self._pipe(peer_reader, client_writer, sender=link, receiver=source),
                return_exceptions=True,
            )
        except BaseException:  # the relays stop: the connection goes with them
            pass
        finally:
            for writer in (client_writer, peer_writer):
                writer.close()
                self._writers.discard(writer)
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sender: _Link | None, receiver: _Link | None
    ) -> None:
        """Bytes one way: through the sender's uplink and the receiver's downlink, then after both delays."""
        in_flight: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()
        done = False

        async def deliver() -> None:
            while in_flight or not done:
                if not in_flight:
                    arrived.clear()
                    await arrived.wait()
                    continue
                at, data = in_flight.popleft()
                await _sleep_until(at)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        delivering = asyncio.create_task(deliver())
        last_delivery = 0.0
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                if (sender is not None and sender.cut) or (receiver is not None and receiver.cut):
                    continue  # lost on the way
                now = time.monotonic()
                passed = now
                delay = 0.0
                if sender is not None:
                    passed = sender.up.reserve(len(data), now)
                    sender.bytes_up += len(data)
                    delay += sender.spec.delay + self._rng.uniform(0, sender.spec.jitter)
                if receiver is not None:
                    # the downlink takes the bytes as they come off the uplink (not after the last one)
                    start = max(now, passed - receiver.down.duration(len(data)))
                    passed = max(passed, receiver.down.reserve(len(data), start))
                    receiver.bytes_down += len(data)
                    delay += receiver.spec.delay + self._rng.uniform(0, receiver.spec.jitter)
                last_delivery = max(last_delivery, passed + delay)  # jitter never reorders bytes
                in_flight.append((last_delivery, data))
                arrived.set()
                await _sleep_until(passed)  # the link is busy until then: read no further ahead
        finally:
            done = True
            arrived.set()
            try:
                await delivering
            except Exception:
                pass


async def _sleep_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
