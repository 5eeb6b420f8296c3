"""What serves a stage: one StageServer (stage.py) composed of the parts below. It may call other peers through
swarm/client/ (forwarding, state downloads, probes); nothing in client/ imports it.

- stage.py: StageServer, from joining a stage to shutdown; rebalancer.py: which stage, and moves.
- service.py: the RPC handlers; request_path.py: the one path of a request (admission, slot, worker, error reply);
  admission.py: who may hand the stage work and how much; forwarding.py: passing a microbatch on to the next stage.
- worker.py: the one thread that touches the model; compute.py: the model, optimizer and what changes with them;
  precision.py: loss scaling for float16; staleness.py: the learning rate of late gradients.
- rounds.py: when the stage averages; takeover.py: where its state comes from; checkpoint.py: its files on disk.
- context.py: the peer-wide context (identity, swarm view, traffic, network position) its parts share.
- dispatch.py: a peer's stage RPC handlers, registered once, each request to the stage it names.
- step_gate.py: many microbatches in flight at the loss of one; activation_cache.py: the forwards kept for
  their backward; shedding.py: what a stage sheds when out of memory; offload.py: the optimizer's statistics in RAM.
- parking.py: a paused stage's tensors parked in RAM; handover.py: a clean leave hands the stages only this peer
  serves to another; backups.py: another peer's copy of such a stage; checkpoint_sharing.py: checkpoints handed
  to other peers over RPC, announced in the DHT.
- announcer.py: its announcement; measurement.py: its throughput; reachability.py: can others dial this peer.
"""
