"""The churn benchmark (`python -m benchmarks.churn`): does a swarm keep training, and keep its progress, while
its peers die, restart and stall? Its parts:

- __main__.py: the entry: arguments, the clean and faults runs, the JSON summary
- peers.py: the settings and the stage peers (identity, port, stage and folder fixed before a first start)
- swarm.py: a run's swarm: its peers, what a poller reads of their announcements, the faults planned and injected
- training.py: the trainers in the benchmark's process, stalls, the final held-out loss
- report.py: what a run's figures say: where restarts took their state from, lost progress, warnings, the summary
"""
