"""What serves a stage: one StageServer (stage.py) composed of the parts below. It may call other peers through
swarm/client/ (forwarding, state downloads, probes); nothing in client/ imports it.

- stage.py: StageServer, from joining a stage to shutdown; rebalancer.py: which stage, and moves.
- service.py: the RPC handlers; request_path.py: the one path of a request (admission, slot, worker, error reply);
  admission.py: who may hand the stage work and how much; forwarding.py: passing a microbatch on to the next stage.
- worker.py: the one thread that touches the model; compute.py: the model, optimizer and what changes with them;
  precision.py: loss scaling for float16; staleness.py: the learning rate of late gradients.
- rounds.py: when the stage averages; takeover.py: where its state comes from; checkpoint.py: its files on disk.
- announcer.py: its announcement; measurement.py: its throughput; reachability.py: can others dial this peer.
"""
