"""Prometheus metrics of one peer (`swarm-peer --metrics-port N`).

Nothing is counted for this module: at each scrape, a collector takes the snapshot the peer's status line reads
too (a PeerSnapshot: the StageStats its announcement carries, its trainer's TrainerStats, its moves and traffic;
swarm/watch/stats.py), handed over by the Peer (swarm/peer/peer.py) as a function, so serving and training pay
nothing for it. The peer's objects change on its event loop (and the stage's counters in its worker thread), so
the collector calls that function on the event loop: a scrape waits for one turn of the loop, and gets figures that
belong together. What does not change while the peer runs (PeerInfo) and the count of refused records (which
waits on the DHT's process) are read in the scrape's own thread.

Names follow Prometheus' conventions: prefix `swarm_`, counters end in `_total`, units in the name. Every
series carries `swarm_id` and `peer_id`; those of the served stage carry `stage` too (a peer that moves starts
new series, whose counters start at zero again). `swarm_peer_info` holds the descriptive labels (version,
device, public name). Until the trainer has completed a microbatch, `swarm_trainer_loss` is left out rather
than NaN: a NaN would turn every aggregation over peers (avg, max) into NaN, while a missing series is simply
skipped.

The HTTP server is prometheus_client's, in a daemon thread, on its own registry (not the process-wide one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from swarm import PROTOCOL_VERSION, __version__
from swarm.dht.records import PeerState
from swarm.errors import PeerStartError
from swarm.watch.stats import PeerSnapshot

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT = 5.0  # seconds a scrape waits for the event loop before it answers with the static metrics only


@dataclass(frozen=True)
class PeerInfo:
    """What the metrics say about the peer itself; fixed while it runs."""

    swarm_id: str
    swarm_name: str
    peer_id: str
    device: str  # as announced (swarm/throughput.py's device_name)
    public_name: str
    num_stages: int
    started: float  # time.monotonic() when the peer started


class _Families:
    """Metric families under construction; every sample gets the peer's identifying labels."""

    def __init__(self, identity: dict[str, str]):
        self.identity = identity
        self.families: dict[str, Metric] = {}

    def add(self, family_type: type, name: str, doc: str, value: float, /, **labels: object) -> None:
        values = {**self.identity, **{key: str(text) for key, text in labels.items()}}
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = family_type(name, doc, labels=list(values))
        family.add_metric(list(values.values()), value)

    def gauge(self, name: str, doc: str, value: float, /, **labels: object) -> None:
        self.add(GaugeMetricFamily, name, doc, value, **labels)

    def counter(self, name: str, doc: str, value: float, /, **labels: object) -> None:
        assert name.endswith("_total")
        self.add(CounterMetricFamily, name, doc, value, **labels)


