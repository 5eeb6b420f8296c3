"""The state of a swarm, as `peer-status` shows it: pure functions over the records read from the DHT.

Everything here is computed from announcements and trainer reports alone, so a monitor needs nothing but
read access to the DHT. The result is one JSON-compatible document; the program only renders it.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from swarm.architectures.model import count_stage_parameters
from swarm.balancing.moves import PeerLoad, stage_totals
from swarm.balancing.optimum import efficiency
from swarm.dht.records import Announcement, PeerState, TrainerReport, announcement_lifetime
from swarm.manifests.manifest import Manifest

STALE_PERIODS = 2.0  # a peer whose last announcement is older than this many announce periods is "stale"
SHORT_ID_LENGTH = 8

HEALTHY, DEGRADED, UNREACHABLE = 0, 1, 2  # peer-status's exit codes


def short_id(peer_id: str) -> str:
    """The end of a peer id: the start is the same for every peer ("Qm" and the same few characters)."""
    return peer_id[-SHORT_ID_LENGTH:]


def peer_status(ann: Announcement, now: float, announce_period: float) -> tuple[str, float]:
    """(status, seconds since its last announcement). Status: joining, online, paused, stale or offline."""
    last_seen = max(0.0, now - (ann.expiration - announcement_lifetime(announce_period)))
    if ann.state == PeerState.OFFLINE:
        return "offline", last_seen
    if last_seen > STALE_PERIODS * announce_period:
        return "stale", last_seen
    return str(ann.state), last_seen


def peer_document(ann: Announcement, now: float, announce_period: float) -> dict[str, Any]:
    status, last_seen = peer_status(ann, now, announce_period)
    document = asdict(ann)
    document.pop("expiration")
    document.update(state=str(ann.state), short_id=short_id(ann.peer_id), status=status, last_seen=round(last_seen, 1))
    return document


STATUS_RANK = {"online": 0, "joining": 1, "paused": 2, "stale": 3, "offline": 4, "gone": 5}


def one_record_per_peer(peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A peer that moved has a record in its old stage (offline) and its new one: keep the liveliest."""
    best: dict[str, dict[str, Any]] = {}
    for peer in peers:
        held = best.get(peer["peer_id"])
        if held is None or (STATUS_RANK[peer["status"]], peer["last_seen"]) < (
            STATUS_RANK[held["status"]],
            held["last_seen"],
        ):
            best[peer["peer_id"]] = peer
    return list(best.values())


def stage_samples_trained(manifest: Manifest, peers: list[Announcement]) -> int:
    """Samples the stage has trained on since the swarm began, as far as its live peers know.

    With averaging, the round number counts `every_samples` each and survives restarts (it is in checkpoints
    and taken over by joiners); without it, only the live peers' own counters remain."""
    if not peers:
        return 0
    if manifest.averaging.mode == "none":
        return sum(p.samples_served for p in peers)
    latest = max(p.averaging_round for p in peers)
    in_round = sum(p.round_samples for p in peers if p.averaging_round == latest)
    return latest * manifest.averaging.every_samples + in_round


TOP_CONTRIBUTORS = 10


def attested_samples(reports: list[TrainerReport]) -> dict[str, int]:
    """Samples each stage peer trained, as the trainers' signed reports vouch for it (a report cannot vouch for more
    samples than its trainer says it trained; a trainer does not vouch for its own peer's server)."""
    attested: dict[str, int] = {}
    for report in reports:
        for peer_id, samples in report.served:
            if peer_id != report.peer_id:
                attested[peer_id] = attested.get(peer_id, 0) + min(samples, report.samples)
    return attested


