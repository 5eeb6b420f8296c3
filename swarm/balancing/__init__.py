"""Balancing: which stage each peer serves, as pure functions over the peers' announced throughputs (no I/O).

- moves.py: a joining peer's choice of stage (`choose_stage`), and the moves online peers make together
  (`plan_moves`, `should_move`): the decisions swarm/server/rebalancer.py performs.
- spans.py: where a peer serves its span of stages (a spans swarm), over the spans and throughputs peers announce.
- optimum.py: how far an assignment is from the best one (`optimal_assignment`, `upper_bound`, `efficiency`),
  for status pages, benchmarks and tests.
"""
