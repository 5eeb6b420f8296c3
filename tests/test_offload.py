"""--offload-optimizer (swarm/server/offload.py): stepping parameter by parameter, with the statistics brought to
the device for each, gives the numbers of a whole step; between steps the statistics are in RAM."""

from __future__ import annotations

import copy

import pytest
import torch

from swarm.server.offload import OffloadedStatistics


def model_and_optimizer(device: torch.device, optimizer: str = "adamw"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 50))
    model.to(device)
    if optimizer == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, step, zero, steps: int, device: torch.device, optimizer) -> None:
    generator = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randint(0, 50, (4, 8), generator=generator).to(device)
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        if i == 2:  # a parameter without a gradient in this step is left alone, as a whole step leaves it
            model[1].bias.grad = None
        optimizer.param_groups[0]["lr"] *= 0.9  # the staleness control changes the rate between steps
        step()
        zero()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_step_parameter_by_parameter_equals_a_whole_step(kind):
    cpu = torch.device("cpu")
    plain, plain_optimizer = model_and_optimizer(cpu, kind)
    offloaded, optimizer = model_and_optimizer(cpu, kind)
    statistics = OffloadedStatistics(optimizer, cpu)
    train(plain, plain_optimizer.step, plain_optimizer.zero_grad, 6, cpu, plain_optimizer)
    train(offloaded, statistics.step, optimizer.zero_grad, 6, cpu, optimizer)
    for a, b in zip(plain.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)
        for key, value in plain_optimizer.state[a].items():
            assert torch.equal(value, optimizer.state[b][key]), key
    # every parameter is in its group again, in order (checkpoints and averaging read them there)
    assert optimizer.param_groups[0]["params"] == list(offloaded.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_statistics_stay_in_ram_between_steps():
    cuda = torch.device("cuda")
    plain, plain_optimizer = model_and_optimizer(cuda)
    offloaded, optimizer = model_and_optimizer(cuda)
    statistics = OffloadedStatistics(optimizer, cuda)
    train(plain, plain_optimizer.step, plain_optimizer.zero_grad, 6, cuda, plain_optimizer)
    train(offloaded, statistics.step, optimizer.zero_grad, 6, cuda, optimizer)
    assert statistics.device_bytes() == 0
    for a, b in zip(plain.parameters(), offloaded.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
        assert optimizer.state[b]["exp_avg"].device.type == "cpu"
    # a state loaded onto the device goes back to RAM
    for p in offloaded.parameters():
        optimizer.state[p]["exp_avg"] = optimizer.state[p]["exp_avg"].to(cuda)
    assert statistics.device_bytes() > 0
    statistics.offload()
    assert statistics.device_bytes() == 0


def test_on_a_cpu_nothing_moves():  # its device is its RAM: the statistics stay where they are
    cpu = torch.device("cpu")
    model, optimizer = model_and_optimizer(cpu)
    before = copy.deepcopy(list(model.parameters()))
    statistics = OffloadedStatistics(optimizer, cpu)
    train(model, statistics.step, optimizer.zero_grad, 2, cpu, optimizer)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert statistics.device_bytes() == 0 and not statistics._host  # on a CPU nothing moves
