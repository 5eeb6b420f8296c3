"""What a span of stages costs in memory, how many stages fit, where a span goes, and the plan of a swarm of
expected machines (swarm/capacity/, swarm/balancing/spans.py): pure functions, with the estimates checked against
built modules."""

from __future__ import annotations

import json
import random

import pytest
import torch

from swarm.architectures.model import StageModel, count_parameters
from swarm.balancing.spans import SpanPeer, better_span, choose_span, coverage, holders, upper_bound
from swarm.capacity.budget import MemoryBudget, check_fits, parse_memory, usable_budget
from swarm.capacity.costs import MemorySettings, activation_bytes_per_token, longest_span, span_cost, span_lengths
from swarm.capacity.plan import parse_expect, plan_swarm
from swarm.capacity.role import slow_serving_reason
from swarm.errors import BalancingError, CapacityError
from swarm.manifests.presets import new_manifest

GIB = 1 << 30


def small(arch: str, precision: str, checkpointing: bool = False, stages: int = 2):
    model = {"architecture": arch, "width": 256, "depth": 4, "heads": 4, "context_length": 128, "vocab_size": 256}
    if arch == "llama":
        model.update(kv_heads=2, intermediate_size=704)
    training = {"precision": precision, "microbatch_size": 4, "activation_checkpointing": checkpointing}
    return new_manifest("capacity", "tiny", stages=stages, model=model, training=training)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_activation_estimate_is_close_to_what_autograd_saves(arch, precision):
    """A middle block's saved tensors (unique storages, weights left out) against the formula: never more than 15%
    under (a peer would run out of memory), at most 25% over (it would serve fewer blocks than it could)."""
    manifest = small(arch, precision)
    stage = StageModel(manifest.model, range(1, 2), first=False, last=False, precision=precision)
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    inputs = torch.randn(4, 128, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        stage(inputs)
    measured = sum(saved.values()) / (4 * 128)
    assert 0.85 <= activation_bytes_per_token(manifest) / measured <= 1.25, (measured, arch, precision)


def test_a_spans_parameters_are_the_built_modules():
    manifest = small("llama", "float32", stages=4)
    for start, end in [(0, 1), (1, 3), (3, 4), (0, 4)]:
        layers = range(manifest.stage_layers(start).start, manifest.stage_layers(end - 1).stop)
        built = StageModel(manifest.model, layers, first=start == 0, last=end == 4)
        assert span_cost(manifest, start, end).parameters == count_parameters(built)


def test_span_lengths_follow_memory_precision_checkpointing_and_offload():
    base = new_manifest("x", "llama-1b", stages=22)  # one block a stage, bfloat16, checkpointing
    lengths = {gib: longest_span(base, 5, gib * GIB) for gib in (2, 4, 8, 16, 24, 80)}
    assert lengths[2] == 0 and 1 <= lengths[4] < lengths[8] < lengths[16] < lengths[24] <= lengths[80]
    budget = 8 * GIB
    offloaded = longest_span(base, 5, budget, MemorySettings(offload_optimizer=True))
    assert offloaded > lengths[8]
    without_checkpointing = new_manifest("x", "llama-1b", stages=22, training={"activation_checkpointing": False})
    assert longest_span(without_checkpointing, 5, budget) < lengths[8]
    in_float32 = new_manifest("x", "llama-1b", stages=22, training={"precision": "float32"})
    assert span_cost(in_float32, 5, 6).parts["compute_copies"] == 0
    assert span_cost(base, 5, 6).parts["compute_copies"] == 2 * span_cost(base, 5, 6).parameters
    # the first and last stages hold the embeddings, the head and the loss chunk: they fit fewer from there
    per_start = span_lengths(base, 8 * GIB)
    assert per_start[-1] <= 1 and per_start[0] <= per_start[5]
    # fewer kept microbatches, more blocks; a CPU peer counts its averaging copies against the same memory
    assert longest_span(base, 5, budget, MemorySettings(kept_microbatches=1)) > lengths[8]
    cpu, gpu = span_cost(base, 5, 6, MemorySettings(cuda=False)), span_cost(base, 5, 6)
    assert cpu.host_bytes == 0 and cpu.device_bytes - cpu.parts["runtime"] > gpu.device_bytes - gpu.parts["runtime"]


def test_a_peer_that_cannot_hold_a_stage_is_told_the_numbers_and_what_to_do():
    manifest = new_manifest("x", "llama-1b")  # 4 stages of 5-6 blocks
    budget = usable_budget(torch.device("cpu"), available=8 * GIB)
    with pytest.raises(CapacityError) as refused:
        check_fits(manifest, 1, budget, MemorySettings())
    message = str(refused.value)
    assert "stage 1 needs" in message and "GiB" in message and "7.20 GiB usable" in message
    assert "swarm-plan" in message and "--trainer-only" in message and "\n" not in message
    roomy = MemoryBudget("cuda:0", 40 * GIB, None, 36 * GIB)
    assert check_fits(manifest, 1, roomy, MemorySettings()).device_bytes < 36 * GIB
    capped = usable_budget(torch.device("cpu"), max_memory=2 * GIB, available=8 * GIB)
    assert capped.usable == int(2 * GIB * 0.9) and "--max-memory" in capped.describe()


@pytest.mark.parametrize(
    "text,expected", [("24GB", 24e9), ("7.5GiB", 7.5 * GIB), ("512 MB", 512e6), ("1048576", 1 << 20), ("8gb", 8e9)]
)
def test_memory_sizes_are_read(text, expected):
    assert parse_memory(text) == int(expected)


@pytest.mark.parametrize("text", ["", "GB", "-3GB", "8 parsecs", "1e400GB", "0", "nan", "8GB; rm -rf /"])
def test_bad_memory_sizes_are_refused(text):
    with pytest.raises(CapacityError):
        parse_memory(text)


def test_expected_machines_are_read_and_bad_ones_refused():
    kinds = parse_expect("10x24GB@165TF/200mbit, 20x8GB@40TF/50mbit,16GB@80tflops/1gbit")
    assert [(k.count, k.memory, k.flops, k.uplink_bits) for k in kinds] == [
        (10, 24e9, 165e12, 200e6),
        (20, 8e9, 40e12, 50e6),
        (1, 16e9, 80e12, 1e9),
    ]
    for bad in ("10x24GB", "0x8GB@40TF/50mbit", "8GB@0TF/50mbit", "8GB@40TF/50", "x8GB@40TF/50mbit", ""):
        with pytest.raises(CapacityError):
            parse_expect(bad)


def test_a_span_goes_where_the_swarm_is_weakest():
    blocks = [1.0] * 6
    others = [SpanPeer("a", 6.0, 100.0, 0, 3), SpanPeer("b", 6.0, 100.0, 0, 2)]
    new = SpanPeer("new", 6.0, 100.0)
    assert choose_span(new, others, [3] * 4 + [2, 1], blocks, random.Random(0)) == (3, 6)
    assert choose_span(new, others, [0] * 6, blocks, random.Random(0)) is None  # nothing fits anywhere
    # a longer span of a compute-bound peer carries the same work: each stage gets a share of it
    assert SpanPeer("c", 6.0, 100.0).rate(3) == 2.0 and SpanPeer("c", 6.0, 1.0).rate(3) == 1.0
    assert coverage([*others, SpanPeer("new", 6.0, 100.0, 3, 6)], blocks) == [5.0, 5.0, 2.0, 2.0, 2.0, 2.0]
    with pytest.raises(BalancingError):
        choose_span(new, others, [1] * 5, blocks, random.Random(0))


def test_when_a_large_peer_leaves_one_small_peer_moves_to_cover_its_blocks():
    blocks, lengths = [1.0] * 4, [2, 2, 2, 0]
    small_peers = [SpanPeer(f"s{i}", 2.0, 100.0, 0, 2) for i in range(3)]
    big = SpanPeer("big", 8.0, 100.0, 2, 4)
    assert better_span(small_peers[0], [*small_peers, big], lengths, blocks, random.Random(0)) is None  # balanced
    moves = []
    for i, peer in enumerate(small_peers):  # big left: stages 2-3 have nobody
        span = better_span(peer, small_peers, lengths, blocks, random.Random(0))
        if span is not None:
            small_peers[i] = SpanPeer(peer.peer_id, peer.compute, peer.network, *span)
            moves.append(span)
    assert moves == [(2, 4)]  # one moves; a second move would only shift the bottleneck
    assert coverage(small_peers, blocks) == [2.0, 2.0, 1.0, 1.0]
    assert upper_bound(small_peers, [2, 2, 2], blocks) == pytest.approx(1.5)


def test_a_peer_steps_aside_so_that_another_can_fill_a_stage_nobody_serves():
    """Small peers (two stages each, one from the last) at [1, 3] and [3, 4]; stage 0 lost its only peer. No single
    move fills it: [1, 3] -> [0, 2] would leave stage 2, which only it holds, and a move never leaves such a stage.
    [3, 4] -> [2, 4] lowers the sorted coverage, but lets the other go to [0, 2]: it is taken, then that one."""
    blocks, lengths = [1.0] * 4, [2, 2, 2, 1]
    peers = {"a": SpanPeer("a", 2.0, 100.0, 1, 3), "b": SpanPeer("b", 3.0, 100.0, 3, 4)}
    made = []
    for _ in range(4):
        for name, peer in sorted(peers.items(), reverse=True):  # b looks first, then a: each sees the other
            others = [p for n, p in peers.items() if n != name]
            span = better_span(peer, others, lengths, blocks, random.Random(0), min_gain=0.1)
            if span is not None:
                peers[name] = SpanPeer(name, peer.compute, peer.network, *span)
                made.append((name, span))
    assert made == [("b", (2, 4)), ("a", (0, 2))]
    assert min(coverage(list(peers.values()), blocks)) > 0
    # seen by "a" first, nothing it may do fills stage 0 now: it stays, and the other's step is still found
    peers = {"a": SpanPeer("a", 2.0, 100.0, 1, 3), "b": SpanPeer("b", 3.0, 100.0, 3, 4)}
    assert better_span(peers["a"], [peers["b"]], lengths, blocks, random.Random(0)) is None
    assert better_span(peers["b"], [peers["a"]], lengths, blocks, random.Random(0)) == (2, 4)
    # before "a" moves, "b" does not step back to [3, 4], though that would raise the sorted coverage
    b_moved = SpanPeer("b", 3.0, 100.0, 2, 4)
    assert better_span(b_moved, [peers["a"]], lengths, blocks, random.Random(0)) is None


def test_spare_holders_come_before_throughput_where_memory_allows():
    """Stage 3 is held by one (fast) peer only; the fast peer at [0, 2] raises the bottleneck (stage 0) by staying,
    but with min_holders 2 it moves to give stage 3 a second holder (its state would otherwise go with one peer),
    where stage 0 keeps two; and a newcomer goes to the thinnest stages first. With min_holders 1 (throughput
    only) neither happens."""
    blocks, lengths = [1.0] * 4, [2, 2, 2, 0]
    others = [
        SpanPeer("a", 2.0, 100.0, 0, 2),
        SpanPeer("b", 2.0, 100.0, 0, 2),
        SpanPeer("c", 20.0, 100.0, 2, 4),
        SpanPeer("d", 2.0, 100.0, 1, 3),
    ]
    fast = SpanPeer("fast", 8.0, 100.0, 0, 2)
    assert holders([*others, fast], 4) == [3, 4, 2, 1]
    assert better_span(fast, others, lengths, blocks, random.Random(0), min_gain=0.1, min_holders=1) is None
    moved = better_span(fast, others, lengths, blocks, random.Random(0), min_gain=0.1, min_holders=2)
    assert moved == (2, 4)
    after = SpanPeer("fast", 8.0, 100.0, *moved)
    assert holders([*others, after], 4) == [2, 3, 3, 2]
    # once every stage has two holders, it does not move back for throughput's sake within min_gain... nor for holders'
    assert better_span(after, others, lengths, blocks, random.Random(0), min_gain=0.1, min_holders=2) is None
    # a newcomer fills the stage a single peer holds, not the throughput's bottleneck
    new = SpanPeer("new", 2.0, 100.0)
    assert choose_span(new, [*others, fast], lengths, blocks, random.Random(0), min_holders=1) == (0, 2)
    assert choose_span(new, [*others, fast], lengths, blocks, random.Random(0), min_holders=2) == (2, 4)


def test_in_a_swarm_of_many_peers_a_stage_a_move_worth_a_tenth_of_the_peer_itself_happens():
    """20 peers of rate 1 on stage 0, 25 on stage 1, one of them could move: the bottleneck (20) rises by 1, 5% of
    it, but all that peer brings. A threshold of 10% of the bottleneck would never let one peer move here; the
    hysteresis is 10% of the peer's own rate. A move that gains less than that stays put."""
    blocks, lengths = [1.0, 1.0], [1, 1]
    crowd = [SpanPeer(f"a{i}", 1.0, float("inf"), 0, 1) for i in range(20)]
    crowd += [SpanPeer(f"b{i}", 1.0, float("inf"), 1, 2) for i in range(24)]
    mover = SpanPeer("m", 1.0, float("inf"), 1, 2)
    assert better_span(mover, crowd, lengths, blocks, random.Random(0), min_gain=0.1) == (0, 1)
    # balanced within one peer: moving would lower stage 1 below where stage 0 is now: no move
    even = [SpanPeer(f"a{i}", 1.0, float("inf"), 0, 1) for i in range(20)]
    even += [SpanPeer(f"b{i}", 1.0, float("inf"), 1, 2) for i in range(20)]
    assert better_span(mover, even, lengths, blocks, random.Random(0), min_gain=0.1) is None
    # the gain (1, its whole rate) is under a threshold of 150% of its own rate: it stays
    assert better_span(mover, crowd, lengths, blocks, random.Random(0), min_gain=1.5) is None


def test_with_spans_every_8gb_gpu_takes_part_in_a_1b_swarm():
    kinds = parse_expect("10x24GB@165TF/200mbit,20x8GB@40TF/50mbit")
    fixed = plan_swarm(new_manifest("x", "llama-1b"), kinds, spans=False)  # 4 stages of 5-6 blocks
    spans = plan_swarm(new_manifest("x", "llama-1b", stages=22), kinds)  # one block a stage
    assert fixed.to_dict()["kinds"][1]["serving"] == 0 and fixed.participation == pytest.approx(1 / 3)
    plan = spans.to_dict()
    assert plan["participation"] == 1.0 and plan["tokens_per_second"] > fixed.tokens_per_second
    small_gpu = plan["kinds"][1]
    assert small_gpu["serving"] == 20 and 1 <= small_gpu["blocks"] < plan["kinds"][0]["blocks"]
    assert small_gpu["memory_bytes"] <= 8e9 * 0.9 and plan["kinds"][0]["memory_bytes"] <= 24e9 * 0.9
    assert plan["bottleneck"] and 0 < plan["share_of_bound"] <= 1.0
    assert min(plan["coverage_samples_per_second"]) > 0


def test_swarm_plan_prints_json_a_user_can_read_and_refuses_bad_machines(capsys):
    from peers.swarm_plan import main

    expect = "10x24GB@165TF/200mbit,20x8GB@40TF/50mbit"
    assert main(["--preset", "llama-1b", "--stages", "22", "--spans", "--expect", expect, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"] == "spans" and plan["compare"]["mode"] == "fixed stages"
    assert plan["tokens_per_second"] > plan["compare"]["tokens_per_second"] > 0
    assert [kind["blocks"] > 0 for kind in plan["kinds"]] == [True, True] and plan["bottleneck"]
    assert all(kind["memory_bytes"] > 0 for kind in plan["kinds"])
    assert main(["--preset", "llama-1b", "--expect", expect, "--json"]) == 0  # no spans: one stage each
    assert json.loads(capsys.readouterr().out)["mode"] == "fixed stages"
    assert main(["--preset", "llama-1b", "--expect", expect]) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert main(["--preset", "llama-1b", "--expect", "24GB@165TF"]) == 2
    assert "COUNTxMEMORY@FLOPS/UPLINK" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--join", "m.json", "--stages", "4", "--expect", expect])  # a manifest has its own stages


def test_a_cpu_serves_unless_it_is_under_a_twentieth_of_the_median_serving_peer():
    assert slow_serving_reason(3.0, []) is None  # nobody serves: it is the only help there is
    assert slow_serving_reason(3.0, [0.0]) is None  # a peer still measuring (rate 0) is no comparison
    assert slow_serving_reason(50.0, [60.0, 80.0, 100.0]) is None  # an all-CPU swarm: the demo's
    reason = slow_serving_reason(3.0, [100.0, 120.0, 5000.0])  # GPUs; one liar does not move the median
    assert reason is not None and "3.0 samples/s through a block, 2.5% of the 120.0" in reason
    assert slow_serving_reason(6.0, [100.0, 120.0, 5000.0]) is None  # 5%: useful
