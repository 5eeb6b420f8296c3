"""Swarm: decentralized pipeline-parallel training over hivemind's DHT and libp2p."""

__version__ = "0.1.0"

# Version of the wire protocol between peers (stage RPC messages and announcement records).
# Peers refuse requests and records that carry another version.
PROTOCOL_VERSION = 7

import warnings  # noqa: E402

from swarm.averaging import quantization  # noqa: E402 (a 4-bit codec)
from swarm.dht import hivemind_futures  # noqa: E402 (futures that a killed child cannot block)
from swarm.trust import hivemind_limits  # noqa: E402, F401 (limits on hivemind's reading)

quantization.install()
hivemind_futures.install()

# hivemind's 8-bit codec (activations by default, and averaging) calls torch.quantize_per_tensor, which torch
# 2.13 marks deprecated; the warning is for hivemind's authors, not for someone running a peer
warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
