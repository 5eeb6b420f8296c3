"""Reading a swarm from outside, as `peer-status` and `swarm-monitor` do: records from the DHT, then a document.

A `SwarmReader` remembers the peers it saw before, so that a peer whose records vanished is still shown for a
while, as "gone" (with `departure`: "left" if its last record said it stopped, "vanished" if its records just
stopped coming), instead of silently disappearing from the table. It reads the trainers' data progress too
(`<swarm id>.data`, swarm/dataset/progress.py), summarised under "data" (swarm/watch/data_progress.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.dataset.progress import ReaderRecord, fetch_reader_records
from swarm.dht.records import Announcement, TrainerReport, fetch_announcements, fetch_trainer_reports
from swarm.errors import SwarmError
from swarm.manifests.manifest import Manifest
from swarm.watch.data_progress import data_progress
from swarm.watch.status import swarm_health

logger = logging.getLogger(__name__)

GONE_AFTER = 600.0  # a peer that vanished is shown as "gone" for this many seconds


async def read_records(dht: DHT, manifest: Manifest) -> tuple[list[list[Announcement]], list[TrainerReport]]:
    """Every stage's announcements and the trainers' reports; SwarmError if the DHT does not answer."""
    try:
        results = await asyncio.gather(
            *[fetch_announcements(dht, manifest.swarm_id, stage) for stage in range(manifest.num_stages)],
            fetch_trainer_reports(dht, manifest.swarm_id),
        )
    except Exception as e:  # the DHT process died or timed out
        raise SwarmError(f"could not read the swarm's records from the DHT ({type(e).__name__}: {e})") from None
    return list(results[:-1]), results[-1]


async def read_reader_records(dht: DHT, manifest: Manifest) -> list[ReaderRecord] | None:
    """The trainers' reader records, of any data (each checked against its own count of chunks; the summary keeps
    those of the manifest's data, or of the most common data for a raw source); None if the DHT does not answer:
    the rest of the read stands without them."""
    try:
        return await fetch_reader_records(dht, manifest.swarm_id, None, None)
    except Exception as e:
        logger.debug(f"reading the trainers' data progress failed: {e!r}")
        return None


class SwarmReader:
    """The swarm as last read, with the peers that vanished since shown as "gone" for GONE_AFTER seconds."""

    def __init__(self, manifest: Manifest, source: str, gone_after: float = GONE_AFTER):
        self.manifest, self.source, self.gone_after = manifest, source, gone_after
        self.seen: dict[str, dict[str, Any]] = {}  # peer id -> its last document, with the time it was seen

    async def read(self, dht: DHT) -> tuple[dict[str, Any], list[TrainerReport]]:
        """(the swarm's document, the trainers' reports it was made from); SwarmError if the DHT does not answer.

        Records are aged from the moment the read began: a read takes seconds on a loaded machine (or a slow DHT),
        and a peer that refreshed its record just before it is not 'stale' because this reader was slow. The
        document says how long the read took (`read_seconds`)."""
        began = get_dht_time()
        (stages, reports), readers = await asyncio.gather(
            read_records(dht, self.manifest), read_reader_records(dht, self.manifest)
        )
        now = get_dht_time()
        document = swarm_health(self.manifest, stages, reports, began, manifest_source=self.source)
        document["read_seconds"] = round(now - began, 2)
        # the swarm's reading of its data; None: the trainers' records could not be read
        data = self.manifest.data.index_sha256  # "": a raw source, whose index each trainer makes itself
        document["data"] = data_progress(readers, data) if readers is not None else None
        self.add_gone_peers(document, now)
        return document, reports

    def add_gone_peers(self, document: dict[str, Any], now: float) -> None:
        current = {p["peer_id"] for p in document["peers"]}
        for peer in document["peers"]:
            if peer.get("status") != "gone":
                self.seen[peer["peer_id"]] = {**peer, "seen_at": now}
        for key, peer in list(self.seen.items()):
            if peer["peer_id"] in current:
                continue
            if now - peer["seen_at"] > self.gone_after:
                del self.seen[key]
            else:
                gone = {k: v for k, v in peer.items() if k != "seen_at"}
                # it said it left (its last record: offline), or its records just stopped: it vanished
                departure = "left" if peer["status"] == "offline" else "vanished"
                gone.update(status="gone", departure=departure)
                gone.update(last_seen=round(now - peer["seen_at"] + peer["last_seen"], 1))
                document["peers"].append(gone)


def found_anyone(document: dict[str, Any]) -> bool:
    """Whether the read found any record of the swarm at all (a peer's, in any state, or a trainer's report): when
    none, the swarm is unreachable from here (every peer left, or this reader lost its connections)."""
    return document["training"]["trainers"] > 0 or any(p["status"] != "gone" for p in document["peers"])
