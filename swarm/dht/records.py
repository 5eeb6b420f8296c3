"""DHT keys and the small records peers keep there: announcements of stage servers and trainer reports, their
validation, and reading and writing them (a peer's cached view of them is swarm/dht/announcement_cache.py).

Every key starts with the swarm id, so that swarms with different settings can share one DHT and never mix.
Records are dictionaries keyed by peer id (a DHT "subkey"), each subkey with its own expiration. Records
read from the DHT come from strangers: they are validated, and invalid ones are dropped.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm import PROTOCOL_VERSION, __version__
from swarm.errors import MalformedDataError
from swarm.network.coordinates import Coordinate


class PeerState(StrEnum):
    """Where a peer stands with its stage, as announced."""

    JOINING = "joining"  # chose the stage, is taking over its state; counted by balancing, not yet routed to
    ONLINE = "online"  # serves the stage
    OFFLINE = "offline"  # stopped serving it (left, or moved away)
    PAUSED = "paused"  # its owner paused it: takes no microbatches, keeps the stage's state and hands it out
    LEAVING = "leaving"  # stops soon: takes no microbatches, hands its state to the peer that takes the stage over


MAX_TEXT = 256
MAX_ADDRESSES = 8
PEER_ID_PATTERN = re.compile(r"[1-9A-HJ-NP-Za-km-z]{8,128}")  # base58
MAX_COUNT = 2**53
MAX_ATTESTED_PEERS = 64  # stage peers a trainer report vouches for (the ones that served it most)
MAX_THROUGHPUT = 1e6  # samples per second; far above any real device for the models this runs
MAX_LIFETIME = 3600.0  # records that claim to live longer than this are dropped on read
DHT_TIMEOUT = 10.0  # seconds for one DHT read or write


LIFETIME_PERIODS = 3  # an announcement lives this many announce periods: one lost write does not drop a peer
DHT_CALL_TIMEOUT = 3.0  # hivemind's wait_timeout: a DHT node that vanished holds up each search this long


def announcement_lifetime(announce_period: float) -> float:
    """How long a record lives: LIFETIME_PERIODS periods, and at least two periods and one DHT call's timeout. A
    store that meets a vanished DHT node (a peer that froze) waits out the timeout before it lands; were the record
    it replaces gone by then, healthy peers would drop out of every view at once (seen with a 1 s period: every
    stage read empty for 3 s after one peer froze)."""
    return max(LIFETIME_PERIODS * announce_period, 2 * announce_period + DHT_CALL_TIMEOUT)


def is_loopback(addr: str) -> bool:
    """Whether a multiaddr points at this machine only (useless to peers on other machines)."""
    return "/127.0.0.1/" in addr or "/::1/" in addr


def announceable(addrs: list[str]) -> tuple[str, ...]:
    """The addresses a record can carry: short enough, at most MAX_ADDRESSES, and only those others could reach:
    no loopback address beside another (a peer on another machine would dial its own loopback; in an
    all-loopback swarm they are all there is)."""
    return tuple(without_loopback_unless_only([a for a in addrs if len(a) <= MAX_TEXT])[:MAX_ADDRESSES])


def without_loopback_unless_only(addrs: list[str]) -> list[str]:
    """The addresses peers on other machines could dial: all but loopback ones, unless only those exist."""
    return [a for a in addrs if not is_loopback(a)] or list(addrs)


def stage_key(swarm_id: str, stage: int) -> str:
    return f"{swarm_id}.stage.{stage}"


def trainers_key(swarm_id: str) -> str:
    return f"{swarm_id}.trainers"


def data_key(swarm_id: str) -> str:
    """The trainers' data progress (swarm/dataset/progress.py)."""
    return f"{swarm_id}.data"


def checkpoints_key(swarm_id: str) -> str:
    """The checkpoints each peer keeps (swarm/server/checkpoint_sharing.py)."""
    return f"{swarm_id}.checkpoints"


def protected_keys(swarm_id: str, num_stages: int) -> list[str]:
    """The keys whose records only the peer named by their subkey may write (swarm/trust/signing.py)."""
    stages = [stage_key(swarm_id, stage) for stage in range(num_stages)]
    return [*stages, trainers_key(swarm_id), data_key(swarm_id), checkpoints_key(swarm_id)]


