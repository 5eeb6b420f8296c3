"""One peer of a swarm: its peer-wide context (context.py: identity, swarm view, traffic, network position, start
time), its start-up before its DHT node runs (startup.py: identity file, reachability, the manifest it publishes)
and the Peer that composes its parts (peer.py). Nothing is imported here: server/ imports the context, and
peer.py imports server/ and client/."""
