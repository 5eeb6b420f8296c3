"""Watching a peer and a swarm.

- stats.py: what a peer counts, as one snapshot per moment, which its announcement, status line and metrics read.
- metrics.py: one peer's Prometheus metrics (swarm-peer --metrics-port).
- reader.py: reading a swarm from outside (peer-status, swarm-monitor): records from the DHT, then a document.
- status.py: the status document of a swarm that peer-status shows: pure functions over the records.
- data_progress.py: its "data" section: the trainers' reading of the swarm's data, summarised from their records.
swarm-monitor's own library (history, leaderboard, its page) is swarm/monitor/.
"""
