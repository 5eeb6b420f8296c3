"""Peers serving spans of stages (balancing.spans; docs/BALANCING.md, "Spans and memory"), in real swarms of
peer processes on loopback: spans that do not line up chain into routes, a hop that ends mid-span goes on at the
next peer, a peer whose span holds the rest goes on when another leaves, and stages average per stage whatever
spans their peers serve."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_manifest_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow(60)]


def span_manifest(**overrides):
    """Four one-block stages, with spans, averaging every 256 samples (`overrides` replace these settings)."""
    settings = {"averaging": {"mode": "parameters", "every_samples": 256, "matchmaking_time": 2.0}, **overrides}
    return tiny_manifest_dict(model={"depth": 4}, stages={"count": 4}, balancing={"spans": True}, **settings)


def test_misaligned_spans_train_and_a_peer_leaving_mid_span_is_routed_around(start_peer, write_manifest):
    raw = span_manifest()
    first = start_peer(
        write_manifest(raw), "--stage", "0", "--span", "2", "--no-trainer", "--status-every", "1", "--offload-optimizer"
    )
    raw["initial_peers"] = [first.maddr()]
    joined = write_manifest(raw, "joined.json")
    middle = start_peer(joined, "--stage", "1", "--span", "3", "--no-trainer", "--status-every", "1")
    tail = start_peer(joined, "--stage", "2", "--span", "2", "--no-trainer", "--status-every", "1")
    trainer = start_peer(joined, "--trainer-only", "--status-every", "1")
    for peer, span in ((first, [0, 2]), (middle, [1, 4]), (tail, [2, 4])):
        peer.wait_for_json(lambda line, span=span: line.get("span") == span and line.get("state") == "online", 90)
    begun = trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= 400, 120, "training")
    # the spans that do not line up carry microbatches: [0, 2] then [2, 4] (the middle peer's [1, 4] is a route of
    # as many hops, which the trainer takes only when the others are busy: it carries them once the tail is gone)
    for name, peer in (("first", first), ("tail", tail)):
        peer.wait_for_json(lambda line: line.get("samples_served", 0) > 0, 60, f"{name} serving")
    assert "--offload-optimizer has no effect on a CPU peer" in first.output()

    # peers average each stage they share, whatever spans they serve: stage 1 (first and middle), stages 2 and 3
    # (middle and tail); the first peer's stage 0 has no partner
    def averaged(peer, stage: int) -> int:
        line = peer.status_lines()[-1]
        return next(each["averaging_rounds"] for each in line.get("span_stages", []) if each["stage"] == stage)

    for peer, stage in ((first, 1), (middle, 1), (middle, 2), (middle, 3), (tail, 3)):
        peer.wait_for_json(lambda line, p=peer, s=stage: averaged(p, s) >= 1, 120, f"stage {stage} averaged")
    assert averaged(first, 0) == 0
    # a peer whose span ends mid-way through another's leaves: the hops before it go on through the middle peer
    tail.kill()
    after = begun["trainer_samples"] + 400
    line = trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= after, 120, "training on")
    assert line["trainer_loss"] is not None and line["trainer_loss"] < 5.0, line
    middle.wait_for_json(lambda line: line.get("samples_served", 0) > 0, 30, "the middle peer serving")
    for peer in (first, middle, trainer):
        assert peer.process.poll() is None


def test_a_span_that_does_not_fit_together_is_refused_and_spans_need_a_spans_swarm(start_peer, write_manifest):
    from peers.swarm_peer import main

    no_spans = write_manifest(tiny_manifest_dict(), "plain.json")
    assert main(["--join", str(no_spans), "--stage", "0", "--span", "2", "--no-trainer"]) == 2
    spans = write_manifest(span_manifest(), "spans.json")
    assert main(["--join", str(spans), "--stage", "3", "--span", "2", "--no-trainer"]) == 2


def memory_for(manifest_dict, stages: int) -> str:
    """A --max-memory under which a CPU peer of this swarm holds `stages` stages from a middle start, not one
    more: the peers' own arithmetic (swarm/capacity/costs.py) sets it."""
    from swarm.capacity.budget import MARGIN
    from swarm.capacity.costs import MemorySettings, longest_span, span_cost
    from swarm.manifests.validation import manifest_from_dict

    manifest, cpu = manifest_from_dict(manifest_dict), MemorySettings(cuda=False)
    needed = max(span_cost(manifest, start, start + stages, cpu).device_bytes for start in range(4 - stages + 1))
    cap = int(needed / (1 - MARGIN)) + 1024
    assert longest_span(manifest, 1, int(cap * (1 - MARGIN)), cpu) == min(stages, 3)
    return str(cap)


def planned(manifest_path, machines: str, capsys) -> dict:
    """swarm-plan's JSON for CPU machines: what the peers of this swarm would serve."""
    from peers.swarm_plan import main

    capsys.readouterr()
    assert main(["--join", str(manifest_path), "--expect", machines, "--cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_peers_choose_spans_by_their_memory_and_cover_the_blocks_of_a_large_peer_that_leaves(
    start_peer, write_manifest, capsys
):
    # no averaging (this test's peers choose and cover spans; the averaging of spans is the test above's): a peer
    # without averagers starts and moves seconds sooner (it forks one per stage of its span otherwise)
    raw = span_manifest(averaging={"mode": "none"})
    large = start_peer(write_manifest(raw), "--stage", "0", "--span", "4", "--no-trainer", "--status-every", "1")
    raw["initial_peers"] = [large.maddr()]
    joined = write_manifest(raw, "joined.json")
    large.wait_for_json(lambda line: line.get("state") == "online", 90, "the large peer online")
    cap = memory_for(raw, 2)
    small = [start_peer(joined, "--max-memory", cap, "--no-trainer", "--status-every", "1") for _ in range(2)]
    trainer = start_peer(joined, "--trainer-only", "--status-every", "1")
    # the plan, made before anyone started, says what these peers do: two blocks each, in the memory they announce
    plan = planned(joined, f"2x{cap}@1TF/100mbit", capsys)
    assert plan["mode"] == "spans" and plan["kinds"][0]["blocks"] == 2, plan
    too_small = planned(joined, f"{int(cap) // 8}@1TF/100mbit", capsys)
    assert too_small["kinds"][0]["serving"] == 0, too_small
    # each serves as many stages as its memory holds from where it starts: two (the last stage alone, where the
    # swarm's weakest stage is the last: a span of two there would spread its rate over a stage that needs less)
    for peer in small:
        line = peer.wait_for_json(lambda line: line.get("state") == "online", 90, "online")
        start, end = line["span"]
        assert end - start == min(plan["kinds"][0]["blocks"], 4 - start), line
        assert line["memory_available"] == int(cap) and 0 < line["memory_used"], line
    trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= 200, 120, "training")

    # between them the two small peers hold every stage: where both took the same two, one moves
    def spans() -> list[list[int]]:
        return sorted(peer.status_lines()[-1]["span"] for peer in small)

    large.kill()
    trainer.wait_for_json(lambda line: spans() == [[0, 2], [2, 4]], 120, "the small peers covering all stages")
    samples = trainer.status_lines()[-1]["trainer_samples"]
    trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= samples + 200, 120, "training on")
