"""Models benchmark: the tiny Llama against the tiny GPT, at about equal parameters and the same tokens, on the
standard-library corpus; held-out loss per token and in bits per byte; in one process and in a 2-stage swarm.

    python -m benchmarks.models [--samples 8192] [--runs process,swarm] [--models gpt,llama] [--bpe 0]
    python -m benchmarks.models --models llama --bpe 2048      # also a Llama on a BPE trained on the corpus

gpt is the `tiny` preset (0.875M parameters), llama `llama-tiny` (0.853M: 4 heads, 2 KV heads, SwiGLU of 384), with
the same training settings (microbatch 16, context 128, AdamW at 0.002, 2 microbatches per step, clipping 1.0).
Both read the corpus through the swarm's data path (prepared byte shards, one TrainingStream per trainer). One
process: the whole model, optimizer steps as the stages take them. Swarm: two local peers (one per stage, one
thread each, float32) and one trainer in this process, then the stages' parameters downloaded and assembled.
Held-out: the first 96 non-overlapping windows of the held-out part (12,288 tokens), the same for every run of a
tokenizer; bits per byte = nats per token x tokens / bytes of those windows' text / ln 2, which compares runs
with different tokenizers (--bpe: a byte-level BPE of that many ids trained on the corpus's train part first).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import download_parameters, online_by_stage, stop_on_sigterm, wait_online
from swarm.architectures.model import build_full_model, count_parameters
from swarm.client.export import assemble_full_state
from swarm.client.trainer import Trainer
from swarm.dataset.corpus import ensure_prepared
from swarm.dataset.documents import training_texts
from swarm.dataset.shards import TokenShards, TrainingStream, bits_per_byte
from swarm.dataset.tokenizer import Tokenizer, byte_tokenizer, train_tokenizer
from swarm.dht import node
from swarm.local.processes import start_local_peer, stop_peers
from swarm.manifests.manifest import Manifest
from swarm.manifests.presets import new_manifest
from swarm.wire.state import make_optimizer

PRESETS = {"gpt": "tiny", "llama": "llama-tiny"}
EVAL_WINDOWS = 96


def manifest_for(model: str, tokenizer: Tokenizer, tokenizer_path: Path | None) -> Manifest:
    data = {}
    if tokenizer_path is not None:
        data = {"tokenizer": str(tokenizer_path), "tokenizer_sha256": tokenizer.sha256}
    overrides = {"vocab_size": tokenizer.vocab_size} if not tokenizer.is_bytes else {}
    return new_manifest(f"models-{model}", PRESETS[model], model=overrides, data=data)


def heldout_windows(shards: TokenShards, length: int) -> list[torch.Tensor]:
    tokens = np.asarray(shards.heldout[: EVAL_WINDOWS * (length + 1)], dtype=np.int64)
    return [torch.from_numpy(tokens[i * (length + 1) : (i + 1) * (length + 1)]) for i in range(EVAL_WINDOWS)]


@torch.no_grad()
def evaluate(manifest: Manifest, state: dict[str, torch.Tensor], windows, tokenizer: Tokenizer) -> dict:
    model = build_full_model(manifest.model)
    model.load_state_dict(state, strict=False)
    model.eval()
    batch = torch.stack(windows)
    loss = float(model.loss(model(batch[:, :-1]), batch[:, 1:]))
    targets = batch[:, 1:].reshape(-1).tolist()
    text_bytes = len(tokenizer.decode(targets).encode("utf-8"))
    return {
        "heldout_loss_per_token": round(loss, 4),
        "heldout_bits_per_byte": round(bits_per_byte(loss, len(targets), text_bytes), 4),
    }


def one_process(manifest: Manifest, shards: TokenShards, samples: int, windows, tokenizer: Tokenizer) -> dict:
    torch.manual_seed(0)
    model = build_full_model(manifest.model)
    params = list(model.parameters())
    optimizer = make_optimizer(manifest, params)
    training = manifest.training
    stream = TrainingStream(shards, "one-process")
    begin, done = time.monotonic(), 0
    while done < samples:
        for _ in range(training.microbatches_per_step):
            x, y = stream.next_batch(training.microbatch_size, manifest.model.context_length)
            (model.loss(model(x), y) / training.microbatches_per_step).backward()
            done += x.shape[0]
        torch.nn.utils.clip_grad_norm_(params, training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.monotonic() - begin
    state = {name: p.detach() for name, p in model.named_parameters()}
    return {**evaluate(manifest, state, windows, tokenizer), "samples_per_second": round(samples / seconds, 1)}


def swarm(manifest: Manifest, shards: TokenShards, samples: int, windows, tokenizer: Tokenizer, work: Path) -> dict:
    dht = node.start_dht([], node.LOOPBACK)
    manifest = manifest.with_initial_peers([str(a) for a in dht.get_visible_maddrs()])
    path = work / f"{manifest.name}.json"
    path.write_text(manifest.to_json())
    peers = []
    try:
        for stage in range(manifest.num_stages):
            log = work / f"{manifest.name}-stage{stage}.log"
            peers.append(start_local_peer(path, stage, log, trainer=False, cache_dir=work / "cache"))

        async def drive() -> dict:
            p2p = await dht.replicate_p2p()
            if not await wait_online(dht, manifest, 1, timeout=180):
                raise RuntimeError("the swarm's peers did not come online within 3 minutes")
            trainer = Trainer(manifest, dht, p2p, f"{dht.peer_id}-trainer", seed=0)
            begin = time.monotonic()
            await trainer.train(TrainingStream(shards, "swarm-trainer"), asyncio.Event(), max_samples=samples)
            seconds = time.monotonic() - begin
            states = await download_parameters(p2p, manifest, await online_by_stage(dht, manifest))
            await p2p.shutdown()
            state = assemble_full_state(manifest, [replicas[0] for replicas in states])
            return {
                **evaluate(manifest, state, windows, tokenizer),
                "samples_per_second": round(trainer.samples / seconds, 1),
                "failed_microbatches": trainer.failed_microbatches,
            }

        return asyncio.run(drive())
    finally:
        stop_peers(peers)
        dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8192, help="samples per run (128 tokens each)")
    parser.add_argument("--runs", default="process,swarm", help="process, swarm or both")
    parser.add_argument("--models", default="gpt,llama", help="gpt, llama or both")
    parser.add_argument("--bpe", type=int, default=0, metavar="SIZE", help="also: llama on a BPE of SIZE ids")
    args = parser.parse_args()
    stop_on_sigterm()
    torch.set_num_threads(1)  # as the peers (one thread each): the same compute per process
    result: dict = {"samples": args.samples}
    with tempfile.TemporaryDirectory(prefix="swarm-models-") as folder:
        work = Path(folder)
        setups: list[tuple[str, str, Tokenizer, Path | None]] = [
            (name, name, byte_tokenizer(), None) for name in args.models.split(",")
        ]
        if args.bpe:
            begin = time.monotonic()
            bpe = train_tokenizer(training_texts("stdlib", max_bytes=20_000_000), args.bpe)
            result["bpe_training_seconds"] = round(time.monotonic() - begin, 1)
            setups.append((f"llama-bpe{args.bpe}", "llama", bpe, bpe.save_as(work / "tokenizer.json")))
        for key, model, tokenizer, tokenizer_path in setups:
            manifest = manifest_for(model, tokenizer, tokenizer_path)
            manifest = dataclasses.replace(manifest, origin=str(work))
            shards = TokenShards.open(
                ensure_prepared(
                    "stdlib", tokenizer, work / "data", manifest.data.shards, manifest.data.heldout_fraction
                )
            )
            windows = heldout_windows(shards, manifest.model.context_length)
            entry: dict = {"parameters": count_parameters(build_full_model(manifest.model))}
            if "process" in args.runs:
                entry["process"] = one_process(manifest, shards, args.samples, windows, tokenizer)
            if "swarm" in args.runs:
                entry["swarm"] = swarm(manifest, shards, args.samples, windows, tokenizer, work)
            result[key] = entry
            print(json.dumps({key: entry}), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
