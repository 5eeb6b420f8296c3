"""WAN benchmark: a 3-stage swarm with trainers, on loopback and behind emulated home links, both pipelines.

    python -m benchmarks.wan [--seconds 40] [--settings unshaped,nanogpt,...] [--pipelines forward,relay]
                             [--activation-compression float32|float16|8bit] [--window 16] [--fixed-window]

    python -m benchmarks.wan --scenarios llama-1b-4090-200mbit[,...] [--methods 8bit,subspace] [--seconds 90]

With --scenarios, the links are set as a GPU would see them (benchmarks/gpu_scenarios.py, docs/BENCHMARKS.md): a
small Llama in 4 stages, with the scenario's 64 microbatches per step, first runs on unshaped links (its compute bound: this machine's seconds per microbatch
and its middle stage's uplink bytes per microbatch), then behind links whose transfer time and delay over that
compute time equal the scenario's GPU's, once with the trainers' automatic window and once with one microbatch in
flight (the `_one_in_flight` figures). One JSON line per scenario and method (8bit: today's hidden states;
subspace: model.subspace_rank at width/16; subspace-4bit: those coordinates in 4 bits) with fraction_of_compute_bound (samples/s shaped over unshaped),
arithmetic_bound (1 / transfer_over_compute, at most 1) and projected_tokens_per_second (the fraction times the
GPU's compute-bound tokens/s through the pipeline). Scenarios: llama-1b-4090-{200,50,20}mbit,
llama-7b-4090-50mbit, nanogpt-h100-200mbit.

Each peer (one per stage, a second one on stage 1 in the hetero settings, and two trainer-only peers) sits behind its own emulated link (swarm/local/emulated_links.py:
bandwidth per direction, one-way delay; a path between two peers crosses both their links). For each setting and
pipeline (`forward`: stages pass activations to each other; `relay`: the trainer carries them, the protocol before
issue 14) it prints one JSON line:

- samples_per_second: what the trainers trained per second, after a warm-up;
- compute_bound: the same swarm and pipeline on unshaped links;
- network_bound: for each link and direction, its bandwidth over the bytes per sample it carried; the smallest;
- efficiency: samples_per_second over the smaller bound; speed_vs_unshaped: over the compute bound;
- trainer_bytes_per_sample: bytes on the trainers' own links (both directions) per sample trained;
- samples_served per stage peer; window: the trainers' adaptive windows at the end (at most max_window);
  failed_microbatches; relay_cpu_cores: the cores the emulated links themselves took (of this machine's few).

Settings (per peer link; the delay of a path is the sum of both ends'): unshaped; nanogpt, the link of the Protocol
NanoGPT speedrun (200 Mbit/s, 50 ms one-way between two peers: 25 ms per link); home20 (20 Mbit/s, 25 ms); home10
(10 Mbit/s, 50 ms); mixed (stage peers on 100, 20 and 10 Mbit/s with 10, 25 and 50 ms; trainers on 20 Mbit/s);
hetero (all on 100 Mbit/s, 10 ms, and a second stage-1 peer on 10 Mbit/s, 100 ms), routed by expected time with
the network counted, and hetero-blind, the same routed by compute only. The relay pipeline runs the uniform
settings (--relay-settings).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import stop_on_sigterm
from benchmarks.gpu_scenarios import SCENARIOS, local_link
from swarm.local import processes
from swarm.local.emulated_links import EmulatedLinks, LinkSpec
from swarm.manifests.loading import write_manifest
from swarm.manifests.manifest import COMPRESSIONS
from swarm.manifests.presets import new_manifest
from swarm.manifests.validation import manifest_from_dict

STAGES = 3
SCENARIO_STAGES = 4  # the GPU-equivalent scenarios' local swarm: llama-1b's 4 stages (the 7B's 8 are not)
TRAINERS = 2
HETERO = [["100mbit/10ms"], ["100mbit/10ms", "10mbit/100ms"], ["100mbit/10ms"]]
SETTINGS = {  # per stage, the links of its peers; the trainers' link; how trainers route
    "unshaped": {"stages": [["unlimited"]] * STAGES, "trainer": "unlimited"},
    "nanogpt": {"stages": [["200mbit/25ms"]] * STAGES, "trainer": "200mbit/25ms"},
    "home20": {"stages": [["20mbit/25ms"]] * STAGES, "trainer": "20mbit/25ms"},
    "home10": {"stages": [["10mbit/50ms"]] * STAGES, "trainer": "10mbit/50ms"},
    "mixed": {"stages": [["100mbit/10ms"], ["20mbit/25ms"], ["10mbit/50ms"]], "trainer": "20mbit/25ms"},
    # stage 1 has a second peer behind a link with 10x the latency and 1/10 the bandwidth
    "hetero": {"stages": HETERO, "trainer": "100mbit/10ms", "routing": "network_aware"},
    "hetero-blind": {"stages": HETERO, "trainer": "100mbit/10ms", "routing": "compute_only"},
}


def manifest_for(pipeline: str, window: int, adaptive: bool, routing: str, compression: str | None) -> dict:
    manifest = new_manifest(f"wan-{pipeline}", "tiny").to_dict(with_peers=False)
    if compression is not None:
        manifest["training"]["activation_compression"] = compression
    manifest["training"]["adaptive_window"] = adaptive  # else always `window` in flight
    manifest["model"]["depth"] = 6  # two layers per stage
    manifest["stages"] = {"count": STAGES}
    manifest["training"]["pipeline"] = pipeline
    manifest["training"]["max_in_flight"] = window
    manifest["training"]["routing"] = routing
    manifest["averaging"]["mode"] = "none"  # one peer per stage: nobody to average with
    return manifest


def run_setting(
    name: str,
    pipeline: str,
    seconds: float,
    warmup: float,
    window: int,
    adaptive: bool,
    compression: str | None,
    folder: Path,
    setting: dict | None = None,
    manifest: dict | None = None,
) -> dict:
    setting = setting or SETTINGS[name]
    routing = setting.get("routing", "network_aware")
    manifest = manifest or manifest_for(pipeline, window, adaptive, routing, compression)
    label = f"{name}-{pipeline}"
    path = folder / f"{label}.json"
    write_manifest_dict(manifest, path)
    started: list[processes.PeerProcess] = []
    common = ["--status-every", "2", "--throughput", "100", "--bandwidth", "1000", "--duration", "900"]
    # each stage peer's link, by name: stage<S>-<replica>
    links_of = {f"stage{s}-{r}": text for s, texts in enumerate(setting["stages"]) for r, text in enumerate(texts)}
    specs = {link: LinkSpec.parse(text) for link, text in links_of.items()}
    specs.update({f"trainer{t}": LinkSpec.parse(setting["trainer"]) for t in range(TRAINERS)})
    with EmulatedLinks(lifetime=seconds + warmup + 600) as links:
        try:
            stage_peers = {}
            for link in links_of:
                stage = int(link.split("-")[0].removeprefix("stage"))
                flags = ["--stage", str(stage), "--no-trainer", *common, *links.peer_flags(link, specs[link])]
                peer = processes.start_local_peer(
                    path, stage, folder / f"{label}-{link}.log", trainer=False, extra=flags
                )
                started.append(peer)
                stage_peers[link] = peer
                if len(started) == 1:
                    manifest["initial_peers"] = [peer.maddr()]
                    path = folder / f"{label}-joined.json"
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
                trainers.append(processes.start_local_peer(path, None, folder / f"{label}-trainer{t}.log", extra=flags))
            started += trainers
            for trainer in trainers:
                trainer.wait_for_json(lambda s: (s.get("trainer_samples") or 0) > 0, timeout=180)
            time.sleep(warmup)
            samples0, carried0, served0 = total_samples(trainers), links.carried(), served(stage_peers)
            begin, cpu0 = time.monotonic(), time.process_time()
            time.sleep(seconds)
            samples1, carried1, took = total_samples(trainers), links.carried(), time.monotonic() - begin
            relay_cpu = (time.process_time() - cpu0) / took  # the emulated links run in this process
            served1 = served(stage_peers)
            windows = [last_line(t).get("trainer_window") for t in trainers]
            failed = sum((last_line(t).get("trainer_failed_microbatches") or 0) for t in trainers)
        finally:
            processes.stop_peers(started)
    samples = max(samples1 - samples0, 1)
    carried = {k: {d: carried1[k][d] - carried0[k][d] for d in ("up", "down")} for k in carried1}
    bounds = []
    for link, spec in specs.items():
        for direction, bits in (("up", spec.up_bits), ("down", spec.down_bits)):
            per_sample = carried[link][direction] / samples
            if bits is not None and per_sample > 0:
                bounds.append(bits / 8 / per_sample)
    trainer_bytes = sum(carried[f"trainer{t}"]["up"] + carried[f"trainer{t}"]["down"] for t in range(TRAINERS))
    uniform = all(len(texts) == 1 and texts[0] == setting["stages"][0][0] for texts in setting["stages"])
    return {
        "setting": name,
        "pipeline": pipeline,
        "routing": routing,
        "activation_compression": manifest["training"]["activation_compression"],
        "links": setting["stages"][0][0] if uniform else {**links_of, "trainers": setting["trainer"]},
        "samples_per_second": round(samples / took, 2),
        "network_bound": round(min(bounds), 2) if bounds else None,
        "trainer_bytes_per_sample": round(trainer_bytes / samples),
        "stage_link_bytes_per_sample": {k: round(sum(carried[k].values()) / samples) for k in links_of},
        "uplink_bytes_per_sample": {k: round(carried[k]["up"] / samples) for k in links_of},
        "samples_served": {k: served1[k] - served0[k] for k in links_of},
        "window": windows,
        "max_window": window,
        "failed_microbatches": failed,
        "relay_cpu_cores": round(relay_cpu, 2),
        "samples": samples,
    }


def scenario_manifest(method: str, microbatches_per_step: int, window: int) -> dict:
    """The local swarm of the GPU-equivalent scenarios: a small Llama in SCENARIO_STAGES stages, 8-bit hidden
    states, or their subspace coordinates at width/16 (as the scenario's GPU model), with the scenario's step
    (the step gate's flush costs a round trip per step, as on the GPUs). `window` 0: the automatic window."""
    manifest = manifest_for("forward", window, True, "network_aware", "8bit")
    manifest["model"] = {
        "architecture": "llama",
        "vocab_size": 256,
        "width": 128,
        "depth": 2 * SCENARIO_STAGES,
        "heads": 4,
        "intermediate_size": 384,
        "context_length": 128,
        "seed": 0,
        "subspace_rank": 8 if method.startswith("subspace") else 0,
    }
    manifest["stages"] = {"count": SCENARIO_STAGES}
    manifest["training"]["microbatches_per_step"] = microbatches_per_step
    if window == 1:
        manifest["training"]["adaptive_window"] = False
    if method == "subspace-4bit":
        manifest["training"]["activation_compression"] = "4bit"
    return manifest


def uniform_links(link: str) -> dict:
    """A scenario's setting: every peer (SCENARIO_STAGES stage peers, the trainers) behind the same link."""
    return {"stages": [[link]] * SCENARIO_STAGES, "trainer": link}


def run_scenarios(names: list[str], methods: list[str], args: argparse.Namespace, folder: Path) -> None:
    """For each method: the local swarm on unshaped links (its compute bound: seconds per microbatch and uplink
    bytes per microbatch of its middle stage), then, per scenario, behind the links that give it the scenario's
    transfer and delay ratios (benchmarks/gpu_scenarios.py), with the trainers' automatic window and with one
    microbatch in flight. One JSON line per scenario and method."""
    seconds = args.seconds or 90.0
    run = dict(pipeline="forward", seconds=seconds, warmup=args.warmup or 30.0, compression=None, folder=folder)
    for method in methods:
        unshaped_runs: dict[int, dict] = {}  # by microbatches per step
        for name in names:
            scenario = SCENARIOS[name]
            steps = args.microbatches_per_step or scenario.microbatches_per_step
            manifest = scenario_manifest(method, steps, args.window)
            if steps not in unshaped_runs:
                unshaped_runs[steps] = run_setting(
                    f"unshaped-{method}-{steps}",
                    **run,
                    window=args.window,
                    adaptive=True,
                    setting=uniform_links("unlimited"),
                    manifest=dict(manifest),
                )
            unshaped = unshaped_runs[steps]
            batch = manifest["training"]["microbatch_size"]
            local_seconds = batch / unshaped["samples_per_second"]
            uplink = unshaped["uplink_bytes_per_sample"]["stage1-0"] * batch
            link = local_link(scenario, method, local_seconds, uplink)
            ratio = scenario.transfer_ratio(method)
            figures = {
                "scenario": name,
                "method": method,
                "microbatches_per_step": steps,
                "gpu_compute_seconds": round(scenario.gpu_compute_seconds(method), 4),
                "gpu_uplink_bytes_per_microbatch": round(scenario.gpu_uplink_bytes(method)),
                "transfer_over_compute": round(ratio, 3),
                "delay_over_compute": round(scenario.delay_ratio(method), 3),
                "arithmetic_bound": round(min(1.0, 1 / ratio), 3),
                "local_link": link,
                "local_seconds_per_microbatch": round(local_seconds, 4),
                "local_uplink_bytes_per_microbatch": round(uplink),
                "compute_bound": unshaped["samples_per_second"],
                "compute_bound_window": unshaped["window"],
            }
            for label, window in (("", args.window), ("_one_in_flight", 1)):
                try:
                    shaped = run_setting(
                        f"{name}-{method}{label}",
                        **run,
                        window=window,
                        adaptive=window != 1,
                        setting=uniform_links(link),
                        manifest=scenario_manifest(method, steps, window),
                    )
                except processes.PeerFailed as e:  # a link so slow that a peer cannot even join: say so, go on
                    figures.update({f"fraction_of_compute_bound{label}": None, f"error{label}": str(e).splitlines()[0]})
                    continue
                fraction = shaped["samples_per_second"] / unshaped["samples_per_second"]
                figures.update(
                    {
                        f"samples_per_second{label}": shaped["samples_per_second"],
                        f"fraction_of_compute_bound{label}": round(fraction, 3),
                        f"projected_tokens_per_second{label}": round(
                            fraction * scenario.compute_bound_tokens_per_second(method)
                        ),
                        f"window{label}": shaped["window"],
                        f"failed_microbatches{label}": shaped["failed_microbatches"],
                    }
                )
            print(json.dumps(figures), flush=True)


def last_line(peer: processes.PeerProcess) -> dict:
    lines = peer.status_lines()
    return lines[-1] if lines else {}


def served(peers: dict[str, processes.PeerProcess]) -> dict[str, int]:
    return {link: last_line(peer).get("samples_served", 0) for link, peer in peers.items()}


def total_samples(trainers: list[processes.PeerProcess]) -> int:
    return sum((t.status_lines()[-1].get("trainer_samples") or 0) for t in trainers)


def write_manifest_dict(manifest: dict, path: Path) -> None:
    write_manifest(manifest_from_dict(manifest), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seconds", type=float, help="measured seconds per run (default 40; with --scenarios 90: several steps)"
    )
    parser.add_argument(
        "--warmup", type=float, help="seconds of training before measuring (default 10; with --scenarios 30)"
    )
    parser.add_argument(
        "--window",
        type=int,
        help="most microbatches in flight per trainer (adaptive below; default 16; with --scenarios the "
        "automatic limit, two steps' worth)",
    )
    parser.add_argument(
        "--microbatches-per-step",
        type=int,
        help="with --scenarios: the local swarm's step (default: the scenario's, 64 as the llama-1b preset)",
    )
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--pipelines", default="forward,relay", help="forward, relay or both (default both)")
    parser.add_argument(
        "--relay-settings", default="unshaped,nanogpt,home20,home10", help="the settings also run with the relay"
    )
    parser.add_argument(
        "--activation-compression",
        choices=COMPRESSIONS,
        help="how stages send activations and gradients (default: the manifest's, 8bit)",
    )
    parser.add_argument("--fixed-window", action="store_true", help="always --window in flight (default: adaptive)")
    parser.add_argument(
        "--scenarios",
        help=f"GPU-equivalent scenarios instead of the settings, comma-separated, of {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--methods", default="8bit,subspace", help="with --scenarios: 8bit, subspace, subspace-4bit")
    args = parser.parse_args()
    if args.scenarios:
        chosen = [n for n in args.scenarios.split(",") if n]
        unknown = [n for n in chosen if n not in SCENARIOS]
        if unknown:
            parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
        stop_on_sigterm()
        folder = Path(tempfile.mkdtemp(prefix="swarm-wan-"))
        print(f"peer logs: {folder}", file=sys.stderr)
        args.window = args.window or 0
        run_scenarios(chosen, args.methods.split(","), args, folder)
        return
    args.seconds, args.warmup, args.window = args.seconds or 40.0, args.warmup or 10.0, args.window or 16
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
        relay_names = [n for n in names if n in args.relay_settings.split(",")]
        for name in names if pipeline == "forward" else relay_names:
            result = run_setting(
                name,
                pipeline,
                args.seconds,
                args.warmup,
                args.window,
                not args.fixed_window,
                args.activation_compression,
                folder,
            )
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