class PeerCollector(Collector):
    """At each scrape: `info`, the `snapshot()` of the moment (called on `loop`) and, if given, the count of
    records the peer's DHT node refused (`refused_records()`, called in the scrape's thread; it may raise)."""

    def __init__(
        self,
        info: PeerInfo,
        snapshot: Callable[[], PeerSnapshot],
        refused_records: Callable[[], int] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout: float = SCRAPE_TIMEOUT,
    ):
        self.info, self.snapshot, self.refused_records = info, snapshot, refused_records
        self.loop, self.timeout = loop, timeout
        self.identity = {"swarm_id": info.swarm_id, "peer_id": info.peer_id}

    def describe(self) -> Iterable[Metric]:
        return []  # the registry must not call collect() (from the registering thread) to learn the names

    def collect(self) -> Iterable[Metric]:
        static = _Families(self.identity)
        self._static(static)
        live = self._on_loop(self._live)
        if live is None:
            logger.info(
                f"metrics scrape: the event loop did not answer within {self.timeout:g}s; sent the static metrics only"
            )
        return [*static.families.values(), *(live or [])]

    def _on_loop(self, read: Callable[[], list[Metric]]) -> list[Metric] | None:
        """`read()`, run on the peer's event loop (where its objects change); None if the loop did not run it in
        time (it is blocked, or closed because the peer is stopping)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if self.loop is None or here is self.loop:
            return read()
        done: concurrent.futures.Future[list[Metric]] = concurrent.futures.Future()

        def run() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(read())
                except BaseException as e:
                    done.set_exception(e)

        try:
            self.loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop is closed
            return None
        try:
            return done.result(timeout=self.timeout)  # a bug in `read` raises here: the scrape fails (HTTP 500)
        except TimeoutError:
            done.cancel()
            return None

    def _static(self, f: _Families) -> None:
        peer = self.info
        info = InfoMetricFamily(
            "swarm_peer",
            "This peer: its software, device and public name (value 1)",
            value={
                **self.identity,
                "swarm_name": peer.swarm_name,
                "version": __version__,
                "protocol_version": str(PROTOCOL_VERSION),
                "device": peer.device,
                "public_name": peer.public_name,
            },
        )
        f.families[info.name] = info
        f.gauge("swarm_peer_uptime_seconds", "Seconds since this peer started", time.monotonic() - peer.started)
        if self.refused_records is None:
            return
        try:  # (the scrape's thread may wait on the DHT's process; the event loop must not)
            refused = self.refused_records()
        except Exception as e:  # the DHT process is gone (the peer is stopping)
            logger.debug(f"metrics scrape: could not count refused records: {e!r}")
        else:
            f.counter(
                "swarm_records_refused_total",
                "DHT records this peer's node refused for a bad or missing signature (forgeries, or older peers)",
                refused,
            )

    def _live(self) -> list[Metric]:
        f = _Families(self.identity)
        snapshot = self.snapshot()
        state = snapshot.state  # no stage yet: choosing, measuring, downloading
        for name in PeerState:
            f.gauge(
                "swarm_peer_state",
                "1 for the peer's current state: joining (choosing its stage, measuring, taking over the stage's "
                "state), online (serving) or offline (draining or stopping); 0 for the others",
                float(name == state),
                state=name,
            )
        f.counter("swarm_peer_moves_total", "Moves of this peer from one stage to another", snapshot.moves)
        traffic = snapshot.traffic
        sent_doc = "Bytes this peer sent: activations and gradients between stages, and averaging payload (estimated)"
        received_doc = sent_doc.replace("sent", "received")
        f.counter("swarm_sent_bytes_total", sent_doc, traffic.activation_sent, kind="activations")
        f.counter("swarm_sent_bytes_total", sent_doc, traffic.averaging_sent, kind="averaging")
        f.counter("swarm_received_bytes_total", received_doc, traffic.activation_received, kind="activations")
        f.counter("swarm_received_bytes_total", received_doc, traffic.averaging_received, kind="averaging")

        errors_doc = (
            "Errors, by kind: bad_request (a stage request refused as malformed), busy (a request refused because "
            "too many were in flight), banned (a request refused unread: its sender sent too many bad ones), "
            "failed_averaging_round (an averaging round of the stage that did not happen or was dropped), "
            "failed_microbatch (the trainer dropped a microbatch)"
        )
        stats = snapshot.stage
        if stats is not None:
            stage = stats.stage
            f.gauge("swarm_peer_stage", "The stage this peer serves", stage)
            f.counter(
                "swarm_stage_samples_served_total",
                "Samples this peer served for the stage (forward and backward count once)",
                stats.samples_served,
                stage=stage,
            )
            f.counter(
                "swarm_stage_optimizer_steps_total",
                "Optimizer steps of the stage's state on this peer, including those taken over with the state",
                stats.optimizer_steps,
                stage=stage,
            )
            f.counter(
                "swarm_stage_recomputed_forwards_total",
                "Backward passes that recomputed forward (its activations were gone, e.g. after another peer failed)",
                stats.recomputed_forwards,
                stage=stage,
            )
            f.gauge(
                "swarm_stage_staleness_versions",
                "Weight versions between a microbatch's forward here and the weights its gradient was applied to "
                "(recent mean and maximum; 0 under the step gate)",
                stats.staleness_mean,
                stage=stage,
                stat="mean",
            )
            f.gauge(
                "swarm_stage_staleness_versions",
                "Weight versions between a microbatch's forward here and the weights its gradient was applied to "
                "(recent mean and maximum; 0 under the step gate)",
                stats.staleness_max,
                stage=stage,
                stat="max",
            )
            f.gauge(
                "swarm_stage_step_gate_waiting",
                "Microbatches waiting now for this stage's next optimizer step (training.pipelining flush)",
                stats.gate_waiting,
                stage=stage,
            )
            f.gauge(
                "swarm_stage_outstanding_requests",
                "Forward and backward requests queued or running on this peer",
                stats.outstanding,  # what the peer announces as `outstanding`
                stage=stage,
            )
            for kind, value, doc in (
                (
                    "serving",
                    stats.throughput,
                    "Samples per second this peer can serve (the lower of compute and network)",
                ),
                (
                    "compute",
                    stats.compute_throughput,
                    "Samples per second this peer's device can compute for the stage",
                ),
                ("network", stats.network_throughput, "Samples per second this peer's links allow for the stage"),
                (
                    "delivered",
                    stats.delivered_throughput,
                    "Samples per second this peer served lately (EMA, half-life 30s)",
                ),
            ):
                f.gauge(f"swarm_stage_{kind}_throughput_samples_per_second", doc, value, stage=stage)
            f.gauge(
                "swarm_stage_averaging_round",
                "Number of the stage's next averaging round",
                stats.averaging_round,
                stage=stage,
            )
            f.counter(
                "swarm_stage_averaging_rounds_total",
                "Averaging rounds of the stage this peer took part in with at least one other peer",
                stats.averaging_rounds,
                stage=stage,
            )
            f.gauge(
                "swarm_stage_averaging_group_size",
                "Peers in this peer's last averaging round (0: none yet)",
                stats.last_group_size,
                stage=stage,
            )
            f.counter(
                "swarm_stage_checkpoints_saved_total",
                "Checkpoints of the stage saved by this peer",
                stats.checkpoints_saved,
                stage=stage,
            )
            f.counter("swarm_errors_total", errors_doc, stats.bad_requests, kind="bad_request", stage=stage)
            f.counter("swarm_errors_total", errors_doc, stats.busy_replies, kind="busy", stage=stage)
            f.counter("swarm_errors_total", errors_doc, stats.banned_replies, kind="banned", stage=stage)
            f.counter("swarm_stage_bans_total", "Peers this peer banned for bad requests", stats.bans, stage=stage)
            f.counter(
                "swarm_stage_averaging_strikes_total",
                "Flags this peer gave averaging partners whose values were far from the round's robust aggregate",
                stats.averaging_strikes,
                stage=stage,
            )
            f.counter(
                "swarm_stage_averaging_exclusions_total",
                "Averaging partners this peer excluded from its rounds for repeated far-off values",
                stats.averaging_exclusions,
                stage=stage,
            )
            f.counter(
                "swarm_errors_total",
                errors_doc,
                stats.averaging_rounds_failed,
                kind="failed_averaging_round",
                stage=stage,
            )

        trainer_stats = snapshot.trainer
        if trainer_stats is not None:
            loss, speed = trainer_stats.loss, trainer_stats.samples_per_second
            f.counter("swarm_trainer_samples_total", "Samples this peer's trainer trained on", trainer_stats.samples)
            f.counter(
                "swarm_trainer_microbatches_total",
                "Microbatches this peer's trainer completed",
                trainer_stats.microbatches,
            )
            f.gauge(
                "swarm_trainer_throughput_samples_per_second",
                "Samples per second this peer's trainer completed, over the last 30 seconds",
                speed,
            )
            if loss == loss:  # NaN until a microbatch has completed (in the last 30 seconds): left out, see above
                f.gauge("swarm_trainer_loss", "Mean training loss of the trainer's microbatches of the last 30 s", loss)
            unserved = set(trainer_stats.unserved_stages)
            for stage in range(self.info.num_stages):
                f.gauge(
                    "swarm_trainer_stage_unserved",
                    "1 if the trainer found no online peer of the stage at its last look (it waits for one)",
                    float(stage in unserved),
                    stage=stage,
                )
            # the same labels as the stage's errors; an empty label is the same as none to Prometheus
            f.counter(
                "swarm_errors_total", errors_doc, trainer_stats.failed_microbatches, kind="failed_microbatch", stage=""
            )
        if snapshot.data is not None:
            _data_metrics(f, snapshot.data)
        return list(f.families.values())


def _data_metrics(f: _Families, data: dict) -> None:
    """The trainer's reading of the swarm's data: swarm/dataset/stream.py's ChunkStream.stats()."""
    f.gauge("swarm_data_epoch", "The epoch of the swarm's data this peer's trainer reads", data["epoch"])
    f.gauge(
        "swarm_data_epoch_read_ratio",
        "Fraction of the epoch's chunks the swarm has read, as this trainer knows it (chunks being read count half)",
        data["epoch_read"],
    )
    f.gauge(
        "swarm_data_readers", "Trainers reading the data, as this one knows them (itself included)", data["readers"]
    )
    f.counter(
        "swarm_data_tokens_read_total", "Tokens this trainer has read (kept across restarts)", data["tokens_read"]
    )
    f.counter(
        "swarm_data_chunks_read_total", "Data chunks this trainer finished (kept across restarts)", data["chunks_read"]
    )
    f.counter(
        "swarm_data_duplicate_chunks_total",
        "Data chunks this trainer finished that the swarm had read already in that epoch",
        data["duplicates"],
    )
    fetched_doc = "Data chunk bytes this peer got, by where from (web, store, folder: read in place, peer)"
    for source, size in sorted(data["bytes_from"].items()):
        f.counter("swarm_data_fetched_bytes_total", fetched_doc, size, source=source)
    refused_doc = "Data chunks this peer refused or failed to fetch, by reason (wrong hash, failed)"
    for reason, count in sorted(data["refused"].items()):
        f.counter("swarm_data_refused_chunks_total", refused_doc, count, reason=reason)
    f.gauge("swarm_data_cache_bytes", "Bytes of verified data chunks in this peer's cache", data["cache_bytes"])
    f.gauge("swarm_data_cache_capacity_bytes", "The cap of this peer's data cache (--data-cache)", data["cache_cap"])


