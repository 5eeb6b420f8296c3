"""Public data benchmark (issue 40): a corpus published by a local HTTP server, each trainer behind its own emulated
home link to it (50 Mbit/s down, 25 ms one way by default), against the same swarm reading a local copy.

    python -m benchmarks.public_data [--tokens 100000000] [--chunk-tokens 1048576] [--trainers 4]
                                      [--link 50mbit/25ms] [--seconds 90] [--work DIR]

1. The corpus: `--tokens` byte tokens of generated text, prepared once into chunks (kept in --work between runs).
2. Reading an epoch (readers.py): `--trainers` data layers alone (no model), each with its
   own DHT node, cache and link, read the whole corpus once as fast as their links allow, handing chunks to each
   other: the first batch's wait, bytes downloaded per byte of tokens read, chunks read twice over the epoch.
3. A real swarm (2 stage peers, `--trainers` trainer-only peers, the fast test model) for `--seconds`: first with
   the data in a folder every peer reads in place (the manifest next to it), then with the data published over
   HTTP and each trainer joining by its own link's URL; halfway through the second run the web server is shut
   down. Samples/s of both, the seconds from a trainer's start to its first trained microbatch in both, bytes
   downloaded per byte trained, and the failed microbatches after the server went.

Prints one JSON line. On 2 CPU cores the model computes far slower than a GPU, so a trainer reads few tokens in a
run: its bytes downloaded per byte trained are dominated by the chunks it fetches ahead (2 chunks beyond the one
it reads); part 2 gives the same ratio over a whole epoch, as a GPU trainer would read it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from benchmarks.common import stop_on_sigterm
from benchmarks.public_data.readers import read_one_epoch
from swarm.dataset.corpus import index_sha256, prepare_corpus
from swarm.dataset.tokenizer import byte_tokenizer
from swarm.local import processes
from swarm.local.emulated_links import EmulatedLinks, LinkSpec
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.manifests.validation import manifest_from_dict

WORDS = "swarm peer stage trainer chunk token data epoch volunteer network model layer gradient".split()


def make_corpus(work: Path, tokens: int, chunk_tokens: int) -> Path:
    """The prepared folder of a generated corpus of about `tokens` byte tokens (made once per size)."""
    site = work / f"site-{tokens}-{chunk_tokens}"
    if (site / "prepared" / "index.json").is_file():
        return site
    source = work / f"corpus-{tokens}"
    if not source.is_dir():
        source.mkdir(parents=True)
        rng = random.Random(0)
        per_file = 4_000_000
        for k in range(max(1, tokens // per_file)):
            words = [rng.choice(WORDS) for _ in range(per_file // 6)]
            (source / f"part{k:04d}.txt").write_text(" ".join(words))
    prepare_corpus(str(source), site / "prepared", byte_tokenizer(), chunk_tokens=chunk_tokens, heldout_fraction=0.01)
    return site


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def web_server(folder: Path, port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def swarm_run(
    site: Path, manifest: dict, trainers: int, seconds: float, urls: list[str] | None, server, work: Path
) -> dict:
    """Stage peers and trainer-only peers for `seconds`; with `urls`, trainer k joins by urls[k] and the web server
    is shut down halfway. Figures from the peers' status lines."""
    (site / "swarm.json").write_text(json.dumps(manifest))
    peers, logs = [], work / f"logs-{'web' if urls else 'local'}-{time.time():.0f}"
    logs.mkdir(parents=True)
    try:
        first = processes.start_local_peer(
            site / "swarm.json", 0, logs / "stage0.log", trainer=False, cache_dir=logs / "c0"
        )
        peers.append(first)
        manifest = {**manifest, "initial_peers": [first.maddr(timeout=120)]}
        (site / "swarm.json").write_text(json.dumps(manifest))
        peers.append(
            processes.start_local_peer(
                site / "swarm.json", 1, logs / "stage1.log", trainer=False, cache_dir=logs / "c1"
            )
        )
        peers[-1].wait_for(r"serving stage 1", timeout=120)
        starts, trainer_peers = [], []
        for k in range(trainers):
            join = urls[k] if urls else str(site / "swarm.json")
            args = [*processes.loopback_args(join), "--trainer-only", "--status-every", "1", "--log-level", "WARNING"]
            starts.append(time.monotonic())
            trainer_peers.append(processes.start_peer(args, logs / f"trainer{k}.log", cache_dir=logs / f"t{k}"))
        peers += trainer_peers
        names = ["stage0", "stage1", *(f"trainer{k}" for k in range(trainers))]
        first_microbatch: list[float | None] = [None] * trainers  # seconds from its start to its first sample
        deadline = time.monotonic() + 300
        while None in first_microbatch and time.monotonic() < deadline:
            for k, peer in enumerate(trainer_peers):
                if first_microbatch[k] is None and any(s.get("trainer_samples", 0) > 0 for s in peer.status_lines()):
                    first_microbatch[k] = round(time.monotonic() - starts[k], 1)
            time.sleep(0.2)
        begin = time.monotonic()
        # the first status line with samples, for each trainer, read back from its output's order of lines
        time.sleep(seconds / 2)
        if urls:
            server.shutdown()  # the published copy goes away mid-run
        killed_at = [p.status_lines()[-1].get("trainer_samples", 0) for p in trainer_peers]
        time.sleep(seconds / 2)
        elapsed = time.monotonic() - begin
        lasts = [p.status_lines()[-1] for p in trainer_peers]
        firsts = [next(s for s in p.status_lines() if s.get("trainer_samples", 0) > 0) for p in trainer_peers]
        cpu = {name: round(group_cpu_seconds(peer.pgid), 1) for name, peer in zip(names, peers)}
        samples = sum(line["trainer_samples"] - first["trainer_samples"] for line, first in zip(lasts, firsts))
        trained_bytes = [line["trainer_samples"] * (manifest["model"]["context_length"] + 1) for line in lasts]
        downloaded = [sum(v for k, v in line["data"]["bytes_from"].items() if k != "folder") for line in lasts]
        return {
            "samples_per_second": round(samples / elapsed, 1),
            "first_microbatch_s": first_microbatch,
            "failed_microbatches": sum(line["trainer_failed_microbatches"] for line in lasts),
            "samples_after_server_gone": sum(line["trainer_samples"] - k for line, k in zip(lasts, killed_at)),
            "downloaded_per_trained_byte": [round(d / max(t, 1), 2) for d, t in zip(downloaded, trained_bytes)],
            "bytes_from": [line["data"]["bytes_from"] for line in lasts],
            "duplicates": sum(line["data"]["duplicates"] for line in lasts),
            "cpu_seconds": cpu,  # of each peer's process group over its whole life
        }
    finally:
        processes.stop_peers(peers)


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) of a process group's members, from /proc."""
    total = 0
    for pid in processes.group_members(pgid):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.public_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--chunk-tokens", type=int, default=1 << 20)
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--link", default="50mbit/25ms", help="each trainer's link to the web server (down/delay)")
    parser.add_argument("--seconds", type=float, default=90.0, help="of each swarm run")
    parser.add_argument(
        "--reader-rate",
        type=float,
        default=150_000,
        help="tokens/s each reader of part 2 reads (default 150k: a chunk of 1 Mi tokens in 7 s, 7 announce periods "
        "of 1 s; a GPU trainer at 30k tokens/s reads the same chunk in 35 s, 7 periods of 5 s)",
    )
    parser.add_argument("--work", default=None, help="keep the corpus here between runs (default: a temporary one)")
    parser.add_argument("--skip-swarm", action="store_true", help="only the reading of an epoch")
    parser.add_argument("--skip-epoch", action="store_true", help="only the swarm runs")
    parser.add_argument("--published-first", action="store_true", help="run the published swarm before the local one")
    parser.add_argument(
        "--repeats", type=int, default=1, help="pairs of swarm runs, alternating which goes first (2 cores are noisy)"
    )
    args = parser.parse_args()
    stop_on_sigterm()
    work = Path(args.work or tempfile.mkdtemp(prefix="public-data-"))
    work.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    site = make_corpus(work, args.tokens, args.chunk_tokens)
    prepared_s = time.monotonic() - began
    index = site / "prepared" / "index.json"
    manifest = fast_test_swarm_dict(data={"source": "prepared", "index_sha256": index_sha256(index), "shards": 4})
    spec = LinkSpec.parse(args.link)
    link = LinkSpec(up_bits=spec.down_bits or spec.up_bits, down_bits=None, delay=spec.delay)  # the server's side
    server = web_server(site)
    result = {"tokens": sum(chunk["tokens"] for chunk in json.loads(index.read_text())["chunks"])}
    result |= {
        "chunk_tokens": args.chunk_tokens,
        "trainers": args.trainers,
        "link": args.link,
        "prepare_s": round(prepared_s, 1),
    }
    with EmulatedLinks() as links:
        ports = [links.add(f"trainer{k}", server.server_address[1], link) for k in range(args.trainers)]
        urls = [f"http://127.0.0.1:{port}/swarm.json" for port in ports]
        (site / "swarm.json").write_text(json.dumps(manifest))
        data_urls = [url.replace("swarm.json", "prepared/") for url in urls]
        if not args.skip_epoch:
            result["epoch_reading"] = asyncio.run(
                read_one_epoch(
                    manifest_from_dict(manifest),
                    data_urls,
                    work / f"readers-{time.time():.0f}",
                    1,
                    args.reader_rate,
                    1800,
                )
            )
        pairs = []
        for repeat in range(0 if args.skip_swarm else args.repeats):
            order = ["published", "local"] if args.published_first != (repeat % 2 == 1) else ["local", "published"]
            pair = {}
            for run in order:
                if run == "published" and repeat:
                    server.server_close()
                    server = web_server(site, server.server_address[1])  # the run before shut it down
                pair[run] = swarm_run(
                    site, manifest, args.trainers, args.seconds, urls if run == "published" else None, server, work
                )
            pairs.append(pair)
        if pairs:
            result["local"], result["published"] = pairs[0]["local"], pairs[0]["published"]
            ratios = [p["published"]["samples_per_second"] / max(p["local"]["samples_per_second"], 1e-9) for p in pairs]
            result["samples_per_second_ratios"] = [round(r, 3) for r in ratios]
            result["samples_per_second_ratio"] = round(statistics.median(ratios), 3)
            result["pairs"] = [
                {
                    run: {k: p[run][k] for k in ("samples_per_second", "first_microbatch_s", "failed_microbatches")}
                    for run in p
                }
                for p in pairs
            ]
    server.server_close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
