"""swarm-monitor's library (the program itself is peers/swarm_monitor.py).

- sampling.py: what one sample of a swarm is, taken from peer-status' document.
- history.py: the history of a swarm in SQLite, thinned as it ages, and the series the page plots.
- leaderboard.py: the volunteers' leaderboard: what each peer did, across restarts.
- prometheus.py: the whole swarm as Prometheus text (/metrics).
- trackers.py: logging the swarm to TensorBoard or wandb.
- server.py: the web server: the page (page/), its static files and the API.
"""
