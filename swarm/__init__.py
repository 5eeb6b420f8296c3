"""Swarm: decentralized pipeline-parallel training over hivemind's DHT and libp2p."""

__version__ = "0.1.0"

# Version of the wire protocol between peers (stage RPC messages and announcement records).
# Peers refuse requests and records that carry another version.
PROTOCOL_VERSION = 5

from swarm import hivemind_limits  # noqa: E402, F401 (limits on what hivemind reads from the network)
