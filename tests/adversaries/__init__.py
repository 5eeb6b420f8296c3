"""Peers that misbehave on purpose, run as real processes by tests/test_adversaries.py and
tests/test_attacks_on_one_swarm.py (never part of the library)."""
