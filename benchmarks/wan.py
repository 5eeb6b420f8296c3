"""WAN benchmark: a 3-stage swarm with trainers, on loopback and behind emulated home links, both pipelines.

    python benchmarks/wan.py [--seconds 40] [--settings unshaped,nanogpt,home20,home10,mixed] [--pipelines forward,relay]

Each peer (one per stage, and two trainer-only peers) sits behind its own emulated link (swarm/emulated_links.py:
bandwidth per direction, one-way delay; a path between two peers crosses both their links). For each setting and
pipeline (`forward`: stages pass activations to each other; `relay`: the trainer carries them, the protocol before
issue 14) it prints one JSON line:

- samples_per_second: what the trainers trained per second, after a warm-up;
- compute_bound: the same swarm and pipeline on unshaped links;
- network_bound: for each link and direction, its bandwidth over the bytes per sample it carried; the smallest;
- efficiency: samples_per_second over the smaller bound; speed_vs_unshaped: over the compute bound;
- trainer_bytes_per_sample: bytes on the trainers' own links (both directions) per sample trained;
- window: microbatches in flight per trainer; failed_microbatches.

Settings (per peer link; the delay of a path is the sum of both ends'): unshaped; nanogpt, the link of the Protocol
NanoGPT speedrun (200 Mbit/s, 50 ms one-way between two peers: 25 ms per link); home20 (20 Mbit/s, 25 ms); home10
(10 Mbit/s, 50 ms); mixed (stage peers on 100, 20 and 10 Mbit/s with 10, 25 and 50 ms; trainers on 20 Mbit/s).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import stop_on_sigterm  # noqa: E402
from peers import processes  # noqa: E402
from swarm.emulated_links import EmulatedLinks, LinkSpec  # noqa: E402
from swarm.manifest import manifest_from_dict  # noqa: E402
from swarm.manifest_loading import write_manifest  # noqa: E402
from swarm.presets import new_manifest  # noqa: E402

STAGES = 3
TRAINERS = 2
SETTINGS = {
    "unshaped": {"stage": ["unlimited"] * STAGES, "trainer": "unlimited"},
    "nanogpt": {"stage": ["200mbit/25ms"] * STAGES, "trainer": "200mbit/25ms"},
    "home20": {"stage": ["20mbit/25ms"] * STAGES, "trainer": "20mbit/25ms"},
    "home10": {"stage": ["10mbit/50ms"] * STAGES, "trainer": "10mbit/50ms"},
    "mixed": {"stage": ["100mbit/10ms", "20mbit/25ms", "10mbit/50ms"], "trainer": "20mbit/25ms"},
}


def manifest_for(pipeline: str, window: int):
    manifest = new_manifest(f"wan-{pipeline}", "tiny").to_dict(with_peers=False)
    manifest["model"]["depth"] = 6  # two layers per stage
    manifest["stages"] = {"count": STAGES}
    manifest["training"]["pipeline"] = pipeline
    manifest["training"]["max_in_flight"] = window
    manifest["averaging"]["mode"] = "none"  # one peer per stage: nobody to average with
    return manifest


def run_setting(name: str, pipeline: str, seconds: float, warmup: float, window: int, folder: Path) -> dict:
    setting = SETTINGS[name]
    manifest = manifest_for(pipeline, window)
    path = folder / f"{name}-{pipeline}.json"
    write_manifest_dict(manifest, path)
    started: list[processes.PeerProcess] = []
    common = ["--status-every", "2", "--throughput", "100", "--bandwidth", "1000", "--duration", "900"]
    with EmulatedLinks(lifetime=seconds + warmup + 600) as links:
        try:
            specs = {f"stage{s}": LinkSpec.parse(setting["stage"][s]) for s in range(STAGES)}
            specs.update({f"trainer{t}": LinkSpec.parse(setting["trainer"]) for t in range(TRAINERS)})
            for stage in range(STAGES):
                flags = [
                    "--stage",
                    str(stage),
                    "--no-trainer",
                    *common,
                    *links.peer_flags(f"stage{stage}", specs[f"stage{stage}"]),
                ]
                log = folder / f"{name}-{pipeline}-stage{stage}.log"
                started.append(processes.start_local_peer(path, stage, log, trainer=False, extra=flags))
                if stage == 0:
                    manifest["initial_peers"] = [started[0].maddr()]
                    path = folder / f"{name}-{pipeline}-joined.json"
                    write_manifest_dict(manifest, path)
            for peer in started:
                peer.wait_for("serving stage", timeout=120)
            trainers = []
            for t in range(TRAINERS):
                flags = [
                    "--trainer-only",
                    "--seed",
                    str(t),
                    *common,
                    *links.peer_flags(f"trainer{t}", specs[f"trainer{t}"]),
                ]
                log = folder / f"{name}-{pipeline}-trainer{t}.log"
                trainers.append(processes.start_local_peer(path, None, log, extra=flags))
            started += trainers
            for trainer in trainers:
                trainer.wait_for_json(lambda s: (s.get("trainer_samples") or 0) > 0, timeout=180)
            time.sleep(warmup)
            samples0, carried0, begin = total_samples(trainers), links.carried(), time.monotonic()
            time.sleep(seconds)
            samples1, carried1, took = total_samples(trainers), links.carried(), time.monotonic() - begin
        finally:
            processes.stop_peers(started)
    samples = max(samples1 - samples0, 1)
    carried = {k: {d: carried1[k][d] - carried0[k][d] for d in ("up", "down")} for k in carried1}
    bounds = []
    for link_name, spec in specs.items():
        for direction, bits in (("up", spec.up_bits), ("down", spec.down_bits)):
            per_sample = carried[link_name][direction] / samples
            if bits is not None and per_sample > 0:
                bounds.append(bits / 8 / per_sample)
    failed = sum((t.status_lines()[-1].get("trainer_failed_microbatches") or 0) for t in trainers)
    trainer_bytes = sum(carried[f"trainer{t}"]["up"] + carried[f"trainer{t}"]["down"] for t in range(TRAINERS))
    return {
        "setting": name,
        "pipeline": pipeline,
        "links": {k: v.describe() for k, v in specs.items()} if name == "mixed" else setting["stage"][0],
        "samples_per_second": round(samples / took, 2),
        "network_bound": round(min(bounds), 2) if bounds else None,
        "trainer_bytes_per_sample": round(trainer_bytes / samples),
        "stage_link_bytes_per_sample": {
            f"stage{s}": round(sum(carried[f"stage{s}"].values()) / samples) for s in range(STAGES)
        },
        "window": window,
        "failed_microbatches": failed,
        "samples": samples,
    }


def total_samples(trainers: list[processes.PeerProcess]) -> int:
    return sum((t.status_lines()[-1].get("trainer_samples") or 0) for t in trainers)


def write_manifest_dict(manifest: dict, path: Path) -> None:
    write_manifest(manifest_from_dict(manifest), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per run (default 40)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of training before measuring (default 10)")
    parser.add_argument("--window", type=int, default=4, help="microbatches in flight per trainer (default 4)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--pipelines", default="forward,relay", help="forward, relay or both (default both)")
    args = parser.parse_args()
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    if "unshaped" in names:  # the compute bound comes first
        names = ["unshaped"] + [n for n in names if n != "unshaped"]
    stop_on_sigterm()
    folder = Path(tempfile.mkdtemp(prefix="swarm-wan-"))
    print(f"peer logs: {folder}", file=sys.stderr)
    for pipeline in args.pipelines.split(","):
        compute_bound = None
        for name in names:
            result = run_setting(name, pipeline, args.seconds, args.warmup, args.window, folder)
            if name == "unshaped":
                compute_bound = result["samples_per_second"]
            result["compute_bound"] = compute_bound
            bounds = [b for b in (compute_bound, result["network_bound"]) if b]
            result["efficiency"] = round(result["samples_per_second"] / min(bounds), 3) if bounds else None
            if compute_bound:
                result["speed_vs_unshaped"] = round(result["samples_per_second"] / compute_bound, 3)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
