"""The whole swarm as Prometheus text (`swarm-monitor`'s /metrics), from peer-status' document.

Labelled like each peer's own metrics (swarm/watch/metrics.py): every series carries `swarm_id`; a stage's series
carry `stage`; a peer's carry `peer_id` and `stage`. `swarm_monitor_peer_info` holds the descriptive labels
(public name, device, version, status). Figures the monitor does not know (no loss reported yet, the swarm
unreachable) are left out rather than NaN, so that aggregations over them stay numbers.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class _DocumentCollector(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


def _gauge(name: str, doc: str, labels: dict[str, str], rows: list[tuple[dict[str, Any], float]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=[*labels, *(rows[0][0] if rows else {})])
    for extra, value in rows:
        family.add_metric([*labels.values(), *(str(v) for v in extra.values())], float(value))
    return family


def swarm_metrics(document: dict[str, Any], reachable: bool, samples_recorded: int) -> bytes:
    """Prometheus' text format of the document (see the module's docstring for the labels)."""
    base = {"swarm_id": document["swarm"]["swarm_id"]}
    families: list[Metric] = [
        _gauge("swarm_monitor_reachable", "1 if the monitor's last read of the swarm found it, else 0", base,
               [({}, int(reachable))]),
        _gauge("swarm_monitor_samples", "Samples of the swarm in the monitor's history", base,
               [({}, samples_recorded)]),
    ]  # fmt: skip
    if reachable:
        health, training = document["health"], document["training"]
        figures = [
            ("swarm_healthy", "1 if every stage is served by an online peer", int(health["healthy"])),
            ("swarm_peers_online", "Peers online (any stage)", document["swarm"]["peers_online"]),
            ("swarm_trainers", "Trainers that reported recently", training["trainers"]),
            (
                "swarm_samples_per_second",
                "Samples per second the trainers report, summed",
                training["samples_per_second"],
            ),
            ("swarm_tokens_per_second", "Tokens per second the trainers report, summed", training["tokens_per_second"]),
            ("swarm_tokens_trained", "Tokens the swarm has trained on since it began", training["tokens_trained"]),
            ("swarm_failed_microbatches", "Microbatches the trainers gave up on", training["failed_microbatches"]),
            ("swarm_bottleneck_stage", "The stage with the least served throughput", health["bottleneck_stage"]),
        ]
        if training["loss"] is not None:
            figures.append(("swarm_loss", "Recent training loss, weighted by the trainers' speeds", training["loss"]))
        if health["balance_efficiency"] is not None:
            figures.append(("swarm_balance_efficiency", "Bottleneck throughput over the best possible with these peers",
                            health["balance_efficiency"]))  # fmt: skip
        data = document.get("data")  # the trainers' reading (swarm/watch/data_progress.py); None: not read
        if data is not None and data["readers"]:
            figures += [
                ("swarm_data_epoch", "The epoch of its data the swarm reads (the highest a trainer states)",
                 data["epoch"]),
                ("swarm_data_epoch_read_ratio", "Fraction of that epoch's chunks read (those being read count half)",
                 data["epoch_read"]),
                ("swarm_data_readers", "Trainers that say what they read", data["readers"]),
                ("swarm_data_tokens_read", "Tokens the trainers have read since they started", data["tokens_read"]),
                ("swarm_data_duplicate_chunks", "Chunks the trainers read again in an epoch that had them",
                 data["duplicates"]),
                ("swarm_data_fetched_bytes", "Chunk bytes the trainers downloaded", data["bytes_fetched"]),
            ]  # fmt: skip
        families += [_gauge(name, doc, base, [({}, value)]) for name, doc, value in figures]
        stages = document["stages"]
        for name, doc, key in (
            ("swarm_stage_online_peers", "Peers online serving the stage", "online_peers"),
            ("swarm_stage_joining_peers", "Peers joining the stage", "joining_peers"),
            ("swarm_stage_throughput_samples_per_second", "Samples per second the stage's online peers can serve",
             "throughput"),
            ("swarm_stage_delivered_throughput_samples_per_second", "Samples per second the stage's peers served",
             "delivered_throughput"),
            ("swarm_stage_averaging_rounds", "The stage's averaging rounds so far", "averaging_rounds"),
        ):  # fmt: skip
            families.append(_gauge(name, doc, base, [({"stage": row["stage"]}, row[key]) for row in stages]))
        peers = [p for p in document["peers"] if p["status"] != "gone"]
        for name, doc, key in (
            ("swarm_monitor_peer_online", "1 if the peer is online", None),
            ("swarm_monitor_peer_throughput_samples_per_second", "Samples per second the peer can serve", "throughput"),
            ("swarm_monitor_peer_delivered_throughput_samples_per_second", "Samples per second the peer served",
             "delivered_throughput"),
            ("swarm_monitor_peer_samples_served", "Samples the peer says it served since it started", "samples_served"),
            ("swarm_monitor_peer_attested_samples", "Samples trainers attest the peer served for them",
             "attested_samples"),
            ("swarm_monitor_peer_queue", "Requests the peer accepted and has not answered", "outstanding"),
            ("swarm_monitor_peer_uptime_seconds", "Seconds since the peer started", "uptime"),
        ):  # fmt: skip
            rows = [
                ({"peer_id": p["peer_id"], "stage": p["stage"]}, p["status"] == "online" if key is None else p[key])
                for p in peers
            ]
            families.append(_gauge(name, doc, base, rows))
        info = InfoMetricFamily(
            "swarm_monitor_peer", "What a peer says of itself",
            labels=["swarm_id", "peer_id", "stage", "public_name", "device", "version", "status"],
        )  # fmt: skip
        for p in peers:
            info.add_metric(
                [base["swarm_id"], p["peer_id"], str(p["stage"]), p["public_name"], p["device"], p["version"],
                 p["status"]], {},
            )  # fmt: skip
        families.append(info)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DocumentCollector(families))
    return generate_latest(registry)
