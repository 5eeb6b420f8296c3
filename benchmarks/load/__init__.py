"""The load benchmark (`python -m benchmarks.load`): one stage peer under many concurrent trainers, past its queue
limit. Its parts:

- __main__.py: the entry: the peer, the run, the JSON line
- clients.py: the clients that send training forwards, and the tally of what they saw
"""
