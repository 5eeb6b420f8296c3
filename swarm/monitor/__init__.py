"""swarm-monitor's library: the history database, the volunteers' leaderboard, the swarm's Prometheus text, the
experiment trackers, and the web server with its page. The program itself is peers/swarm_monitor.py."""