@dataclass(frozen=True)
class Announcement:
    """What a stage server says about itself."""

    peer_id: str
    stage: int
    state: PeerState
    throughput: float  # samples per second it can serve: the lower of its compute and network limits
    compute_throughput: float = 0.0  # samples per second of forward+backward on its device
    network_throughput: float = 0.0  # samples per second its links allow for this stage
    delivered_throughput: float = 0.0  # EMA of the samples per second it actually served
    samples_served: int = 0
    outstanding: int = 0  # requests accepted and not yet answered
    uptime: float = 0.0  # seconds since the peer started
    pinned: bool = False  # serves this stage by the user's choice (--stage): never moves
    device: str = "cpu"
    public_name: str = ""
    optimizer_steps: int = 0  # local optimizer steps of the stage's state this peer holds
    averaging_round: int = 0  # number of the stage's next averaging round, as this peer knows it
    round_samples: int = 0  # samples this peer processed since that round began
    averaging_rounds: int = 0  # rounds this peer averaged in with at least one other peer
    activation_bytes_sent: int = 0  # activations and gradients, to and from other peers (server and trainer)
    activation_bytes_received: int = 0
    averaging_bytes_sent: int = 0  # payload of averaging rounds
    averaging_bytes_received: int = 0
    # versions of the weights between a microbatch's forward here and the weights its gradient was applied to,
    # over its last gradients (swarm/server/compute.py): 0 under the step gate (training.pipelining flush)
    staleness_mean: float = 0.0
    staleness_max: int = 0
    memory_used: int = 0  # bytes the peer holds (swarm/capacity/budget.py); 0: not announced
    memory_available: int = 0  # bytes it may use
    steps_behind: int = 0  # optimizer steps the state it took over was behind the stage's (trained state lost then)
    reachable: bool = True  # False: others cannot dial it (NAT, firewall); it dials them (swarm/server/reachability.py)
    maddrs: tuple[str, ...] = ()  # where to dial it; an unreachable peer dials these of the others
    coordinate: Coordinate | None = None  # its network coordinate (swarm/network/coordinates.py); None: not announced
    version: str = __version__
    protocol_version: int = PROTOCOL_VERSION
    expiration: float = 0.0  # filled in when read from the DHT

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("expiration")
        record["state"] = str(self.state)  # a plain string on the wire
        record["coordinate"] = self.coordinate.to_record() if self.coordinate is not None else None
        return record


@dataclass(frozen=True)
class TrainerReport:
    """What a trainer says about its recent progress."""

    peer_id: str
    loss: float
    samples_per_second: float
    samples: int
    failed_microbatches: int = 0
    maddrs: tuple[str, ...] = ()  # where to dial it (stage peers that others cannot dial open connections here)
    # samples each stage peer trained for this trainer since it started, as this trainer saw them done: what
    # the stage peers' contributions are ranked by (their own `samples_served` is only their claim)
    served: tuple[tuple[str, int], ...] = ()
    # samples this trainer ran through its own peer's server: not an attestation (a peer cannot vouch for itself),
    # but what lets a monitor compare a peer's own count with what trainers attest (swarm/monitor/leaderboard.py)
    own_samples: int = 0
    expiration: float = 0.0

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("expiration")
        record["served"] = {peer_id: samples for peer_id, samples in self.served}
        return record


def parse_announcement(subkey: Any, record: Any, stage: int, expiration: float) -> Announcement | None:
    """Validate one announcement read from the DHT; None if it is malformed or of another protocol."""
    try:
        if not isinstance(record, dict) or record.get("protocol_version") != PROTOCOL_VERSION:
            return None
        ann = Announcement(
            peer_id=_peer_id(record["peer_id"]),
            stage=_count(record["stage"]),
            state=PeerState(_text(record["state"])),
            throughput=_rate(record["throughput"]),
            compute_throughput=_rate(record["compute_throughput"]),
            network_throughput=_rate(record["network_throughput"]),
            delivered_throughput=_rate(record["delivered_throughput"]),
            samples_served=_count(record["samples_served"]),
            outstanding=_count(record["outstanding"]),
            uptime=_duration(record["uptime"]),
            pinned=_flag(record["pinned"]),
            device=_printable(record["device"]),
            public_name=_printable(record["public_name"]),
            optimizer_steps=_count(record["optimizer_steps"]),
            averaging_round=_count(record["averaging_round"]),
            round_samples=_count(record["round_samples"]),
            averaging_rounds=_count(record["averaging_rounds"]),
            activation_bytes_sent=_count(record["activation_bytes_sent"]),
            activation_bytes_received=_count(record["activation_bytes_received"]),
            averaging_bytes_sent=_count(record["averaging_bytes_sent"]),
            averaging_bytes_received=_count(record["averaging_bytes_received"]),
            staleness_mean=_rate(record.get("staleness_mean", 0.0)),  # optional: added to protocol 4 later
            staleness_max=_count(record.get("staleness_max", 0)),
            memory_used=_count(record.get("memory_used", 0)),  # optional: added to protocol 7 later (spans)
            memory_available=_count(record.get("memory_available", 0)),
            steps_behind=_count(record.get("steps_behind", 0)),  # optional: added to protocol 7 later
            reachable=_flag(record.get("reachable", True)),  # optional: added to protocol 3 later
            maddrs=_addresses(record.get("maddrs", [])),
            coordinate=None if record.get("coordinate") is None else Coordinate.from_record(record["coordinate"]),
            version=_printable(record["version"]),
            expiration=float(expiration),
        )
    except (KeyError, ValueError):  # a MalformedDataError (a ValueError), or a state PeerState does not know
        return None
    if ann.peer_id != subkey or ann.stage != stage:
        return None
    return ann


