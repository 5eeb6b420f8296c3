"""Peers that misbehave on purpose, run as real processes by tests/test_adversaries.py (never part of the library)."""
