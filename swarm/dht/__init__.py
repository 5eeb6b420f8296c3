"""The DHT: where peers find each other and keep their small records.

- node.py: starting a hivemind DHT node with clear errors, making it sign and check the swarm's records,
  removing sockets a failed daemon leaves, and the addresses worth giving to others.
- records.py: the keys and records peers keep there (stage announcements, trainer reports), validated on reading.
- hivemind_calls.py: hivemind's unary calls made safe when a caller gives up as its reply arrives.
- hivemind_futures.py: hivemind's futures made safe when a forked child is killed (a lock per process).
- announcement_cache.py: the peer's cached view of the stages' announcements, shared by its parts.
"""
