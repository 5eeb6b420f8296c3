"""The contract between peers, used by both sides (server/ answers by it, client/ calls by it; it imports neither):

- rpc.py: the RPCs a peer answers, their names on the wire and their protobuf types (hivemind servicers whose
  stubs the client uses and whose methods the server implements);
- messages.py: what requests and replies hold, how they are built and read, and streaming of large ones;
- validation.py: every check of a request's metadata and tensors before it reaches a model;
- tensors.py: codecs of activations and gradients, and the gradient fingerprints both sides compute;
- four_bit.py: the 4-bit codec of activations and gradients (NF4 levels, a bfloat16 scale per token);
- codes.py: the one enumeration of error codes and the one map from exceptions to codes;
- hops.py: a hop's deadlines and budgets, which codes blame a peer, reply checks, hop timings;
- state.py: the layout of a stage's state, as a state download and a checkpoint carry it;
- boundary.py: what crosses a stage boundary by the kind of swarm: the width of hidden states on the wire, and the
  token tensor (targets, or a subspace swarm's window) that travels with them.
"""
