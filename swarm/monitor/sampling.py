"""What one sample of a swarm is: the rows the monitor writes to its history, taken from peer-status' document.

Pure functions: the document in (swarm/watch/status.py), plain rows out (swarm/monitor/history.py writes them).
"""

from __future__ import annotations

import math
from typing import Any


def swarm_sample(document: dict[str, Any], reachable: bool, now: float) -> dict[str, Any]:
    """The swarm's row. Unreachable: the time and the verdict only; its figures are unknown (gaps in the plots)."""
    if not reachable:
        return {"time": now, "reachable": 0, "healthy": 0, "peers_online": 0, "trainers": 0}
    health, training = document["health"], document["training"]
    online = [p for p in document["peers"] if p["status"] == "online"]
    efficiency = health["balance_efficiency"]
    return {
        "time": now,
        "reachable": 1,
        "healthy": int(health["healthy"]),
        "peers_online": document["swarm"]["peers_online"],
        "trainers": training["trainers"],
        "samples_per_second": training["samples_per_second"],
        "tokens_per_second": training["tokens_per_second"],
        "tokens_trained": training["tokens_trained"],
        "loss": training["loss"] if training["loss"] is not None and math.isfinite(training["loss"]) else None,
        "balance_efficiency": efficiency,
        "bottleneck_stage": health["bottleneck_stage"],
        "averaging_rounds": max((row["averaging_rounds"] for row in document["stages"]), default=0),
        "activation_bytes": sum(p["activation_bytes_sent"] for p in online),
        "averaging_bytes": sum(p["averaging_bytes_sent"] for p in online),
    }


def stage_rows(document: dict[str, Any], reachable: bool) -> list[dict[str, Any]]:
    """One row per stage; an unreachable swarm's stages have no peers online as far as the monitor can tell."""
    if not reachable:
        return [{"stage": row["stage"], "online_peers": 0, "joining_peers": 0} for row in document["stages"]]
    return [
        {
            "stage": row["stage"],
            "online_peers": row["online_peers"],
            "joining_peers": row["joining_peers"],
            "throughput": row["throughput"],
            "delivered_throughput": row["delivered_throughput"],
            "samples_served": row["samples_served"],
            "rounds": row["averaging_rounds"],
        }
        for row in document["stages"]
    ]


def peer_rows(document: dict[str, Any], reachable: bool) -> list[dict[str, Any]]:
    """One row per peer the document shows, gone ones included (their status says so)."""
    if not reachable:
        return []
    return [{key: p[key] for key in ("peer_id", "stage", "status", "throughput", "delivered_throughput",
                                     "samples_served", "outstanding")} for p in document["peers"]]  # fmt: skip
