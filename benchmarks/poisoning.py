"""Poisoning benchmark: a stage of four replicas, one of them hostile, averaging with real hivemind rounds.

    python -m benchmarks.poisoning [--rounds 20] [--honest-rounds 60] [--steps-per-round 20]
                                   [--attacks none,scaled,sign-flipped,stale,noise] [--compression float32]

Four replicas of the tiny test model (the whole model as one stage), each with its own AdamW and data shard, in
this process; their StageAveragers (hivemind DecentralizedAverager processes, loopback) average their parameters
after every `--steps-per-round` local steps, with the robust all-reduce (swarm/averaging/robust_allreduce.py). One replica
is the attacker: before every round it replaces what it sends with, by attack,

- none: nothing (an honest fourth replica: the baseline),
- scaled: its parameters x 1.5,
- sign-flipped: minus its parameters,
- stale: the parameters of the first round (a replica that stopped training and replays an old copy),
- noise: its parameters plus noise ten times as large as a round's drift,

and claims a weight of a million. Its own round result is thrown away (it keeps training on its own, so that its
contributions stay as plausible as they can). Figures per attack: the honest replicas' mean held-out loss at the
end, against the run without an attacker; the share of the honest replicas' rounds that were applied; the
strikes and exclusions they gave. Then a run of `--honest-rounds` rounds without an attacker, where every strike is
a false flag. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time

import numpy as np
import torch

from benchmarks.common import heldout_loss
from swarm.architectures.model import build_full_model
from swarm.averaging.averager import StageAverager
from swarm.dataset.shards import TextData, heldout_batches, sample_batch
from swarm.dht import node
from swarm.errors import AveragingError
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict

REPLICAS = 4
ATTACKER = REPLICAS - 1
ATTACKS = ("none", "scaled", "sign-flipped", "stale", "noise")


class Replica:
    def __init__(self, manifest: Manifest, dht, shard: int):
        self.model = build_full_model(manifest.model)  # the same initial parameters at every replica
        named = list(self.model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.optimizer = torch.optim.AdamW(self.params, lr=manifest.training.learning_rate)
        self.averager = StageAverager(manifest, 0, dht, self.names, self.params, self.optimizer)
        self.tokens = TextData.load(manifest.data.source, manifest.data.heldout_fraction, shard, REPLICAS).train
        self.rng = np.random.default_rng(shard)
        self.applied = self.rounds = 0

    def train(self, manifest: Manifest, steps: int) -> None:
        training = manifest.training
        for _ in range(steps):
            x, y = sample_batch(self.tokens, training.microbatch_size, manifest.model.context_length, self.rng)
            self.model.loss(self.model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(self.params, training.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in zip(self.names, self.params)}


def poison(attack: str, buffers, stale: list[torch.Tensor], drift: float) -> None:
    for buffer, old in zip(buffers, stale):
        if attack == "scaled":
            buffer.mul_(1.5)
        elif attack == "sign-flipped":
            buffer.neg_()
        elif attack == "stale":
            buffer.copy_(old)
        elif attack == "noise":
            buffer.add_(torch.randn_like(buffer) * 10 * drift)


def run(manifest: Manifest, attack: str, rounds: int, steps: int, batches) -> dict:
    dhts = [node.start_dht([], node.LOOPBACK)]
    maddrs = [str(a) for a in dhts[0].get_visible_maddrs()]
    dhts += [node.start_dht(maddrs, node.LOOPBACK) for _ in range(REPLICAS - 1)]
    replicas = [Replica(manifest, dht, shard) for shard, dht in enumerate(dhts)]
    ids = [str(dht.peer_id) for dht in dhts]
    stale = [p.detach().clone() for p in replicas[ATTACKER].params]
    begin = time.monotonic()
    try:
        for _ in range(rounds):
            before = [p.detach().clone() for p in replicas[0].params]
            for replica in replicas:
                replica.train(manifest, steps)
            drift = float(torch.cat([(p.detach() - b).flatten() for p, b in zip(replicas[0].params, before)]).std())
            for replica in replicas:
                replica.averager.begin_round()
            if attack != "none":
                with replicas[ATTACKER].averager._averager.get_tensors() as buffers:
                    poison(attack, buffers, stale, drift)
            outcomes: dict[int, bool] = {}

            def one(i: int, outcomes: dict[int, bool] = outcomes) -> None:
                hostile = i == ATTACKER and attack != "none"
                weight = 1e6 if hostile else float(steps)
                try:  # an excluded attacker finds no group: it gives up sooner, not to hold up the next round
                    replicas[i].averager.run_round(weight, timeout=6 if hostile else 20)
                    outcomes[i] = True
                except AveragingError:
                    outcomes[i] = False

            threads = [threading.Thread(target=one, args=(i,)) for i in range(REPLICAS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            for i, replica in enumerate(replicas):
                honest = i != ATTACKER or attack == "none"
                try:
                    replica.averager.finish_round(averaged=outcomes.get(i, False) and honest)
                    replica.applied += outcomes.get(i, False) and honest
                except AveragingError:
                    pass
                replica.rounds += 1
        honest = replicas if attack == "none" else replicas[:ATTACKER]
        losses = [heldout_loss(manifest, r.state(), batches) for r in honest]
        strikes = sum(r.averager.strikes for r in honest)
        return {
            "attack": attack,
            "rounds": rounds,
            "heldout_loss": round(float(np.mean(losses)), 4),
            "heldout_losses": [round(x, 4) for x in losses],
            "rounds_applied": round(sum(r.applied for r in honest) / sum(r.rounds for r in honest), 3),
            "strikes": strikes,
            "exclusions": sum(r.averager.exclusions for r in honest),
            "seconds": round(time.monotonic() - begin, 1),
            "peers": ids,
        }
    finally:
        for replica in replicas:
            replica.averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--honest-rounds", type=int, default=60, help="rounds of the run without an attacker")
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--compression", default="float32", choices=["float32", "float16", "8bit"])
    args = parser.parse_args()
    raw = fast_test_swarm_dict()
    raw["averaging"] = {"mode": "parameters", "compression": args.compression, "matchmaking_time": 1.0, "timeout": 20}
    manifest = manifest_from_dict(raw)
    manifest = dataclasses.replace(manifest, initial_peers=())
    heldout = TextData.load(manifest.data.source, manifest.data.heldout_fraction, 0, REPLICAS).heldout
    batches = heldout_batches(heldout, 16, manifest.training.microbatch_size, manifest.model.context_length)
    results = []
    for attack in args.attacks.split(","):
        results.append(run(manifest, attack, args.rounds, args.steps_per_round, batches))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    baseline = next((r["heldout_loss"] for r in results if r["attack"] == "none"), None)
    for r in results:
        r.pop("peers")
        if baseline is not None:
            r["loss_vs_no_attacker"] = round(r["heldout_loss"] / baseline - 1, 4)
    honest = None
    if args.honest_rounds > 0:  # a long run without an attacker: every strike there is a false flag
        honest = run(manifest, "none", args.honest_rounds, args.steps_per_round, batches)
        honest.pop("peers")
    summary = {"replicas": REPLICAS, "steps_per_round": args.steps_per_round, "compression": args.compression}
    print(json.dumps({**summary, "results": results, "honest_long_run": honest}))


if __name__ == "__main__":
    main()
