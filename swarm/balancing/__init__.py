"""Balancing: which stage each peer serves, as pure functions over the peers' announced throughputs (no I/O).

- moves.py: a joining peer's choice of stage (`choose_stage`), and the moves online peers make together
  (`plan_moves`, `should_move`): the decisions swarm/server/rebalancer.py performs.
- optimum.py: how far an assignment is from the best one (`optimal_assignment`, `upper_bound`, `efficiency`),
  for status pages, benchmarks and tests.
"""