class MetricsServer:
    """A running metrics endpoint; stop() shuts it down."""

    def __init__(self, httpd, thread, registry: CollectorRegistry):
        self.httpd, self.thread, self.registry = httpd, thread, registry
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self.httpd.shutdown()  # returns once the serving loop has ended (it looks every 0.5 s)
        self.httpd.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(
    host: str,
    port: int,
    info: PeerInfo,
    snapshot: Callable[[], PeerSnapshot],
    refused_records: Callable[[], int] | None = None,
) -> MetricsServer:
    """Serve the peer's metrics at http://host:port/metrics (port 0: any free port, see .port). Call it from the
    peer's event loop: scrapes call `snapshot()` there. Raises PeerStartError if it cannot listen."""
    registry = CollectorRegistry()
    registry.register(PeerCollector(info, snapshot, refused_records, asyncio.get_running_loop()))
    ProcessCollector(registry=registry)  # CPU time, memory, open files of the peer's main process (on Linux)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            hint = f"port {port} on {host} is already in use; choose another --metrics-port (0: any free port)"
        elif e.errno == errno.EACCES:
            hint = f"no permission to listen on port {port}; choose a port above 1023"
        else:
            hint = f"cannot listen on {host}:{port} ({e.strerror or e}); check --metrics-host and --metrics-port"
        raise PeerStartError(f"metrics server: {hint}") from None
    return MetricsServer(httpd, thread, registry)
