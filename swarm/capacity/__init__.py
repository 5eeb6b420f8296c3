"""What a peer can hold and do, and what a swarm of expected machines would do, before anyone starts.

- costs.py: the memory a span of stages costs for a manifest's settings (weights, gradients, optimizer state,
  kept activations, transients), and how many stages fit in a budget (pure arithmetic).
- budget.py: the memory a peer may use (free GPU memory or RAM, a `--max-memory` cap, a margin), and the one-line
  refusal of a peer that cannot hold a single stage (the I/O edge: it reads the device).
- role.py: whether a CPU peer's speed is a useful share of the serving peers' (else it trains only).
- plan.py: `swarm-plan`: the spans each kind of expected machine would serve, the swarm's tokens/s and its
  bottleneck, from costs.py and swarm/balancing/spans.py, the functions peers use.
"""
