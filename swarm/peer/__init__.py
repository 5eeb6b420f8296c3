"""One peer of a swarm: the Peer that composes its parts (peer.py: its context, stage servers, trainer, pinger).
Nothing is imported here; peer.py imports server/ and client/.

- peer.py: the Peer, from start to a clean stop (a hand-over of the stages only it serves).
- startup.py: its start-up, one call for any program: initial peers, identity, reachability, the DHT node, then
  the manifest, signed records and the clock in the event loop; the manifest a new swarm's first peer publishes.
- clock.py: the clock check of a starting peer, against its initial peers'.
- owner.py: the owner's rules: the hours a peer may run and yielding the GPU to the owner's programs."""
