"""Watching a swarm and a peer: what a peer counts (stats), the status document peer-status shows, reading a
swarm from outside, and Prometheus metrics."""
