"""Swarm: decentralized pipeline-parallel training over hivemind's DHT and libp2p.

The packages, from the contract up (each package's __init__ maps its modules; tests/test_layout.py checks that no
package imports one above it):

- manifests/: the manifest that defines a swarm; architectures/: the models; wire/: the contract between peers.
- dht/: finding peers and keeping records; network/: where a peer sits in the internet; trust/: trust between
  strangers; dataset/: training data; hf/: Hugging Face in and out; averaging/, balancing/, capacity/: averaging
  within a stage, which stage a peer serves, what a peer can hold.
- client/: what calls other peers' stages (the trainer); watch/: watching a peer and a swarm; monitor/: the page.
- server/: what serves a stage; peer/: one peer, composing both; preflight/: swarm-peer --check.
- local/: a whole swarm on one machine (peer processes, emulated links), for swarm-demo, tests and benchmarks.

Plain modules: errors.py (the one exception hierarchy), events.py (what a peer reports to its program), files.py
(atomic writes), lifetime.py (children that end with their parent), routing.py (a trainer's choice of route),
throughput.py (the figures' math), pipeline_schedule.py (a synchronous pipeline's step over home links).
"""

__version__ = "0.1.0"

# Version of the wire protocol between peers (stage RPC messages and announcement records).
# Peers refuse requests and records that carry another version.
PROTOCOL_VERSION = 7

import warnings  # noqa: E402

from swarm.averaging import quantization  # noqa: E402 (a 4-bit codec)
from swarm.dht import hivemind_calls, hivemind_futures  # noqa: E402 (calls and futures that cannot jam)
from swarm.trust import hivemind_limits  # noqa: E402, F401 (limits on hivemind's reading)

quantization.install()
hivemind_futures.install()
hivemind_calls.install()

# hivemind's 8-bit codec (activations by default, and averaging) calls torch.quantize_per_tensor, which torch
# 2.13 marks deprecated; the warning is for hivemind's authors, not for someone running a peer
warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
