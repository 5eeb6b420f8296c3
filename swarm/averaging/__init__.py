"""Averaging within a stage: the rules of rounds (when, how far, DiLoCo), the 4-bit codec, robust aggregation and
the all-reduces built on hivemind, and the averager a stage server runs."""
