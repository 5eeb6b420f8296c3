"""Throughput measurement, its cache, the simulated-speed testing aid, and stage state transfer checks."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.errors import BadRequestError
from swarm.manifests.validation import manifest_from_dict
from swarm.throughput import (
    DeliveredThroughput,
    SimulatedSpeed,
    Throughput,
    cached_compute_throughput,
    compute_cache_key,
    measure_bandwidth,
    measure_compute_throughput,
    network_throughput,
    stage_bytes_per_sample,
)
from swarm.wire.state import load_state_tensors, state_tensors

MANIFEST = manifest_from_dict(tiny_manifest_dict())
CPU = torch.device("cpu")


def test_simulated_speed_slows_the_measurement_in_proportion():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several threads on a busy 2-core machine make timings erratic
    try:
        model = build_stage(MANIFEST, 1)
        normal = max(measure_compute_throughput(model, MANIFEST, CPU, repetitions=5) for _ in range(3))
        simulated = SimulatedSpeed(0.25, reference=normal)
        slow = measure_compute_throughput(model, MANIFEST, CPU, 5, simulated=simulated)
    finally:
        torch.set_num_threads(threads)
    # padded to the emulated device's time: at most a quarter, and only a little less unless the CPU is swamped
    assert 0.15 < slow / normal <= 0.2501, (slow, normal)


def test_compute_figure_is_cached_per_stage_shape(tmp_path):
    path = tmp_path / "throughput.json"
    model = build_stage(MANIFEST, 0)
    first, cached = cached_compute_throughput(model, MANIFEST, 0, CPU, path=path)
    assert not cached and first > 0
    again, cached = cached_compute_throughput(model, MANIFEST, 0, CPU, path=path)
    assert cached and again == first
    _, cached = cached_compute_throughput(model, MANIFEST, 0, CPU, path=path, remeasure=True)  # --throughput eval
    assert not cached
    # another stage shape or another model: another key
    keys = {
        compute_cache_key(MANIFEST, 0, CPU),
        compute_cache_key(MANIFEST, 1, CPU),
        compute_cache_key(manifest_from_dict(tiny_manifest_dict(model={"width": 32})), 0, CPU),
    }
    assert len(keys) == 3


def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path):
    path = tmp_path / "throughput.json"
    path.write_text("{not json")
    value, cached = cached_compute_throughput(build_stage(MANIFEST, 1), MANIFEST, 1, CPU, path=path)
    assert not cached and value > 0
    assert cached_compute_throughput(build_stage(MANIFEST, 1), MANIFEST, 1, CPU, path=path) == (value, True)


def test_network_limit_uses_the_stage_traffic():
    full = manifest_from_dict(tiny_manifest_dict(training={"activation_compression": "float32"}))
    width, length = full.model.width, full.model.context_length
    hidden = width * length * 4
    assert stage_bytes_per_sample(full, 0) == (length * 8 + hidden, hidden)  # tokens + grad in, outputs out
    assert stage_bytes_per_sample(full, 1) == (hidden + length * 8, hidden)  # inputs + targets in, grad out
    half = manifest_from_dict(tiny_manifest_dict(training={"activation_compression": "float16"}))
    assert stage_bytes_per_sample(half, 0)[1] == hidden // 2
    assert MANIFEST.training.activation_compression == "8bit"  # the default: a byte per element
    assert stage_bytes_per_sample(MANIFEST, 0)[1] == hidden // 4
    # 1 MB/s down, 10 MB/s up: the download is the limit
    assert network_throughput(full, 1, 1e6, 1e7) == pytest.approx(1e6 / (hidden + length * 8))
    assert Throughput(compute=50.0, network=20.0).serving == 20.0


def test_bandwidth_is_payload_over_time_without_latency():
    async def exchange(upload: int, download: int) -> None:  # a link of 10 MB/s up, 20 MB/s down, 20 ms latency
        await asyncio.sleep(0.02 + upload / 10e6 + download / 20e6)

    download, upload = asyncio.run(measure_bandwidth(exchange, probe_bytes=2_000_000))
    assert download == pytest.approx(20e6, rel=0.25) and upload == pytest.approx(10e6, rel=0.25)


def test_delivered_throughput_follows_what_was_served():
    ema = DeliveredThroughput(half_life=10.0)
    now, served = time.monotonic(), 0
    ema.update(served, now)
    for _ in range(100):  # 50 samples/s for 100 s
        now, served = now + 1.0, served + 50
        ema.update(served, now)
    assert ema.value == pytest.approx(50.0, rel=0.01)
    for _ in range(10):  # then nothing for one half-life
        now += 1.0
        ema.update(served, now)
    assert ema.value == pytest.approx(25.0, rel=0.05)


# ------------------------------------------------------------------------------------- state transfer


def _trained_stage(seed: int):
    torch.manual_seed(seed)
    model = build_stage(MANIFEST, 1)
    names = [n for n, p in model.named_parameters()]
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.01)
    x = torch.randn(2, MANIFEST.model.context_length, MANIFEST.model.width)
    targets = torch.randint(0, MANIFEST.model.vocab_size, (2, MANIFEST.model.context_length))
    model.loss(model(x), targets).backward()
    optimizer.step()
    return model, names, params, optimizer


def test_state_moves_parameters_and_optimizer_statistics():
    source, names, params, optimizer = _trained_stage(1)
    target = build_stage(MANIFEST, 1)
    target_params = list(target.parameters())
    target_optimizer = torch.optim.AdamW(target_params, lr=0.01)
    load_state_tensors(state_tensors(names, params, optimizer), names, target_params, target_optimizer)
    for a, b in zip(params, target_params):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["exp_avg_sq"], target_optimizer.state[b]["exp_avg_sq"])
        assert float(target_optimizer.state[b]["step"]) == 1.0


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda items: items[:-1] if items[-1][0].startswith("param/") else [i for i in items if i[0] != items[0][0]],
        lambda items: items + [("param/not.a.parameter", torch.zeros(1))],
        lambda items: [(n, torch.zeros(3) if i == 0 else t) for i, (n, t) in enumerate(items)],
        lambda items: [(n, t.double() if i == 0 else t) for i, (n, t) in enumerate(items)],
        lambda items: [(n, t.fill_(float("nan")) if i == 1 else t) for i, (n, t) in enumerate(items)],
        lambda items: items + [items[0]],
        lambda items: [i for i in items if not i[0].endswith("/exp_avg")],
        lambda items: [(n, torch.tensor(-1.0) if n.endswith("/step") else t) for n, t in items],
        lambda items: [(n, torch.tensor(2.5) if n.endswith("/step") else t) for n, t in items],
        lambda items: [(n, -t - 1 if n.endswith("/exp_avg_sq") else t) for n, t in items],
    ],
    ids=[
        "missing",
        "foreign",
        "shape",
        "dtype",
        "nan",
        "twice",
        "partial-optimizer",
        "negative-step",
        "step-2.5",
        "negative-exp-avg-sq",
    ],
)
def test_a_bad_state_is_refused_and_changes_nothing(corrupt):
    source, names, params, optimizer = _trained_stage(1)
    target = build_stage(MANIFEST, 1)
    target_params = list(target.parameters())
    before = [p.detach().clone() for p in target_params]
    target_optimizer = torch.optim.AdamW(target_params, lr=0.01)
    with pytest.raises(BadRequestError):
        load_state_tensors(corrupt(state_tensors(names, params, optimizer)), names, target_params, target_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, target_params))
    assert len(target_optimizer.state) == 0