def parse_trainer_report(subkey: Any, record: Any, expiration: float) -> TrainerReport | None:
    """Validate one trainer report read from the DHT; None if it is malformed."""
    try:
        if not isinstance(record, dict):
            return None
        loss = record["loss"]
        if not isinstance(loss, float) or not (loss != loss or 0 <= loss < 1e6):  # NaN: no microbatch done yet
            return None
        report = TrainerReport(
            peer_id=_peer_id(record["peer_id"]),
            loss=loss,
            samples_per_second=_rate(record["samples_per_second"]),
            samples=_count(record["samples"]),
            failed_microbatches=_count(record["failed_microbatches"]),
            maddrs=_addresses(record.get("maddrs", [])),
            served=_served(record.get("served", {})),
            own_samples=_count(record.get("own_samples", 0)),
            expiration=float(expiration),
        )
    except (KeyError, ValueError):
        return None
    return report if report.peer_id == subkey else None


def _served(value: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, dict) or len(value) > MAX_ATTESTED_PEERS:
        raise MalformedDataError("not a table of samples served")
    return tuple((_peer_id(peer_id), _count(samples)) for peer_id, samples in value.items())


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise MalformedDataError("not a short string")
    return value


def _peer_id(value: Any) -> str:
    """A libp2p peer id as text: base58 only (it is shown, used as a key and parsed by libp2p)."""
    if not isinstance(value, str) or not PEER_ID_PATTERN.fullmatch(value):
        raise MalformedDataError("not a peer id")
    return value


def _printable(value: Any) -> str:
    """Text shown to people (names, devices, versions): no control characters, no terminal escapes."""
    text = _text(value)
    if not text.isprintable():
        raise MalformedDataError("not printable")
    return text


def _addresses(value: Any) -> tuple[str, ...]:
    """A few short strings; whether they are multiaddrs is checked where they are dialed."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_ADDRESSES:
        raise MalformedDataError("not a list of addresses")
    return tuple(_text(item) for item in value)


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
        raise MalformedDataError("not a count")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise MalformedDataError("not a boolean")
    return value


def _duration(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1e10:
        raise MalformedDataError("not a duration")
    return float(value)


def _rate(value: Any) -> float:
    """A throughput: finite, non-negative and at most MAX_THROUGHPUT (a stranger's claim must not swamp routing)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= MAX_THROUGHPUT:
        raise MalformedDataError("not a throughput")  # NaN fails the range check too
    return float(value)


# ------------------------------------------------------------------------------------------------ DHT I/O


async def store_subkeyed(dht: DHT, key: str, subkey: str, record: dict[str, Any], lifetime: float) -> bool:
    """Store one peer's record under `key` (its subkey: the peer's id), for `lifetime` seconds."""
    future = dht.store(key, record, expiration_time=get_dht_time() + lifetime, subkey=subkey, return_future=True)
    return await asyncio.wait_for(future, DHT_TIMEOUT)


async def fetch_subkeyed(dht: DHT, key: str) -> list[tuple[Any, Any]]:
    """(subkey, item) of every unexpired record under `key`; each caller parses and validates the values."""
    found = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), DHT_TIMEOUT)
    return _entries(found)


async def store_announcement(dht: DHT, swarm_id: str, ann: Announcement, lifetime: float) -> bool:
    return await store_subkeyed(dht, stage_key(swarm_id, ann.stage), ann.peer_id, ann.to_record(), lifetime)


async def store_trainer_report(dht: DHT, swarm_id: str, report: TrainerReport, lifetime: float) -> bool:
    return await store_subkeyed(dht, trainers_key(swarm_id), report.peer_id, report.to_record(), lifetime)


async def fetch_announcements(dht: DHT, swarm_id: str, stage: int) -> list[Announcement]:
    """All valid, unexpired announcements of a stage (any state)."""
    return [
        ann
        for subkey, item in await fetch_subkeyed(dht, stage_key(swarm_id, stage))
        if (ann := parse_announcement(subkey, item.value, stage, item.expiration_time)) is not None
    ]


async def fetch_trainer_reports(dht: DHT, swarm_id: str) -> list[TrainerReport]:
    return [
        report
        for subkey, item in await fetch_subkeyed(dht, trainers_key(swarm_id))
        if (report := parse_trainer_report(subkey, item.value, item.expiration_time)) is not None
    ]


def _entries(found: Any) -> list[tuple[Any, Any]]:
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    return [
        (subkey, item)
        for subkey, item in found.value.items()
        if now < item.expiration_time <= now + MAX_LIFETIME  # far-future records would outlive their owner
    ]
