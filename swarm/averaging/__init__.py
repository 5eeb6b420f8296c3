"""Averaging within a stage: the peers serving one stage average their parameters (or DiLoCo's pseudo-gradients)
in rounds, over hivemind.

- rules.py: the pure parts: when a round is due, DiLoCo's outer step, how far a result may move, round timing.
- averager.py: StageAverager, what this peer contributes to a round, and how a result is checked and applied.
- robust_aggregation.py: the aggregation of one part that a replica sending wrong values cannot spoil (pure).
- robust_allreduce.py: hivemind's all-reduce with that aggregation, and strikes and exclusions of dishonest peers.
- identical_allreduce.py: an all-reduce whose result is the same, bit for bit, at every peer (DiLoCo's anchor).
- quantization.py: the 4-bit codec of DiLoCo's pseudo-gradients, registered with hivemind.
How a server schedules rounds is swarm/server/rounds.py's.
"""