def contributors(peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The volunteers who contributed most, ranked by what trainers attest (a peer's own count is only shown)."""
    ranked = sorted(peers, key=lambda p: (-p["attested_samples"], -p["samples_served"], p["peer_id"]))
    return [
        {
            "peer_id": p["peer_id"],
            "short_id": p["short_id"],
            "public_name": p["public_name"],
            "attested_samples": p["attested_samples"],
            "claimed_samples": p["samples_served"],
        }
        for p in ranked[:TOP_CONTRIBUTORS]
    ]


def training_progress(manifest: Manifest, reports: list[TrainerReport], samples_trained: int) -> dict[str, Any]:
    """Swarm-wide training figures from the trainers' reports: speed, recent loss, tokens so far."""
    speed = sum(r.samples_per_second for r in reports)
    with_loss = [r for r in reports if math.isfinite(r.loss)]
    if with_loss:
        weights = [r.samples_per_second for r in with_loss]
        if sum(weights) > 0:
            loss = sum(r.loss * w for r, w in zip(with_loss, weights)) / sum(weights)
        else:
            loss = sum(r.loss for r in with_loss) / len(with_loss)
    else:
        loss = None
    return {
        "trainers": len(reports),
        "samples_per_second": round(speed, 2),
        "tokens_per_second": round(speed * manifest.model.context_length, 1),
        "loss": None if loss is None else round(loss, 4),
        "samples_trained": samples_trained,
        "tokens_trained": samples_trained * manifest.model.context_length,
        "failed_microbatches": sum(r.failed_microbatches for r in reports),
    }


def swarm_health(
    manifest: Manifest,
    stages: list[list[Announcement]],
    reports: list[TrainerReport],
    now: float,
    manifest_source: str = "",
) -> dict[str, Any]:
    """Everything peer-status shows, as one JSON-compatible document (see `exit_code` for its verdict)."""
    period = manifest.network.announce_period
    records = [peer_document(ann, now, period) for anns in stages for ann in anns]  # a peer has one per stage served
    peers = one_record_per_peer(records)
    attested = attested_samples(reports)
    for peer in peers:
        peer["attested_samples"] = attested.get(peer["peer_id"], 0)
        peer["span"], peer["moving_to"] = _span(peer, records)
    peers.sort(key=lambda p: (p["stage"], p["status"] != "online", p["peer_id"]))

    live = [p for p in records if p["status"] in ("online", "joining")]
    loads = [
        PeerLoad(p["peer_id"], p["stage"], p["throughput"], online=p["status"] == "online", movable=not p["pinned"])
        for p in live
    ]
    totals = stage_totals([load for load in loads if load.online], manifest.num_stages)
    stage_rows = []
    for stage in range(manifest.num_stages):
        here = one_record_per_peer([p for p in records if p["stage"] == stage])
        online = [p for p in here if p["status"] == "online"]
        start, end = manifest.stages[stage]
        stage_rows.append(
            {
                "stage": stage,
                "layers": [start, end],
                "online_peers": len(online),
                "joining_peers": sum(p["status"] == "joining" for p in here),
                "throughput": round(totals[stage], 2),
                "delivered_throughput": round(sum(p["delivered_throughput"] for p in online), 2),
                "samples_served": sum(p["samples_served"] for p in online),
                "averaging_rounds": max((p["averaging_round"] for p in online), default=0),
                # weight versions between a forward and its gradient's step, the worst of the stage's peers
                "staleness_max": max((p["staleness_max"] for p in online), default=0),
                "staleness_mean": round(max((p["staleness_mean"] for p in online), default=0.0), 3),
            }
        )
    unserved = [row["stage"] for row in stage_rows if row["online_peers"] == 0]
    bottleneck = min(range(manifest.num_stages), key=lambda s: (stage_rows[s]["online_peers"] > 0, totals[s], s))
    samples_trained = max(
        (
            stage_samples_trained(manifest, [a for a in anns if peer_status(a, now, period)[0] == "online"])
            for anns in stages
        ),
        default=0,
    )
    return {
        "swarm": {
            "name": manifest.name,
            "swarm_id": manifest.swarm_id,
            "manifest": manifest_source,
            "model": {**asdict(manifest.model), "parameters": sum(count_stage_parameters(manifest))},
            "stages": manifest.num_stages,
            "peers_online": len({p["peer_id"] for p in live}),
            "peers_unreachable": len({p["peer_id"] for p in live if not p["reachable"]}),  # they dial out instead
            "averaging": manifest.averaging.mode,
        },
        "health": {
            "healthy": not unserved,
            "unserved_stages": unserved,
            "bottleneck_stage": bottleneck,
            "bottleneck_throughput": round(totals[bottleneck], 2),
            # fewer live peers than stages: no assignment serves every stage, so no efficiency to speak of
            "balance_efficiency": round(efficiency(loads, manifest.num_stages), 3)
            if len(loads) >= manifest.num_stages
            else None,
        },
        "stages": stage_rows,
        "peers": peers,
        "contributors": contributors(peers),
        "training": training_progress(manifest, reports, samples_trained),
        "time": now,
    }


def _span(peer: dict[str, Any], records: list[dict[str, Any]]) -> tuple[list[int], list[int] | None]:
    """The stages [start, end) a peer serves (a peer serving a span announces one record per stage): its online
    records', else its joining ones', else the stage of the record shown; and, while it moves (online records and
    joining ones beside them), the stages it is taking over: a move is shown as a move, not as one wide span."""
    own = [r for r in records if r["peer_id"] == peer["peer_id"]]
    online = [r["stage"] for r in own if r["status"] == "online"]
    joining = [r["stage"] for r in own if r["status"] == "joining"]
    served = online or joining
    span = [min(served), max(served) + 1] if served else [peer["stage"], peer["stage"] + 1]
    if online and joining:
        return span, [min(joining), max(joining) + 1]  # the stages it takes over (it keeps some online ones)
    return span, None


def exit_code(document: dict[str, Any]) -> int:
    return HEALTHY if document["health"]["healthy"] else DEGRADED


def find_peer(document: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """The peers whose id is `text` or contains it (at least 4 characters), or whose public name is `text`."""
    if len(text) < 4:
        return [p for p in document["peers"] if p["public_name"] == text]
    exact = [p for p in document["peers"] if p["peer_id"] == text]
    return exact or [p for p in document["peers"] if text in p["peer_id"] or p["public_name"] == text]
