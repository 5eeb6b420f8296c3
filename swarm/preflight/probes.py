"""The preflight's measurements (the I/O edge; their verdicts are swarm/preflight/checks.py's): a test kernel on the
device, free space on disk, DHT pings of the initial peers (round trip and their clock), the swarm's records and
bandwidth probes of its peers. Every wait has a deadline; every answer from the network is checked before use."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthorizerBase, AuthRole, AuthRPCWrapper
from multiaddr import Multiaddr

from swarm.client.rpc import probe_bandwidth
from swarm.dataset.documents import corpus_files
from swarm.dht.records import Announcement, PeerState, fetch_announcements
from swarm.errors import DataError
from swarm.files import cache_root
from swarm.manifests.manifest import Manifest
from swarm.preflight.checks import DeviceProbe, DiskPlace, no_cuda_reason
from swarm.preflight.swarm_checks import PeerAnswer

logger = logging.getLogger(__name__)

PING_TIMEOUT = 4.0  # seconds for an initial peer to accept a connection, then to answer a ping
PINGS = 2  # per peer; the shortest round trip counts (the first may still be setting the connection up)
RECORDS_TIMEOUT = 6.0  # seconds to read every stage's records
PROBED_PEERS = 2  # stage peers whose links are measured
PROBE_TIMEOUT = 5.0  # seconds for one probe message (2 MiB: 3.4 s at 5 Mbit/s)
BANDWIDTH_DEADLINE = 15.0  # seconds for all the bandwidth probes
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")  # Linux: the loaded NVIDIA kernel module's version
DATA_PER_SOURCE_BYTE = 2  # the token cache of a raw text source: at most 2 bytes a token, at least a byte a token


# --------------------------------------------------------------------------------------------- the device


def probe_device(asked: str) -> DeviceProbe:
    """Run a small matmul on the device --device names (auto: the GPU if torch sees one) and wait for it."""
    if asked == "auto":
        if torch.cuda.is_available():
            device = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            device = "mps"
        else:
            device = "cpu"
    else:
        device = asked
    info = {"name": "", "driver": "", "cuda": ""}
    try:
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(no_cuda_reason(torch.__version__, torch.version.cuda, nvidia_driver()))
            info = {"name": torch.cuda.get_device_name(device), "driver": nvidia_driver(), "cuda": torch.version.cuda}
        a = torch.randn(256, 256, device=device)
        result = float((a @ a).sum())  # .item() waits for the kernel on every device
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if not math.isfinite(result):
            raise RuntimeError("the test matmul gave a non-finite result")
    except Exception as e:  # CUDA and driver errors come as RuntimeError, AssertionError, ...: every one is a fail
        return DeviceProbe(asked, device, ok=False, error=f"{type(e).__name__}: {str(e)[:400]}", **info)
    return DeviceProbe(asked, device, **info)


def nvidia_driver() -> str:
    try:
        words = NVIDIA_DRIVER_FILE.read_text().split()
    except OSError:
        return ""
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ..."
    return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), "")


# ---------------------------------------------------------------------------------------------------- disk


def free_bytes(folder: Path) -> tuple[Path, int]:
    """(the nearest existing folder at or above `folder`, the free space of its file system): a folder that a peer
    would create does not exist yet."""
    folder = folder.expanduser().resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder, shutil.disk_usage(folder).free


def data_cache_need(manifest: Manifest, data: str | None, trainer: bool) -> int | None:
    """Bytes the dataset's token cache would take (under the cache folder): up to DATA_PER_SOURCE_BYTE per byte of
    the files a trainer would read (swarm/dataset/documents.py), nothing for a prepared folder (read in place) or a
    peer that does not train; None if the source is not on this machine (its size is not known)."""
    if not trainer or (data is None and manifest.data.index_sha256):
        return 0
    try:
        _root, files = corpus_files(data or manifest.data.source)
        return DATA_PER_SOURCE_BYTE * sum(f.stat().st_size for f in files)
    except (DataError, OSError):  # not on this machine (a trainer passes --data), or unreadable
        return None


def disk_places(checkpoint_dir: Path, checkpoints: int, data: int | None) -> list[DiskPlace]:
    """The cache folder and the checkpoint folder with their free space and what they would hold; one place when
    both are on the same file system (their needs add up there)."""
    cache, cache_free = free_bytes(cache_root())
    checkpoint_folder, checkpoint_free = free_bytes(checkpoint_dir)
    if os.stat(cache).st_dev == os.stat(checkpoint_folder).st_dev:
        holds = "checkpoints" + (" and the dataset's token cache" if data else "")
        return [DiskPlace(str(checkpoint_folder), checkpoint_free, checkpoints + (data or 0), holds)]
    places = [DiskPlace(str(checkpoint_folder), checkpoint_free, checkpoints, "checkpoints")]
    if data:
        places.append(DiskPlace(str(cache), cache_free, data, "the dataset's token cache"))
    return places


# ------------------------------------------------------------------------------------------------- the swarm


def dht_ping_stub(p2p: P2P, peer: PeerID, authorizer: AuthorizerBase | None) -> AuthRPCWrapper:
    """A stub of a DHT node's own RPCs (hivemind's DHTProtocol): its ping answers with the node's clock. A private
    swarm's nodes answer only requests signed with its secret's authorizer."""
    stub = super(DHTProtocol, DHTProtocol).get_stub(p2p, peer)  # the class's stub, without a DHTProtocol instance
    return AuthRPCWrapper(stub, AuthRole.CLIENT, authorizer, service_public_key=None)


async def ping_initial_peer(p2p: P2P, address: str, authorizer: AuthorizerBase | None) -> PeerAnswer:
    """Connect to one initial peer at its address, then ping its DHT node: the shortest round trip of PINGS, and
    its clock's offset against this machine's from that ping (its time against the middle of the round trip).
    The ping carries no node info, so the peer does not add this short-lived node to its routing table."""
    try:
        peer_id = address.rsplit("/p2p/", 1)[1]
        peer = PeerID.from_base58(peer_id)
        where = Multiaddr(address).decapsulate(Multiaddr(f"/p2p/{peer_id}"))
    except Exception:  # the multiaddr library raises several unrelated types
        return PeerAnswer(address, error="not a peer's multiaddr (/ip4/.../tcp/PORT/p2p/ID)")
    try:
        await asyncio.wait_for(p2p._client.connect(peer, [where]), PING_TIMEOUT)
    except TimeoutError:
        return PeerAnswer(address, error=f"no connection within {PING_TIMEOUT:g} s")
    except Exception as e:  # refused, unreachable, another peer id at that address
        return PeerAnswer(address, error=f"could not connect ({type(e).__name__})")
    try:
        rtt, offset = await best_ping(dht_ping_stub(p2p, peer, authorizer))
    except TimeoutError:
        return PeerAnswer(address, error=f"connected, but its DHT did not answer within {PING_TIMEOUT:g} s")
    except PermissionError:
        return PeerAnswer(address, error="it refused the ping (this clock far off, or another swarm's secret?)")
    except Exception as e:  # reset, not a DHT node
        return PeerAnswer(address, error=f"connected, but its DHT did not answer ({type(e).__name__})")
    return PeerAnswer(address, rtt=rtt, clock_offset=offset)


async def best_ping(stub: AuthRPCWrapper) -> tuple[float, float | None]:
    """(the shortest round trip of PINGS, the peer's clock minus this machine's at that ping; None if it did not
    say). PermissionError if the peer refused the request's signature (a private swarm)."""
    best: tuple[float, float | None] | None = None
    for _ in range(PINGS):
        sent, begin = get_dht_time(), time.monotonic()
        response = await asyncio.wait_for(stub.rpc_ping(dht_pb2.PingRequest(), timeout=PING_TIMEOUT), PING_TIMEOUT)
        rtt, received = time.monotonic() - begin, get_dht_time()
        if response is None:  # hivemind's authorizer wrapper: the reply failed (or the request got) no signature
            raise PermissionError("the ping was refused")
        their_time = response.dht_time  # 0: it did not say; anything else must be a plausible Unix time
        offset = their_time - (sent + received) / 2 if math.isfinite(their_time) and their_time > 0 else None
        if best is None or rtt < best[0]:
            best = (rtt, offset)
    assert best is not None
    return best


