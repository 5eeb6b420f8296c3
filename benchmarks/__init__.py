"""Benchmarks: one module per question (a folder where it has parts), each run from the repository's root as
`python -m benchmarks.NAME` (`--help` for its options) and printing its figures as JSON lines; docs/BENCHMARKS.md
has the results. Here, by file: what it measures, and its command.

- balance.py: unequal local peers choosing stages, against static and optimal    `python -m benchmarks.balance`
- balance_sim.py: balancing at internet scale, 1,000 simulated peers with churn  `python -m benchmarks.balance_sim`
- checks.py: trainers' checks: their cost, false accusations, time to convict    `python -m benchmarks.checks`
- churn/: training and progress kept while peers die, restart and stall          `python -m benchmarks.churn`
- convergence.py: averaging replicas against synchronous data parallel           `python -m benchmarks.convergence`
- departures.py: peers leaving a spans swarm: state lost, stalls, loss           `python -m benchmarks.departures`
- link_calls.py: one libp2p call over an emulated home link, by request size     `python -m benchmarks.link_calls`
- load/: one stage peer under many concurrent trainers, past its queue limit     `python -m benchmarks.load`
- memory.py: a preset stage's memory, with and without activation checkpointing  `python -m benchmarks.memory`
- models.py: tiny Llama against tiny GPT, held-out bits per byte                 `python -m benchmarks.models`
- monitor.py: swarm-monitor's memory, history size and page load time            `python -m benchmarks.monitor`
- offload.py: what --offload-optimizer costs an optimizer step                   `python -m benchmarks.offload`
- pipeline.py: one process against a local swarm of one peer per stage           `python -m benchmarks.pipeline`
- poisoning.py: four averaging replicas, one hostile: the honest ones' loss      `python -m benchmarks.poisoning`
- protocol_nanogpt.py: Protocol NanoGPT replica, steps to a loss x step time     `python -m benchmarks.protocol_nanogpt`
- public_data/: a corpus published over HTTP against a local copy                `python -m benchmarks.public_data`
- span_sim.py: spans against fixed stages on volunteers' GPUs, simulated         `python -m benchmarks.span_sim`
- span_swarm.py: a real swarm serving spans against equal stages                 `python -m benchmarks.span_swarm`
- stage_traffic.py: bytes per token at a stage boundary, and their cost in loss  `python -m benchmarks.stage_traffic`
- staleness.py: many microbatches in flight per stage: held-out loss             `python -m benchmarks.staleness`
- startup.py: a peer's seconds from process start to serving, new and restarted  `python -m benchmarks.startup`
- wan.py: a 3-stage swarm behind emulated home links, and GPU scenarios          `python -m benchmarks.wan`

Shared by them (not benchmarks):
- common.py: a benchmark's manifest, a start's milestones, waiting for a swarm, a swarm's held-out loss
- gpu_scenarios.py: links as a GPU would see them (wan.py's scenarios, protocol_nanogpt.py's score)
"""
