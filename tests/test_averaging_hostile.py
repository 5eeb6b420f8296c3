"""Averaging with hostile replicas, against real hivemind averagers on loopback: a replica that poisons its
contribution, one whose reducer lies about its part, and an outsider of a private swarm."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from averaging_replicas import averaging_manifest, distance, loopback_dhts, replicas_of, run_round
from conftest import tiny_manifest_dict
from swarm.averaging.robust_allreduce import RobustReducer
from swarm.errors import AveragingError
from swarm.manifests.loading import load_manifest


@pytest.fixture
def dhts():
    yield from loopback_dhts()


def _train_step(params, averager, seed):
    """One local optimizer step on a made-up loss: a replica that keeps training."""
    torch.manual_seed(seed)
    loss = sum((p * torch.randn_like(p)).sum() for p in params)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    averager.optimizer.step()
    averager.optimizer.zero_grad()


def _close_replicas(manifest, dhts, drift=1e-3, first_seed=100):
    """Replicas of one stage as they are between two rounds: the same parameters, each a few local steps away."""
    replicas = replicas_of(manifest, dhts, seeds=[0] * len(dhts))
    for k, (params, _) in enumerate(replicas):
        torch.manual_seed(first_seed + k)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p) * drift)
    return replicas


POISONS = {
    "nan": lambda value: torch.full_like(value, float("nan")),
    "inf": lambda value: torch.full_like(value, float("inf")),
    "huge": lambda value: torch.full_like(value, 1e6),
    "scaled": lambda value: value * 1.5,
    "sign-flipped": lambda value: -value,
    "stale": lambda value: value + torch.randn_like(value) * 0.02,  # parameters of many rounds ago
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_poisoning_replica_is_outvoted_and_flagged(dhts, poison):
    """One replica of three sends bad values (absurd or plausible) and claims a huge weight: the honest replicas'
    round still happens, ends at the honest replicas' mean (CenteredClip without the outlier), and flags it."""
    manifest = averaging_manifest(mode="parameters", compression="float32")
    replicas = _close_replicas(manifest, dhts(3))
    honest, (_, attacker) = replicas[:2], replicas[2]
    try:
        before = [[p.detach().clone() for p in params] for params, _ in honest]
        honest_mean = [(a + b) / 2 for a, b in zip(*before)]
        for _, averager in replicas:
            averager.begin_round()
        with attacker._averager.get_tensors() as buffers:  # what a malicious peer sends instead of its parameters
            for buffer in buffers:
                buffer.copy_(POISONS[poison](buffer))
        errors: dict[int, Exception] = {}

        def run(i, averager, weight):
            try:
                averager.run_round(weight, timeout=15)
            except AveragingError as e:
                errors[i] = e

        weights = [1.0, 1.0, 1e6]
        threads = [threading.Thread(target=run, args=(i, a, weights[i])) for i, (_, a) in enumerate(replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert 0 not in errors and 1 not in errors, errors  # (the attacker may see its own values as far off)
        for params, averager in honest:
            averager.finish_round(averaged=True)
            assert all(torch.isfinite(p).all() for p in params)
            assert distance([p.detach() for p in params], honest_mean) < 1e-3 * distance(before[0], before[1])
            assert averager.strikes >= 1  # it saw the attacker's contribution for what it was
        attacker.finish_round(averaged=False)
    finally:
        for _, averager in replicas:
            averager.shutdown()


def test_a_dishonest_reducer_fails_the_round_is_excluded_and_the_honest_replicas_go_on(dhts, monkeypatch):
    """A replica whose reducer sends back a wrong result for its part (the aggregate, sign-flipped: finite, of the
    right size): the honest replicas see that the result lies far from their own parts, apply nothing, strike it,
    and after a second such round exclude it; then they average with each other."""
    manifest = averaging_manifest(mode="parameters", compression="float32")
    three = dhts(3)
    honest = _close_replicas(manifest, three[:2])
    original = RobustReducer.check_current_part_finished

    def lying(self):
        future = self.current_part_future
        original(self)
        if future.done() and not future.cancelled():
            future.result().neg_()  # the aggregate it sends back, in place

    monkeypatch.setattr(RobustReducer, "check_current_part_finished", lying)
    attacker = _close_replicas(manifest, three[2:], first_seed=200)[
        0
    ]  # its averager's process forks with the lying reducer
    monkeypatch.undo()
    replicas = [*honest, attacker]
    try:
        for _ in range(2):
            before = [[p.detach().clone() for p in params] for params, _ in honest]
            for _, averager in replicas:
                averager.begin_round()
            errors: dict[int, Exception] = {}

            def run(i, averager, errors=errors):
                try:
                    averager.run_round(1.0, timeout=15)
                except AveragingError as e:
                    errors[i] = e

            threads = [threading.Thread(target=run, args=(i, a)) for i, (_, a) in enumerate(replicas)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert 0 in errors and 1 in errors, errors  # both honest replicas refused the round
            assert all("far from" in str(errors[i]) for i in (0, 1)), errors
            for (params, averager), previous in zip(honest, before):
                averager.finish_round(averaged=False)
                assert distance([p.detach() for p in params], previous) == 0
            attacker[1].finish_round(averaged=False)
        assert all(averager.exclusions >= 1 for _, averager in honest)
        # the honest replicas no longer admit it, and average with each other
        for k, (params, averager) in enumerate(honest):
            _train_step(params, averager, seed=k)
        assert run_round(honest, [1.0, 1.0]) == [2, 2]
        assert distance(honest[0][0], honest[1][0]) < 1e-4
    finally:
        for _, averager in replicas:
            averager.shutdown()


def test_rounds_of_a_private_swarm_admit_no_outsider(dhts, tmp_path):
    """An outsider that even knows where the members meet (the prefix) but cannot prove that it holds the secret
    is refused by a member that leads the group, and a member that joins the outsider's group drops the round."""
    (tmp_path / "secret").write_text("a" * 64)
    raw = tiny_manifest_dict(network={"secret_file": "secret"})
    raw["averaging"] = {"matchmaking_time": 2.0, "timeout": 20.0, "mode": "parameters", "compression": "float32"}
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(json.dumps(raw))
    manifest = load_manifest(manifest_path)
    # plain DHTs (no authorizer): this tests the averaging's own check, as if the outsider got past the DHT's
    ((params, member), (_, outsider)) = replicas_of(manifest, dhts(2), seeds=[1, 2])
    outsider._proof = "0" * 32  # the worst case: the outsider meets under the members' prefix, without the secret
    try:
        before = [p.detach().clone() for p in params]
        for averager in (member, outsider):
            averager.begin_round()
        errors: dict[str, Exception] = {}

        def run(name, averager):
            try:
                averager.run_round(1.0, timeout=8)
            except AveragingError as e:
                errors[name] = e

        threads = [threading.Thread(target=run, args=a) for a in (("member", member), ("outsider", outsider))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert "member" in errors  # no group with the outsider, or a group whose result it dropped
        member.finish_round(averaged=False)
        assert distance([p.detach() for p in params], before) == 0
    finally:
        for averager in (member, outsider):
            averager.shutdown()