async def ping_initial_peers(p2p: P2P, addresses: list[str], authorizer: AuthorizerBase | None) -> list[PeerAnswer]:
    return list(await asyncio.gather(*[ping_initial_peer(p2p, a, authorizer) for a in addresses]))


async def read_announcements(dht, manifest: Manifest) -> list[Announcement] | None:
    """Every stage's valid, signed announcements; None if the DHT did not answer within RECORDS_TIMEOUT."""
    reads = [fetch_announcements(dht, manifest.swarm_id, stage) for stage in range(manifest.num_stages)]
    try:
        found = await asyncio.wait_for(asyncio.gather(*reads), RECORDS_TIMEOUT)
    except Exception as e:  # timed out, or the DHT's process failed
        logger.info(f"reading the swarm's records failed: {e!r}")
        return None
    return [ann for stage in found for ann in stage]


async def measure_bandwidth(
    p2p: P2P, manifest: Manifest, announcements: list[Announcement]
) -> tuple[list[tuple[str, float, float]], str]:
    """(peer, download, upload) bytes/s against up to PROBED_PEERS online stage peers, with the probe that peers
    use at their start (swarm/client/rpc.py); and why none was measured, if so."""
    online = list({ann.peer_id for ann in announcements if ann.state == PeerState.ONLINE})
    peers = random.sample(online, k=min(len(online), PROBED_PEERS))
    measured, errors = [], []
    deadline = time.monotonic() + BANDWIDTH_DEADLINE
    for peer in peers:
        left = deadline - time.monotonic()
        if left <= 1:
            errors.append(f"{peer[-8:]}: no time left")
            break
        try:
            probe = probe_bandwidth(p2p, peer, manifest, timeout=PROBE_TIMEOUT)
            download, upload = await asyncio.wait_for(probe, left)
        except Exception as e:  # gone, too slow, refused
            errors.append(f"{peer[-8:]}: {type(e).__name__}: {str(e)[:100]}")
            continue
        if all(math.isfinite(x) and x > 0 for x in (download, upload)):
            measured.append((peer, download, upload))
    if not peers:
        return [], "no online stage peer to measure against"
    return measured, "; ".join(errors)
